"""The bus end to end: real launcher, real role processes, real Redis, loopback sockets."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import redis
import zmq

from rlvla3.config.run_config import load_config
from rlvla3.launch.redis_server import EmbeddedRedis
from rlvla3.runtime.registry import Registry
from tests.conftest import wait_until
from tests.launching import launcher_output, monitor_json, pid_gone, start_launcher, write_yaml

ROLES = {
    ("env_worker", 0),
    ("env_worker", 1),
    ("rollout_server", 0),
    ("trainer", 0),
    ("weight_broadcaster", 0),
}


def tiny_run(tmp_path: Path, name: str, redis_url: str | None, **stop: object) -> Path:
    cfg = {
        "run": {
            "name": name,
            "redis_url": redis_url,
            "heartbeat_ttl_s": 2.0,
            "progress_interval_s": 1.0,
            "stop_timeout_s": 15.0,
            "stop": {"max_wall_s": 180, **stop},
        },
        "roles": {
            "env_worker": {"count": 2, "restart": {"max_restarts": 2, "backoff_s": 0.1}},
            "rollout_server": {"count": 1},
            "trainer": {"count": 1, "cpus": [0]},
            "weight_broadcaster": {"count": 1},
        },
        "env": {"id": "CartPole-v1", "num_envs_per_worker": 1, "chunk_len": 16},
    }
    return write_yaml(tmp_path / "bus.yaml", cfg)


def running(registry: Registry):
    recs = registry.roles()
    ok = {(r.role, r.index) for r in recs} == ROLES and all(
        r.alive and r.status == "running" for r in recs
    )
    return recs if ok else None


def send_garbage(address: str) -> None:
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 5000)  # deliver before close
    raw.connect(address)
    raw.send_multipart([b"\xc1bad"])
    raw.close()


def test_launch_flow_restart_monitor_and_clean_stop(tmp_path, redis_url) -> None:
    run_dir = tmp_path / "run"
    launcher = start_launcher(tiny_run(tmp_path, "bus1", redis_url), run_dir)
    try:
        registry = Registry(redis_url, "bus1")
        recs = wait_until(lambda: running(registry), 120, "every role running")
        wait_until(lambda: registry.counters().get("chunks_produced", 0) > 5, 60, "data flow")
        assert (run_dir / "config.yaml").is_file()
        assert (run_dir / "logs" / "trainer-0.log").is_file()
        trainer = next(r for r in recs if r.role == "trainer")
        assert os.sched_getaffinity(trainer.pid) == {0}  # roles.trainer.cpus, threads included
        assert all(
            os.sched_getaffinity(r.pid) == os.sched_getaffinity(0) for r in recs if r != trainer
        )

        snap = monitor_json(run_dir)
        assert {(r["role"], r["index"]) for r in snap["roles"]} == ROLES
        assert snap["counters"]["env_steps"] > 0 and snap["weight_version"] >= 0

        # Garbage sent to the trainer's queue is counted as a bad frame; training carries on.
        send_garbage(registry.endpoints("trainer", "chunks")[0])
        wait_until(lambda: registry.counters().get("bad_frames", 0) == 1, 30, "bad frame counted")
        before = registry.counters()["chunks_produced"]
        wait_until(lambda: registry.counters()["chunks_produced"] > before + 5, 60, "flow goes on")

        # kill -9 of one role: the launcher restarts it and the monitor shows the restart.
        victim = next(r for r in recs if (r.role, r.index) == ("env_worker", 0))
        os.kill(victim.pid, signal.SIGKILL)

        def restarted():
            rec = next(r for r in registry.roles() if (r.role, r.index) == ("env_worker", 0))
            return rec.restarts == 1 and rec.pid != victim.pid and rec.status == "running"

        wait_until(restarted, 120, "env_worker/0 to be restarted")
        snap = monitor_json(run_dir)
        worker0 = next(r for r in snap["roles"] if (r["role"], r["index"]) == ("env_worker", 0))
        assert worker0["restarts"] == 1 and worker0["status"] == "running"
        pids = [r.pid for r in registry.roles()]

        launcher.send_signal(signal.SIGINT)  # Ctrl-C: everything stops cleanly, exit 128 + 2
        assert launcher.wait(timeout=120) == 130, launcher_output(run_dir)
        assert all(pid_gone(p) for p in pids)
        assert {r.status for r in registry.roles()} == {"done"}
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stop_reason"] == "stopped by signal"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_embedded_redis_run_stops_on_condition_and_removes_redis(tmp_path) -> None:
    run_dir = tmp_path / "run"
    launcher = start_launcher(tiny_run(tmp_path, "bus2", None, max_env_steps=300), run_dir)
    try:
        assert launcher.wait(timeout=180) == 0, launcher_output(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    info = json.loads((run_dir / "run.json").read_text())
    socket_path = Path(info["redis_url"].removeprefix("unix://"))
    assert not socket_path.parent.exists()  # the embedded server and its directory are gone
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "max_env_steps" in summary["stop_reason"] and summary["env_steps"] >= 300
    assert monitor_json(run_dir) == {"ended": True, "summary": summary}  # Redis is gone
    # config.yaml is the config as given: the dead server's URL is only in run.json
    assert load_config(run_dir / "config.yaml").run.redis_url is None


def test_role_out_of_restarts_fails_the_run(tmp_path, redis_url) -> None:
    config = tiny_run(tmp_path, "bus3", redis_url)
    run_dir = tmp_path / "run"
    launcher = start_launcher(config, run_dir, "--set", "roles.env_worker.restart.max_restarts=0")
    try:
        registry = Registry(redis_url, "bus3")
        recs = wait_until(lambda: running(registry), 120, "every role running")
        os.kill(next(r for r in recs if r.role == "env_worker").pid, signal.SIGKILL)
        assert launcher.wait(timeout=120) == 1
        assert all(pid_gone(r.pid) for r in recs)
        assert "out of restarts" in launcher_output(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_killed_embedded_redis_is_restarted_and_the_run_goes_on(tmp_path) -> None:
    """kill -9 of the run's own redis-server: the launcher restarts it from its append-only
    file on the same socket, the roles ride out the gap, the run reaches its target and no
    counted chunk is lost."""
    run_dir = tmp_path / "run"
    launcher = start_launcher(tiny_run(tmp_path, "bus4", None, max_env_steps=3000), run_dir)
    try:
        wait_until(lambda: (run_dir / "run.json").exists(), 60, "run.json")
        url = json.loads((run_dir / "run.json").read_text())["redis_url"]
        registry = Registry(url, "bus4")
        wait_until(lambda: running(registry), 120, "every role running")
        wait_until(lambda: registry.counters().get("chunks_consumed", 0) > 0, 120, "training")
        before = registry.counters()
        redis_pid = redis.Redis.from_url(url).info("server")["process_id"]
        os.kill(redis_pid, signal.SIGKILL)
        assert launcher.wait(timeout=180) == 0, launcher_output(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = launcher_output(run_dir)
    assert "restarted from its append-only file" in output and "Traceback" not in output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "max_env_steps" in summary["stop_reason"]
    c = summary["counters"]
    assert c["redis_restarts"] == 1
    assert all(c[k] >= v for k, v in before.items())  # nothing counted before the crash is gone
    assert summary["chunk_accounting"]["balanced"], summary["chunk_accounting"]
    assert summary["chunk_accounting"]["lost"] == 0
    assert (run_dir / "redis" / "appendonly.aof").stat().st_size > 0


def test_losing_an_external_redis_ends_the_run_cleanly(tmp_path) -> None:
    """A configured Redis (``run.redis_url``) dies for good: roles and launcher ride it out for
    ``run.head_timeout_s``, then the launcher stops every role, says why in one line, writes a
    partial summary.json and exits 1 (no traceback, no orphans)."""
    run_dir = tmp_path / "run"
    with EmbeddedRedis() as external:
        config = tiny_run(tmp_path, "bus5", external.url)
        launcher = start_launcher(config, run_dir, "--set", "run.head_timeout_s=5")
        try:
            registry = Registry(external.url, "bus5")
            recs = wait_until(lambda: running(registry), 120, "every role running")
            os.kill(external.process.pid, signal.SIGKILL)
            assert launcher.wait(timeout=120) == 1, launcher_output(run_dir)
        finally:
            if launcher.poll() is None:
                launcher.kill()
    assert all(pid_gone(r.pid) for r in recs)
    output = launcher_output(run_dir)
    assert "riding it out" in output and "lost the run's Redis" in output
    assert "Traceback" not in output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["complete"] is False and "lost the run's Redis" in summary["stop_reason"]


def test_weight_path_survives_forgery_and_a_broadcaster_restart(tmp_path, redis_url) -> None:
    """A well-formed but forged WeightsUpdate (right layout, a version far ahead) is refused, so
    real versions keep flowing; after kill -9 of the broadcaster the trainer follows its
    replacement to its new address and versions keep rising."""
    import gymnasium as gym

    from rlvla3.policy.mlp import MLPPolicy
    from transport import sockets
    from transport.messages import WeightsUpdate
    from transport.weights import FlatLayout

    run_dir = tmp_path / "run"
    launcher = start_launcher(tiny_run(tmp_path, "bus5", redis_url), run_dir)
    try:
        registry = Registry(redis_url, "bus5")
        recs = wait_until(lambda: running(registry), 120, "every role running")
        wait_until(lambda: registry.weight_version() >= 2, 90, "weights flowing")
        layout = FlatLayout.of(MLPPolicy(4, gym.spaces.Discrete(2)))
        forged = WeightsUpdate(
            version=10**12, layout=layout.digest, flat=np.zeros(layout.numel, np.float32)
        )
        push = sockets.push(hwm=4)
        push.connect(registry.endpoints("weight_broadcaster", "updates")[0])
        assert push.send(forged, timeout_s=5)
        wait_until(lambda: registry.counters().get("weights_rejected", 0) == 1, 30, "refused")
        push.close()
        before = registry.weight_version()
        assert before < 10**12
        wait_until(lambda: registry.weight_version() > before + 2, 60, "real versions go on")

        # A NaN observation gets no action (it would be NaN); a good one still does.
        from transport.messages import ActionReply, ObsRequest

        client = sockets.dealer()
        client.connect(registry.endpoints("rollout_server", "requests")[0])
        state = np.zeros(4, np.float32)
        client.send(ObsRequest(env_key="t/0", request_id=1, obs={"state": state + np.nan}))
        wait_until(lambda: registry.counters().get("bad_requests", 0) == 1, 30, "NaN refused")
        client.send(ObsRequest(env_key="t/0", request_id=2, obs={"state": state}))
        reply = client.recv(timeout_s=30)
        assert isinstance(reply, ActionReply) and reply.request_id == 2
        client.close()

        victim = next(r for r in recs if r.role == "weight_broadcaster")
        os.kill(victim.pid, signal.SIGKILL)
        before = registry.weight_version()
        wait_until(lambda: registry.weight_version() > before + 3, 120, "versions after restart")
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=120) == 130, launcher_output(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
