"""The launcher: starts every role process of a run on this host, supervises, stops them.

One YAML describes the run. ``rlvla3 launch cfg.yaml`` starts all roles here; ``--node NAME``
starts only that node's roles (multi-host runs: every node runs the same command against one
configured Redis). Processes start with ``Popen([sys.executable, "-m", "roles.<name>", ...])``,
never a shell, each with its own log file. A role that exits with an error is restarted per its
restart policy; a role out of restarts fails the run. The first Ctrl-C (or SIGTERM) stops all
roles gracefully, the second kills them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from rlvla3.checkpoints import find_checkpoint
from rlvla3.config import Config, dump_config, load_config
from rlvla3.redis_server import EmbeddedRedis
from rlvla3.registry import Registry
from rlvla3.run_report import evaluation_episodes, progress_line, stop_condition, write_report
from rlvla3.signals import install_stop_signals
from rlvla3.typed_load import ConfigError

_TICK_S = 0.2
_STOPPED_BY_SIGNAL = "stopped by signal"
_HEAD_GRACE_S = 300.0  # a head launch mark younger than this counts as this run's
# Producers stop first, so every queue is drained by its consumer before the consumer stops.
STOP_ORDER = ("env_worker", "rollout_server", "trainer", "sft_trainer", "weight_broadcaster")
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


@dataclass(slots=True)
class RoleProcess:
    """One supervised role instance."""

    role: str
    index: int
    node: str
    log_path: Path
    popen: subprocess.Popen | None = None
    restarts: int = 0
    restart_at: float | None = None
    finished: bool = False
    failed: bool = False


class Launcher:
    """Starts, supervises and stops the role processes of one run on this host.

    Args:
        cfg: the validated run config.
        run_dir: where the resolved config, logs, checkpoints and reports go.
        node: start only this node's roles (None: every role, all on this host).
        echo: where progress lines go.
    """

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        node: str | None = None,
        echo: Callable[[str], None] = print,
    ) -> None:
        if node is not None:
            cfg.node(node)  # raises if unknown
            if cfg.run.redis_url is None and len(cfg.nodes) > 1:
                raise ConfigError("run.redis_url: required when --node starts part of a run")
        self.cfg = cfg
        self.run_dir = run_dir
        self.node = node
        self.echo = echo
        self.stop_requested = threading.Event()
        self.kill_requested = threading.Event()
        self.procs: list[RoleProcess] = []
        self.registry: Registry | None = None
        self.redis_lost = False
        if not any(node is None or n == node for role in cfg.roles for n in cfg.placement(role)):
            where = f"on node {node!r}" if node is not None else "in this config"
            raise ConfigError(f"roles: no role processes to start {where} (a run needs roles: "
                              "see launch/cartpole.yaml)")  # fmt: skip

    # --- public ----------------------------------------------------------------------------------
    def run(self) -> int:
        """Run to the end; returns 0 on a clean stop, 1 if a role failed for good or the run's
        Redis was lost, 130 if stopped by a signal (Ctrl-C)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self._install_signal_handlers()
        with self._redis() as url:
            cfg = _with_redis_url(self.cfg, url)
            # the config as given (an embedded Redis's URL goes to run.json only), so that
            # config.yaml can be launched again
            config_path = self._write_run_files(self.cfg, url)
            self.registry = Registry(url, cfg.run.name)
            started = time.monotonic()
            try:
                self._join_run(cfg)
                self._start_all(cfg, config_path)
                reason = self._supervise(cfg, started)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
                reason = f"lost the run's Redis at {url} ({err})"
                self.redis_lost = True
            finally:
                self._stop_all(cfg.run.stop_timeout_s)
            failed = [p for p in self.procs if p.failed]
            wall_s = time.monotonic() - started
            if self.redis_lost:
                _write_partial_report(self.run_dir, cfg, wall_s, reason)
            else:
                write_report(self.registry, cfg, self.run_dir, wall_s, reason)
            self.echo(f"run {cfg.run.name} ended: {reason}; run dir {self.run_dir}")
            self.registry.close()
        if failed or self.redis_lost:
            return 1
        return 130 if reason == _STOPPED_BY_SIGNAL else 0

    # --- start and supervise -------------------------------------------------------------------
    @contextlib.contextmanager
    def _redis(self) -> Iterator[str]:
        if self.cfg.run.redis_url is not None:
            yield self.cfg.run.redis_url
            return
        with EmbeddedRedis() as server:
            self.echo(f"started embedded redis-server at {server.url}")
            yield server.url

    def _join_run(self, cfg: Config) -> None:
        """The head node (the first in ``nodes``, or a single launcher) starts the run afresh:
        clears the run's old keys and marks the launch; other nodes wait for that mark, so none
        of their registrations is wiped by a late head."""
        if self.node is None or self.node == cfg.nodes[0].name:
            self.registry.clear_run()
            self.registry.save_config(dump_config(cfg))
            self.registry.mark_launch()
            return
        self.echo(f"waiting for head node {cfg.nodes[0].name!r} to start run {cfg.run.name!r}")
        since = time.time() - _HEAD_GRACE_S
        while not self.stop_requested.wait(_TICK_S):
            if self.registry.launched_since(since):
                return
        raise KeyboardInterrupt  # stopped by a signal before the head started

    def _write_run_files(self, cfg: Config, url: str) -> Path:
        config_path = self.run_dir / "config.yaml"
        config_path.write_text(dump_config(cfg))
        info = {"run_id": cfg.run.name, "redis_url": url, "launcher_pid": os.getpid(),
                "node": self.node, "started_at": time.time()}  # fmt: skip
        (self.run_dir / "run.json").write_text(json.dumps(info, indent=2))
        return config_path

    def _start_all(self, cfg: Config, config_path: Path) -> None:
        for role in cfg.roles:
            for index, node in enumerate(cfg.placement(role)):
                if self.node is not None and node != self.node:
                    continue
                log_path = self.run_dir / "logs" / f"{role}-{index}.log"
                proc = RoleProcess(role=role, index=index, node=node, log_path=log_path)
                self.procs.append(proc)
                self._spawn(proc, config_path)
        self.echo(f"started {len(self.procs)} role processes; logs in {self.run_dir / 'logs'}")

    def _spawn(self, proc: RoleProcess, config_path: Path) -> None:
        args = [sys.executable, "-m", f"roles.{proc.role}", "--config", str(config_path),
                "--index", str(proc.index), "--node", proc.node, "--run-dir", str(self.run_dir)]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        with open(proc.log_path, "ab") as log:
            # A new session keeps the terminal's Ctrl-C away from children: the launcher alone
            # decides how they stop.
            proc.popen = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        proc.restart_at = None

    def _supervise(self, cfg: Config, started: float) -> str:
        config_path = self.run_dir / "config.yaml"
        next_progress = time.monotonic() + cfg.run.progress_interval_s
        while not self.stop_requested.wait(_TICK_S):
            now = time.monotonic()
            for proc in self.procs:
                failure = self._check_process(proc, cfg, now)
                if failure:
                    return failure
                if proc.restart_at is not None and now >= proc.restart_at:
                    self._spawn(proc, config_path)
            if all(p.finished for p in self.procs):
                return "all roles finished"
            reason = stop_condition(self.registry, cfg, now - started)
            if reason:
                return self._evaluate(cfg, reason)
            if now >= next_progress:
                self.echo(progress_line(self.registry, cfg, now - started, self._restarts()))
                next_progress = now + cfg.run.progress_interval_s
        return _STOPPED_BY_SIGNAL

    def _evaluate(self, cfg: Config, reason: str) -> str:
        """Freeze training and wait for ``eval_episodes`` fresh episodes of the final weights."""
        wanted = cfg.run.stop.eval_episodes
        if not wanted or not any(p.role == "env_worker" for p in self.procs):
            return reason
        version = self.registry.weight_version()
        self.registry.start_evaluation(version)
        self.echo(f"{reason}; evaluating weights v{version} on {wanted} fresh episodes")
        deadline = time.monotonic() + cfg.run.stop.eval_timeout_s
        while not self.stop_requested.wait(_TICK_S):
            for proc in self.procs:
                failure = self._check_process(proc, cfg, time.monotonic())
                if failure:
                    return failure
            done = len(evaluation_episodes(self.registry, version))
            if done >= wanted:
                return f"{reason}; evaluated on {done} episodes"
            if time.monotonic() > deadline:
                return f"{reason}; evaluation timed out after {done} episodes"
        return _STOPPED_BY_SIGNAL

    def _check_process(self, proc: RoleProcess, cfg: Config, now: float) -> str | None:
        if proc.popen is None or proc.finished or proc.restart_at is not None:
            return None
        code = proc.popen.poll()
        if code is None:
            return None
        if code == 0:
            proc.finished = True
            return None
        self.registry.mark_dead(proc.role, proc.index)
        policy = cfg.roles[proc.role].restart
        name = f"{proc.role}/{proc.index}"
        if proc.restarts >= policy.max_restarts:
            proc.failed = True
            self.echo(f"{name} exited with code {code}; out of restarts (see {proc.log_path})")
            return f"{name} failed"
        delay = policy.backoff_s * (2**proc.restarts)
        proc.restarts = self.registry.record_restart(proc.role, proc.index)
        proc.restart_at = now + delay
        self.echo(f"{name} exited with code {code}; restart {proc.restarts} in {delay:.1f}s")
        return None

    def _restarts(self) -> int:
        return sum(p.restarts for p in self.procs)

    # --- stop ------------------------------------------------------------------------------------
    def _stop_all(self, timeout_s: float) -> None:
        """Stop producers before consumers (``STOP_ORDER``) so queued data is drained, not lost."""
        rank = {role: i for i, role in enumerate(STOP_ORDER)}
        groups: dict[int, list[subprocess.Popen]] = {}
        for p in self.procs:
            if p.popen is not None and p.popen.poll() is None:
                groups.setdefault(rank.get(p.role, len(STOP_ORDER)), []).append(p.popen)
        for _, group in sorted(groups.items()):
            self._stop_group(group, timeout_s)

    def _stop_group(self, group: list[subprocess.Popen], timeout_s: float) -> None:
        for popen in group:
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for popen in group:
            while popen.poll() is None and time.monotonic() < deadline:
                if self.kill_requested.is_set():
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=_TICK_S)
            if popen.poll() is None:
                popen.kill()
                popen.wait()

    def _install_signal_handlers(self) -> None:
        def on_signal(_signum: int, count: int) -> None:  # on the signal watcher thread
            if count > 1 or self.stop_requested.is_set():
                self.echo("second signal: killing all roles")
                self.kill_requested.set()
            else:
                self.echo("stopping all roles (Ctrl-C again to kill them)")
                self.stop_requested.set()

        install_stop_signals(on_signal)


def _write_partial_report(run_dir: Path, cfg: Config, wall_s: float, reason: str) -> None:
    """``summary.json`` when the run's Redis is gone (counters and curves lived there)."""
    summary = {"run_id": cfg.run.name, "mode": cfg.run.mode, "wall_s": round(wall_s, 2),
               "stop_reason": reason, "solved": False, "complete": False}  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _with_redis_url(cfg: Config, url: str) -> Config:
    from dataclasses import replace

    return replace(cfg, run=replace(cfg.run, redis_url=url))


def launch(
    config_path: str | None,
    overrides: list[str] = (),
    *,
    node: str | None = None,
    out: str | None = None,
    resume: bool = False,
    echo: Callable[[str], None] = print,
) -> int:
    """Load a config and run it (the body of ``rlvla3 launch``). Returns the exit code.

    A fresh launch into a run dir that holds an earlier run moves that run aside (nothing is
    deleted); ``resume`` keeps it, so the trainer continues from its checkpoints.
    """
    cfg = load_config(config_path, overrides)
    if node is None and cfg.policy.init_launch:
        code = _run_init_launch(cfg, config_path, echo)
        if code != 0:
            return code  # a failed or interrupted first stage stops the chain
    elif (
        node is None
        and cfg.policy.init_checkpoint
        and not find_checkpoint(cfg.policy.init_checkpoint)
    ):  # (a --node launcher may start while the head still writes it, or hold no trainer)
        raise ConfigError(f"policy.init_checkpoint: no checkpoint at {cfg.policy.init_checkpoint} "
                          "(a run dir with checkpoints/, or a .pt file)")  # fmt: skip
    run_dir = (Path(out) if out else Path(cfg.run.output_dir) / cfg.run.name).resolve()
    launcher = Launcher(cfg, run_dir, node=node, echo=echo)  # checks the placement first
    if not resume and node is None and (run_dir / "run.json").exists():
        moved = run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(moved)
        echo(f"moved the earlier run in {run_dir} to {moved}")
    return launcher.run()


def _run_init_launch(cfg: Config, config_path: str | None, echo: Callable[[str], None]) -> int:
    """Run ``policy.init_launch`` into ``policy.init_checkpoint`` unless a checkpoint is there.

    Returns its exit code (0 when nothing had to run). The first stage's config is its own file
    as written: ``--set`` overrides apply to the stage they were given for.
    """
    init_dir = Path(cfg.policy.init_checkpoint or "")
    if find_checkpoint(init_dir) is not None:
        return 0
    first = Path(cfg.policy.init_launch or "")
    if config_path is not None and first.resolve() == Path(config_path).resolve():
        raise ConfigError(f"policy.init_launch: {first} is this launch file itself")
    echo(f"no checkpoint in {init_dir} yet: running {first} first to make one")
    code = launch(str(first), out=str(init_dir), echo=echo)
    if code == 0 and find_checkpoint(init_dir) is None:
        echo(f"{first} ended without writing a checkpoint into {init_dir}")
        return 1
    return code
