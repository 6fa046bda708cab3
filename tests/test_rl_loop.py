"""The RL loop end to end: real launcher, env workers, rollout server, trainer, broadcaster."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from rlvla3.runtime.chunk_ledger import balance, is_pushed_field, settled_marks
from rlvla3.runtime.registry import Registry
from tests.conftest import wait_until
from tests.launching import launcher_output, pid_gone, start_launcher, write_yaml


def cartpole_config(name: str, redis_url: str, mode: str, **algo: object) -> dict:
    return {
        "run": {
            "name": name,
            "mode": mode,
            "redis_url": redis_url,
            "heartbeat_ttl_s": 3.0,
            "progress_interval_s": 2.0,
            "stop": {"max_env_steps": 4000, "max_wall_s": 150},
        },
        "roles": {
            "env_worker": {"count": 2},
            "rollout_server": {"count": 1},
            "trainer": {"count": 1, "restart": {"max_restarts": 2, "backoff_s": 0.2}},
            "weight_broadcaster": {"count": 1},
        },
        "env": {"id": "CartPole-v1", "num_envs_per_worker": 2, "chunk_len": 32},
        "algo": {"epochs": 2, "minibatch_size": 64, "checkpoint_every": 2, **algo},
    }


def assert_no_chunk_lost(registry: Registry, c: dict[str, int]) -> None:
    """Nothing lost: every chunk produced was trained on, dropped as stale, or still queued at
    exit, by the counters and by the crash-proof ledger (rlvla3/runtime/chunk_ledger.py) alike."""
    assert c["chunks_produced"] == (
        c.get("chunks_consumed", 0)
        + c.get("chunks_dropped", 0)
        + c.get("chunks_in_flight_at_exit", 0)
    )
    chunks = balance(registry.chunk_ledger(), c)
    assert chunks.balanced and chunks.lost == 0 and chunks.buffered == 0, chunks
    assert chunks.produced == c["chunks_produced"]


def run_to_end(tmp_path: Path, cfg: dict, timeout_s: float = 240) -> Path:
    run_dir = tmp_path / "run"
    launcher = start_launcher(write_yaml(tmp_path / "cfg.yaml", cfg), run_dir)
    try:
        code = launcher.wait(timeout=timeout_s)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert code == 0, launcher_output(run_dir)
    return run_dir


@pytest.mark.parametrize("mode", ["async", "async_rollout", "sync"])
def test_short_run_trains_and_stops_cleanly(tmp_path, redis_url, mode: str) -> None:
    name = f"cp_{mode}"
    run_dir = run_to_end(tmp_path, cartpole_config(name, redis_url, mode))
    registry = Registry(redis_url, name)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "max_env_steps" in summary["stop_reason"]
    assert {r.status for r in registry.roles()} == {"done"}
    c = registry.counters()
    assert c["updates"] >= 2 and registry.weight_version() >= 2
    # Nothing lost: every chunk produced was trained on, dropped as stale, or still queued at exit.
    assert_no_chunk_lost(registry, c)
    # ... and every finished episode reached the learning curve, the last ones at shutdown.
    episodes = registry.series("episodes")
    assert len(episodes) == c["episodes"] > 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    versions = [m["version"] for m in metrics]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert all(m["mean_staleness"] >= 0 for m in metrics)  # no sample newer than the trainer
    if mode != "async":
        assert all(m["mean_staleness"] == 0 for m in metrics)  # per-round training is on-policy
    assert (run_dir / "learning_curve.png").is_file()


def test_grpo_trains_on_complete_groups_and_loses_nothing(tmp_path, redis_url) -> None:
    """``algo.kind: grpo``: env workers tag episodes with their group, the trainer trains
    complete groups only, and the chunks it still held for incomplete groups at exit are
    counted in flight: the accounting balances."""
    name = "cp_grpo"
    cfg = cartpole_config(name, redis_url, "async", kind="grpo", group_size=2, max_staleness=8)
    run_dir = run_to_end(tmp_path, cfg)
    registry = Registry(redis_url, name)
    c = registry.counters()
    assert c["updates"] >= 2 and c.get("bad_chunks", 0) == 0
    assert_no_chunk_lost(registry, c)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["samples"] for m in metrics) == c["samples_consumed"]


def test_backpressure_pauses_envs_while_the_trainer_lags(tmp_path, redis_url) -> None:
    # A slow trainer (many epochs) and a tiny allowed backlog: envs must pause, the run must
    # still reach its step budget (no deadlock), and nothing may be lost. The budget is many
    # times what the envs make unpaused in one back-pressure cycle (counters flush every 0.5 s,
    # workers read them every 0.2 s; CartPole's envs make thousands of steps/s), so the run
    # cannot end before the first pause could happen.
    cfg = cartpole_config("cp_backpressure", redis_url, "async", epochs=30, minibatch_size=32)
    cfg["roles"]["env_worker"]["settings"] = {"max_chunks_queued": 2}
    cfg["run"]["stop"] = {"max_env_steps": 12000, "max_wall_s": 150}
    run_dir = run_to_end(tmp_path, cfg)
    registry = Registry(redis_url, "cp_backpressure")
    c = registry.counters()
    assert c.get("backpressure_pauses", 0) > 0
    assert "max_env_steps" in json.loads((run_dir / "summary.json").read_text())["stop_reason"]
    assert c["chunks_received"] <= c["chunks_produced"]
    assert_no_chunk_lost(registry, c)


@pytest.mark.parametrize(
    ("mode", "resend"), [("async", 256), ("async", 1), ("async", 0), ("sync", 256)]
)
def test_trainer_killed_resumes_from_checkpoint(
    tmp_path, redis_url, mode: str, resend: int
) -> None:
    """With resend buffers the killed trainer's chunks come again; without (0) they are lost,
    and so are those a buffer of one chunk per env let go (it overflows at every push), and
    its successor's settled marks pass them: either way every producer's mark goes past what
    was pushed before the kill, each chunk counted as it settles, not at exit. In ``sync``
    mode the envs paused for the killed trainer's next version go on with its successor's."""
    name = f"cp_resume_{mode}_{resend}"
    # Buffers of one chunk per env: updates of 32 chunks (not one round's 4) make the killed
    # trainer hold far more unsettled chunks than the env workers keep.
    algo = {"batch_steps": 1024} if resend == 1 else {}
    cfg = cartpole_config(name, redis_url, mode, **algo)
    cfg["run"]["stop"] = {"max_wall_s": 200}
    # Back-pressure on: the chunks lost in the killed trainer's queue must not stall the envs.
    cfg["roles"]["env_worker"]["settings"] = {
        "max_chunks_queued": 4,
        "resend_buffer_chunks": resend,
    }
    run_dir = tmp_path / "run"
    launcher = start_launcher(write_yaml(tmp_path / "cfg.yaml", cfg), run_dir)
    registry = Registry(redis_url, name)
    seen: list[int] = []

    def version_at_least(n: int):
        def check():
            v = registry.weight_version()
            if not seen or seen[-1] != v:
                seen.append(v)
            return v >= n

        return check

    try:
        wait_until(version_at_least(5), 150, "5 weight versions")
        ckpt_dir = run_dir / "checkpoints"
        wait_until(lambda: list(ckpt_dir.glob("ckpt_*.pt")), 60, "a checkpoint")
        trainer = next(r for r in registry.roles() if r.role == "trainer")
        wait_until(lambda: settled_marks(registry.chunk_ledger()), 60, "chunks settled")
        # the env workers flush their pushed marks on their own clock, the trainer its settled
        # ones on its own: the first settled mark can come before any pushed one
        wait_until(lambda: any(is_pushed_field(f) for f in registry.chunk_ledger()), 30, "pushed")
        os.kill(trainer.pid, signal.SIGKILL)

        def restarted() -> bool:
            rec = next(r for r in registry.roles() if r.role == "trainer")
            return rec.restarts == 1 and rec.pid != trainer.pid and rec.status == "running"

        # Versions the killed trainer had sent can still be published after the kill, and
        # settled marks it flushed can pass pushed marks read then: neither says a successor
        # runs. Wait for it, then read what the env workers had pushed by then (their marks
        # lag their pushes by a flush, so also some pushed to the dead trainer).
        wait_until(restarted, 120, "the trainer restarted")
        before = registry.weight_version()
        pushed = {
            field.removeprefix("pushed|"): high
            for field, high in registry.chunk_ledger().items()
            if field.startswith("pushed|")
        }
        assert pushed, "the env workers recorded no chunks before the kill"
        wait_until(version_at_least(before + 3), 150, "versions after the restart")

        def marks_passed() -> bool:
            marks = settled_marks(registry.chunk_ledger())
            return all(marks.get(p, 0) > high for p, high in pushed.items())

        wait_until(marks_passed, 120, "every producer's mark past its chunks before the kill")
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=120) == 130
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert seen == sorted(seen), f"weight versions went backwards: {seen}"
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "resumed from ckpt_" in log
    rec = next(r for r in registry.roles() if r.role == "trainer")
    assert rec.restarts == 1 and rec.status == "done" and pid_gone(trainer.pid)
    chunks = balance(registry.chunk_ledger(), registry.counters())
    assert chunks.balanced and chunks.buffered == 0, chunks
    if resend == 256:
        assert chunks.lost == 0, chunks  # the killed trainer's chunks all came again
    if resend == 1:
        assert chunks.lost > 0, chunks  # some were let go by the full buffers: the case tested


def test_trainer_killed_before_any_checkpoint_continues_from_the_broadcasters_weights(
    tmp_path, redis_url
) -> None:
    """The learning deadlock: a trainer restarted with no checkpoint used to come back at
    version 0 while the servers held a newer one, and refuse every chunk for ever."""
    cfg = cartpole_config("cp_catch_up", redis_url, "async", checkpoint_every=10_000)
    cfg["run"]["stop"] = {"max_wall_s": 200}
    run_dir = tmp_path / "run"
    launcher = start_launcher(write_yaml(tmp_path / "cfg.yaml", cfg), run_dir)
    registry = Registry(redis_url, "cp_catch_up")
    try:
        wait_until(lambda: registry.weight_version() >= 5, 150, "5 weight versions")
        trainer = next(r for r in registry.roles() if r.role == "trainer")
        before = registry.weight_version()
        updates = registry.counters().get("updates", 0)
        os.kill(trainer.pid, signal.SIGKILL)
        wait_until(
            lambda: registry.counters().get("updates", 0) >= updates + 3, 150, "updates go on"
        )
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=120) == 130
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert not list((run_dir / "checkpoints").glob("ckpt_*.pt"))[:-1]  # only the one at exit
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "held by the weight broadcaster (newer than v-1)" in log
    assert "newer than the trainer" not in log
    assert registry.weight_version() > before
    chunks = balance(registry.chunk_ledger(), registry.counters())
    assert chunks.balanced and chunks.buffered == 0, chunks


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_simulator_blow_ups_cut_episodes_and_lose_nothing(tmp_path, redis_url, mode) -> None:
    """An env that returns NaN observations now and then: each fault ends its episode as a
    truncation and resets the env; no NaN reaches a server or the trainer, training goes on, and
    the chunk accounting still adds up (sync mode too: the lock-step rounds stay whole)."""
    name = f"cp_faults_{mode}"
    cfg = cartpole_config(name, redis_url, mode)
    cfg["env"]["id"] = "tests.faulty_env:NaNCartPole-v0"
    run_dir = run_to_end(tmp_path, cfg)
    registry = Registry(redis_url, name)
    c = registry.counters()
    assert c["sim_faults"] >= 10 and c["updates"] >= 2
    assert not c.get("bad_chunks") and not c.get("bad_requests")
    assert_no_chunk_lost(registry, c)
    # one warning per 10 s for all of a worker's sim_faults: the first fault's, a step's or a
    # reset's, whichever came first
    said = (run_dir / "logs" / "env_worker-0.log").read_text()
    assert "non-finite (or absurdly large) observation" in said or (
        "reset returned a non-finite or absurdly large observation" in said
    ), said


def test_periodic_evaluation_runs_beside_training_on_held_out_episodes(tmp_path, redis_url) -> None:
    """``run.eval``: the eval rollout server takes a new version only every ``every_versions``
    and after the eval env worker finished the round; each round records one point (to Redis,
    metrics.jsonl and summary.json) from exactly ``episodes`` greedy held-out episodes, none of
    which count as training episodes or env steps; training loses nothing meanwhile."""
    name = "tt_eval"
    cfg = cartpole_config(name, redis_url, "async")
    cfg["env"] = {
        "id": "rlvla3/TableTopEasy-v0",
        "num_envs_per_worker": 2,
        "chunk_len": 16,
        "kwargs": {"obs_mode": "state"},
    }
    cfg["run"]["stop"] = {"max_env_steps": 6000, "max_wall_s": 150}
    cfg["run"]["eval"] = {"every_versions": 3, "episodes": 6}
    cfg["roles"]["eval_env_worker"] = {"count": 1}
    cfg["roles"]["eval_rollout_server"] = {"count": 1}
    run_dir = run_to_end(tmp_path, cfg)
    registry = Registry(redis_url, name)
    c = registry.counters()
    evaluations = registry.series("evaluations")
    assert len(evaluations) >= 2, launcher_output(run_dir)
    versions = [e["version"] for e in evaluations]
    assert all(b - a >= 3 for a, b in zip(versions, versions[1:], strict=False)), versions
    assert all(e["episodes"] == 6 and 0.0 <= e["success_rate"] <= 1.0 for e in evaluations)
    assert c["eval_episodes"] >= 6 * len(evaluations) and c["eval_env_steps"] > 0
    # evaluation is apart from training: its episodes are not in the training curve
    assert len(registry.series("episodes")) == c["episodes"]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in logged if m.get("kind") == "eval"] == versions
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [e["version"] for e in summary["evaluations"]] == versions
    assert (run_dir / "learning_curve.png").stat().st_size > 0
    assert_no_chunk_lost(registry, c)


@pytest.mark.parametrize(
    ("mode", "per_request", "vectorized"),
    [("async", 4, False), ("async", 4, True), ("sync", 2, False)],
)
def test_env_groups_keep_episodes_returns_and_accounting_exact(
    tmp_path, redis_url, mode: str, per_request: int, vectorized: bool
) -> None:
    """``env.envs_per_request`` (and ``env.vectorized``): one request per group and step, yet
    every episode is whole (CartPole pays 1 per step, so each return equals its length) and
    every chunk is accounted for."""
    name = f"cp_groups_{mode}_{per_request}_{int(vectorized)}"
    cfg = cartpole_config(name, redis_url, mode)
    cfg["env"].update(num_envs_per_worker=4, envs_per_request=per_request, vectorized=vectorized)
    cfg["run"]["stop"] = {"max_env_steps": 6000, "max_wall_s": 150}
    run_to_end(tmp_path, cfg)
    registry = Registry(redis_url, name)
    c = registry.counters()
    episodes = registry.series("episodes")
    assert len(episodes) == c["episodes"] >= 20
    assert all(e["return"] == e["length"] for e in episodes), episodes[:5]
    assert c.get("bad_chunks", 0) == 0 and c["updates"] >= 2
    # one request per group and step (plus bootstrap values at time limits)
    assert c["action_requests"] >= c["env_steps"]
    assert_no_chunk_lost(registry, c)
