"""The body of ``rlvla3 eval``: evaluate a checkpoint with a benchmark's protocol
(``sim/protocols.py``) on the run's own roles, an eval rollout server and ``--workers`` eval env
workers started by the launcher, and report (docs/evaluation.md).

The protocol's episode list is built first; episodes already in ``OUT/episodes.jsonl`` (an
earlier, interrupted evaluation into the same ``--out``) are not played again. The rest go to
the run's Redis, where the workers take them one at a time; the head's launcher appends each
result to ``episodes.jsonl`` as it arrives and ends the run when none is left. Then
``OUT/eval.json`` and the table.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlvla3.config.run_config import Config, apply_override, config_from_dict, dump_config
from rlvla3.config.run_config import load_config as load_yaml_config
from rlvla3.config.typed_load import ConfigError
from rlvla3.config.yaml12 import parse_yaml
from rlvla3.launch.cluster import find_seat
from rlvla3.launch.eval_report import (
    EPISODES_FILE,
    build_report,
    drop_torn_lines,
    failed_result,
    read_episodes,
    table,
    write_report,
)
from rlvla3.launch.launcher import Launcher
from rlvla3.launch.rendezvous import read_run_info
from rlvla3.launch.run_dir import config_path
from rlvla3.launch.stop_reason import StopKind, StopReason
from rlvla3.runtime.checkpoints import find_checkpoint
from rlvla3.runtime.eval_queue import MAX_ATTEMPTS, EvalQueue
from rlvla3.runtime.registry import Registry
from sim.protocols import Protocol, ProtocolEpisode, file_safe, merged, protocol_for

_REQUEUE_EVERY_S = 2.0  # how often the head looks for episodes whose worker died
_QUEUE_WITHIN_S = 120.0  # the episodes are queued by then even if some worker is not up
STAMP_FILE = "eval_run.json"
"""What an ``--out`` holds the results of (checkpoint, protocol, sampling), to resume only the
same evaluation."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalRequest:
    """What ``rlvla3 eval`` was asked (its arguments)."""

    source: str
    """A checkpoint file, a checkpoints dir or a run dir (its newest checkpoint)."""
    config: str | None = None
    """The run's launch YAML (default: the run dir's ``config.yaml``)."""
    suite: str | None = None
    """A LIBERO suite to evaluate on (else ``env`` or the run's ``env.id``)."""
    env: str | None = None
    """An env id to evaluate on (default: the run's ``env.id``)."""
    episodes: int | None = None
    """Episodes per LIBERO task, else in all (default: the protocol's)."""
    seed: int = 0
    """First reset seed of a seeded protocol (not LIBERO's fixed initial states)."""
    sample: bool = False
    """Act by sampling the policy instead of greedily."""
    workers: int = 1
    """Eval env worker processes."""
    videos: int = 0
    """GIFs of the first this many episodes."""
    out: str | None = None
    """Where results go (default: ``eval-<protocol>`` beside the checkpoint's run dir)."""
    overrides: tuple[str, ...] = ()
    """``--set`` overrides of the evaluation run's config."""


def evaluate(request: EvalRequest, echo: Callable[[str], None] = print) -> int:
    """Run ``request`` to the end; returns the exit code (0: every episode evaluated)."""
    if request.workers < 1:
        raise ConfigError(f"--workers: need at least 1, got {request.workers}")
    if request.episodes is not None and request.episodes < 1:
        raise ConfigError(f"--episodes: need at least 1, got {request.episodes}")
    if request.seed < 0:  # (simulators refuse negative reset seeds)
        raise ConfigError(f"--seed: need at least 0, got {request.seed}")
    checkpoint = _newest_intact(request.source)
    base = load_yaml_config(request.config or _run_config(checkpoint, request.source))
    try:
        protocol = protocol_for(
            suite=request.suite,
            env_id=request.env or base.env.id,
            episodes=request.episodes,
            seed=request.seed,
        )
    # ImportError: the simulator is not installed (its message says how to install it)
    except (ValueError, ImportError) as err:
        raise ConfigError(f"the protocol: {err}") from None
    cfg = eval_config(base, protocol, checkpoint, request)
    run_dir = _out_dir(request, checkpoint, protocol)
    meta = {"checkpoint": str(checkpoint), "greedy": not request.sample}
    same = {
        "overrides": list(request.overrides),
        # the run's config as given (--config, or the run dir's): another env setup is
        # another evaluation
        "config_sha256": hashlib.sha256(dump_config(base).encode()).hexdigest(),
    }
    done = _resume(run_dir, protocol, meta | same)
    todo = [e for e in protocol.episodes if e.key not in done]
    echo(
        f"{protocol.name}: {len(protocol.episodes)} episodes ({protocol.reference}); "
        f"{len(done)} done before, {len(todo)} to play with {request.workers} worker(s)"
    )
    code = 0
    if todo:
        listed = [e.to_dict() for e in todo]
        hooks = ProtocolHooks(protocol, run_dir / EPISODES_FILE, listed, request.workers)
        hooks.count_earlier(done.values())
        code = Launcher(
            cfg, run_dir, find_seat(cfg, None, alone_on_host=False), echo=echo, hooks=hooks
        ).run()
    report = build_report(protocol, read_episodes(run_dir / EPISODES_FILE), meta)
    path = write_report(run_dir, report)
    echo(table(report))
    echo(f"wrote {path}" + ("" if report["complete"] else " (incomplete: run it again to resume)"))
    return code if report["complete"] else (code or 1)


def eval_config(base: Config, protocol: Protocol, checkpoint: Path, request: EvalRequest) -> Config:
    """The evaluation run's config: ``base`` (the checkpoint's run) with only the eval roles,
    the protocol's first env (its spaces shape the policy), the checkpoint's weights, no stop
    rule (the episode list ends it), on this host."""
    raw: dict[str, Any] = parse_yaml(dump_config(base))
    roles = raw.get("roles", {})
    first = protocol.episodes[0]
    raw["roles"] = {
        "eval_env_worker": _role(roles.get("env_worker"), request.workers),
        "eval_rollout_server": _role(roles.get("rollout_server"), 1),
    }
    raw.pop("nodes", None)
    run = raw.setdefault("run", {})
    run["name"] = "eval-" + file_safe(protocol.name)
    run["stop"] = {}
    run["eval"] = {"protocol": True, "sample": request.sample, "videos": request.videos}
    env = raw.setdefault("env", {})
    env.update(
        id=first.env_id,
        kwargs=merged(env.get("kwargs", {}), first.env_kwargs),
        num_envs_per_worker=1,
        envs_per_request=1,
        vectorized=False,
    )
    env.pop("straggler", None)
    # nothing trains: the training algorithm's settings (GRPO's group size, which must divide
    # the one env per worker here) would only fail the checks
    raw.pop("algo", None)
    policy = raw.setdefault("policy", {})
    policy.update(init_checkpoint=str(checkpoint), init_launch=None)
    for item in request.overrides:
        apply_override(raw, item)
    return config_from_dict(raw)


def _role(trained: dict[str, Any] | None, count: int) -> dict[str, Any]:
    """An eval role with the settings and CPU pinning of the training role it stands for."""
    role: dict[str, Any] = {"count": count}
    for key in ("settings", "cpus", "restart"):
        if trained and trained.get(key):
            role[key] = trained[key]
    return role


def _newest_intact(source: str) -> Path:
    """The checkpoint file ``source`` names, resolved (a run dir's newest intact one).

    Raises:
        ConfigError: there is none.
    """
    found = find_checkpoint(source)
    if found is None:
        raise ConfigError(f"{source}: no checkpoint there (a .pt file or a run dir)")
    return found.resolve()


def _run_config(checkpoint: Path, source: str) -> Path:
    """The ``config.yaml`` of the run ``checkpoint`` belongs to."""
    for folder in (Path(source), checkpoint.parent, checkpoint.parent.parent):
        if config_path(folder).is_file():
            return config_path(folder)
    raise ConfigError(f"{source}: no config.yaml beside the checkpoint; give --config YAML")


def _out_dir(request: EvalRequest, checkpoint: Path, protocol: Protocol) -> Path:
    if request.out:
        return Path(request.out).resolve()
    name = "eval-" + file_safe(protocol.name)
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    return (run / name).resolve()


def _resume(run_dir: Path, protocol: Protocol, meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The episodes an earlier evaluation into ``run_dir`` finished, when it was this same
    evaluation (``meta``: checkpoint, sampling, overrides; and the protocol's exact episode
    list); stamps ``run_dir`` with this evaluation.

    Raises:
        ConfigError: ``run_dir`` holds another evaluation's results.
    """
    stamp = {**meta, "protocol": protocol.name, "episodes_sha256": _episodes_digest(protocol)}
    path = run_dir / STAMP_FILE
    if not path.is_file() and read_run_info(run_dir) is not None:
        raise ConfigError(
            f"--out {run_dir}: holds a run that is not an evaluation (its run.json, "
            f"no {STAMP_FILE}); choose another --out"
        )
    if path.is_file():
        earlier = json.loads(path.read_text())
        # a field an earlier stamp lacks is not compared (its records are all kept below)
        differs = sorted(k for k in stamp if k in earlier and earlier[k] != stamp[k])
        if differs:
            raise ConfigError(
                f"--out {run_dir}: holds the results of another evaluation (its "
                f"{', '.join(differs)} differ: {STAMP_FILE}); choose another --out"
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamp, indent=2) + "\n")
    episodes = run_dir / EPISODES_FILE
    # a killed writer's torn last line would swallow the next record appended after it
    drop_torn_lines(episodes)
    keys = {e.key for e in protocol.episodes}
    return {k: r for k, r in read_episodes(episodes).items() if k in keys}


def _episodes_digest(protocol: Protocol) -> str:
    """The protocol's episode list in a few characters: any other task subset, episode count
    or seed is another list."""
    listed = "\n".join(json.dumps(e.to_dict(), sort_keys=True) for e in protocol.episodes)
    return hashlib.sha256(listed.encode()).hexdigest()


class ProtocolHooks:
    """The head launcher's part in a protocol evaluation (a ``RunHooks``): queue the episodes
    once every worker is running (the first one up would otherwise play a short list alone),
    keep each result as it arrives, put back those of dead workers, end when all are in."""

    def __init__(
        self, protocol: Protocol, episodes_file: Path, todo: list[dict[str, Any]], workers: int
    ):
        self.protocol = protocol
        self.workers = workers
        """Eval env workers to wait for before queueing."""
        self.episodes_file = episodes_file
        self.todo = todo
        self.wanted = {e["key"] for e in todo}
        self.recorded: set[str] = set()
        self.successes = 0
        self.earlier, self.earlier_successes = 0, 0  # an interrupted evaluation's, resumed
        self._read = 0  # results taken from Redis so far
        self._next_requeue = 0.0
        self._queue: EvalQueue | None = None
        self._queue_by: float | None = None  # (monotonic) None: queued

    def count_earlier(self, results: Iterable[dict[str, Any]]) -> None:
        """Count the results an earlier, interrupted evaluation into the same ``--out`` left
        (not played again) in the progress line's episodes and success rate."""
        for result in results:
            self.earlier += 1
            self.earlier_successes += bool(result.get("success"))

    def started(self, registry: Registry) -> None:
        self._queue = EvalQueue(registry)
        self._queue.fill([])  # nothing of an earlier launch's list is left
        self._queue_by = time.monotonic() + _QUEUE_WITHIN_S

    def check(self, registry: Registry) -> StopReason | None:
        queue = self._queue or EvalQueue(registry)
        if self._queue_by is not None:
            running = [
                r for r in registry.roles() if r.role == "eval_env_worker" and r.status == "running"
            ]
            if len(running) >= self.workers or time.monotonic() >= self._queue_by:
                queue.fill(self.todo)
                self._queue_by = None
        fresh = queue.results(self._read)
        self._read += len(fresh)
        self._record(fresh)
        now = time.monotonic()
        if now >= self._next_requeue:
            self._next_requeue = now + _REQUEUE_EVERY_S
            live = {(f"{r.role}/{r.index}", r.pid) for r in registry.roles() if r.alive}
            given_up = queue.requeue_orphans(lambda worker, pid: (worker, pid) in live)
            self._record([self._failed(raw) for raw in given_up])
        if self.recorded >= self.wanted:
            return StopReason(StopKind.JOB_DONE, f"evaluated all {len(self.wanted)} episodes")
        return None

    def _record(self, results: list[dict[str, Any]]) -> None:
        """Append results not recorded yet to ``episodes.jsonl`` (a requeued episode whose
        worker was not dead after all may finish twice: its first result counts)."""
        lines = []
        for result in results:
            key = result.get("key")
            if key in self.wanted and key not in self.recorded:
                self.recorded.add(key)
                self.successes += bool(result.get("success"))
                lines.append(json.dumps(result) + "\n")
        if lines:
            with open(self.episodes_file, "a") as f:
                f.writelines(lines)
                f.flush()

    def _failed(self, raw: str) -> dict[str, Any]:
        """The failed result of an episode (as queued by ``started``) given up after its
        players died ``MAX_ATTEMPTS`` times."""
        episode = ProtocolEpisode.from_dict(json.loads(raw))  # (queued here: readable)
        return failed_result(episode, f"its worker died while playing it {MAX_ATTEMPTS} times")

    def progress_line(self, registry: Registry, elapsed_s: float) -> str | None:
        played, wanted = len(self.recorded), len(self.wanted)
        done, total = self.earlier + played, self.earlier + wanted
        waiting, playing = (self._queue or EvalQueue(registry)).pending()
        filled = round(20 * done / total) if total else 20
        rate = played / elapsed_s if elapsed_s > 0 else 0.0  # (this launch's)
        eta = f", about {(wanted - played) / rate / 60:.1f} min left" if rate > 0 else ""
        successes = self.earlier_successes + self.successes
        success = f", success {successes / done:.3f}" if done else ""
        return (
            f"[{'#' * filled}{'.' * (20 - filled)}] {done}/{total} episodes{success}; "
            f"{playing} playing, {waiting} waiting; {rate * 60:.1f} episodes/min{eta}"
        )
