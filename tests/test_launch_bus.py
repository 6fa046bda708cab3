"""The bus end to end: real launcher, real role processes, real Redis, loopback sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml
import zmq

from rlvla3.registry import Registry
from tests.conftest import wait_until

REPO = Path(__file__).resolve().parent.parent


def write_config(tmp_path: Path, name: str, redis_url: str | None, **run: object) -> Path:
    cfg = {
        "run": {"name": name, "redis_url": redis_url, "heartbeat_ttl_s": 2.0,
                "progress_interval_s": 1.0, "stop_timeout_s": 10.0, **run},
        "roles": {
            "demo_sink": {"count": 1},
            "demo_source": {"count": 2, "settings": {"rate_hz": 100},
                            "restart": {"max_restarts": 2, "backoff_s": 0.1}},
        },
    }  # fmt: skip
    path = tmp_path / "bus.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_launcher(config: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    log = open(run_dir.parent / f"{run_dir.name}-launcher.log", "wb")
    cmd = [sys.executable, "-m", "rlvla3.cli", "launch", str(config), "--out", str(run_dir), *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def monitor_json(run_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "rlvla3.cli", "monitor", "--json", "--run", str(run_dir)],
        capture_output=True, text=True, timeout=60, check=True, cwd=REPO,
    )  # fmt: skip
    return json.loads(out.stdout)


def running(registry: Registry, count: int):
    recs = registry.roles()
    ok = len(recs) == count and all(r.alive and r.status == "running" for r in recs)
    return recs if ok else None


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_launch_flow_restart_monitor_and_clean_stop(tmp_path, redis_url) -> None:
    run_dir = tmp_path / "run"
    launcher = start_launcher(write_config(tmp_path, "bus1", redis_url), run_dir)
    try:
        registry = Registry(redis_url, "bus1")
        recs = wait_until(lambda: running(registry, 3), 60, "3 roles running")
        wait_until(lambda: registry.counters().get("demo_received", 0) > 20, 30, "data flow")
        assert (run_dir / "config.yaml").is_file() and (
            run_dir / "logs" / "demo_sink-0.log"
        ).is_file()

        snap = monitor_json(run_dir)
        assert {(r["role"], r["index"]) for r in snap["roles"]} == {
            ("demo_sink", 0),
            ("demo_source", 0),
            ("demo_source", 1),
        }
        assert snap["counters"]["demo_received"] > 0

        # Garbage sent to the sink's queue is counted as bad frames; the sink carries on.
        sink_address = registry.endpoints("demo_sink", "queue")[0]
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 5000)  # deliver before close
        raw.connect(sink_address)
        raw.send_multipart([b"\xc1bad"])
        raw.close()
        wait_until(lambda: registry.counters().get("bad_frames", 0) == 1, 30, "bad frame counted")
        before = registry.counters()["demo_received"]
        wait_until(lambda: registry.counters()["demo_received"] > before + 10, 30, "flow goes on")

        # kill -9 of one role: the launcher restarts it and the monitor shows the restart.
        victim = next(r for r in recs if r.role == "demo_source" and r.index == 0)
        os.kill(victim.pid, signal.SIGKILL)

        def restarted():
            rec = next(r for r in registry.roles() if (r.role, r.index) == ("demo_source", 0))
            return (
                rec.restarts == 1
                and rec.pid != victim.pid
                and rec.alive
                and rec.status == "running"
            )

        wait_until(restarted, 60, "demo_source/0 to be restarted")
        snap = monitor_json(run_dir)
        source0 = next(r for r in snap["roles"] if (r["role"], r["index"]) == ("demo_source", 0))
        assert source0["restarts"] == 1 and source0["status"] == "running"
        pids = [r.pid for r in registry.roles()]

        launcher.send_signal(signal.SIGINT)  # Ctrl-C: everything stops cleanly
        assert launcher.wait(timeout=60) == 0
        assert all(pid_gone(p) for p in pids)
        assert {r.status for r in registry.roles()} == {"done"}
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stop_reason"] == "stopped by signal"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_embedded_redis_run_stops_on_condition_and_removes_redis(tmp_path) -> None:
    run_dir = tmp_path / "run"
    launcher = start_launcher(write_config(tmp_path, "bus2", None, stop={"max_wall_s": 3}), run_dir)
    try:
        assert launcher.wait(timeout=90) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    info = json.loads((run_dir / "run.json").read_text())
    socket_path = Path(info["redis_url"].removeprefix("unix://"))
    assert not socket_path.parent.exists()  # the embedded server and its directory are gone
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "max_wall_s" in summary["stop_reason"]
    assert summary["counters"]["demo_received"] > 0


def test_role_out_of_restarts_fails_the_run(tmp_path, redis_url) -> None:
    config = write_config(tmp_path, "bus3", redis_url)
    run_dir = tmp_path / "run"
    launcher = start_launcher(config, run_dir, "--set", "roles.demo_source.restart.max_restarts=0")
    try:
        registry = Registry(redis_url, "bus3")
        recs = wait_until(lambda: running(registry, 3), 60, "3 roles running")
        os.kill(next(r for r in recs if r.role == "demo_source").pid, signal.SIGKILL)
        assert launcher.wait(timeout=60) == 1
        assert all(pid_gone(r.pid) for r in recs)
    finally:
        if launcher.poll() is None:
            launcher.kill()
