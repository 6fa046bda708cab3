"""The fault suite: the README's main job with one fault injected about 5,000 env steps in.

Each test starts the real launcher on ``launch/cartpole.yaml`` (its own embedded Redis), injects
the fault, lets the run go on to its target, and checks that it solved, that the victim came
back, and that the chunk accounting balances exactly. Each measures what docs/reliability.md
reports: how long recovery took and what was lost; with ``RLVLA3_FAULT_REPORT=PATH`` the rows
are appended to PATH as JSON lines (``bench/faults.py`` runs the suite and prints the table).

Marked slow (about 40 s a fault on 2 cores); ``.ci/run`` runs it after the README's command.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from rlvla3.registry import Registry, RoleRecord
from tests.conftest import wait_until
from tests.launching import REPO, launcher_output, start_launcher

pytestmark = pytest.mark.slow

_INJECT_AT_STEPS = 5000
_OVERRIDES = [
    "run.stall_timeout_s=5",
    "run.heartbeat_ttl_s=2",
    "run.stop.max_wall_s=300",
    "algo.checkpoint_every=5",
]


@dataclass
class Run:
    """A main job under test, and what the injection needs."""

    run_dir: Path
    registry: Registry
    url: str

    def role(self, role: str, index: int = 0) -> RoleRecord:
        return next(r for r in self.registry.roles() if (r.role, r.index) == (role, index))


def _back_running(run: Run, role: str, old_pid: int) -> Callable[[], bool]:
    def check() -> bool:
        try:
            rec = run.role(role)
        except (StopIteration, redis.exceptions.ConnectionError):
            return False
        return rec.pid != old_pid and rec.alive and rec.status == "running"

    return check


def kill_role(role: str) -> Callable[[Run], float]:
    """kill -9 the role's first instance; returns the seconds until its successor runs."""

    def inject(run: Run) -> float:
        victim = run.role(role)
        started = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(_back_running(run, role, victim.pid), 120, f"{role} back")
        return time.monotonic() - started

    return inject


def stop_role(role: str) -> Callable[[Run], float]:
    """SIGSTOP the role for longer than the stall timeout, then SIGCONT; returns the seconds
    until a new process of it runs."""

    def inject(run: Run) -> float:
        victim = run.role(role)
        started = time.monotonic()
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            wait_until(_back_running(run, role, victim.pid), 120, f"{role} replaced")
        finally:
            try:
                os.kill(victim.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # killed as stalled, as it should be
        return time.monotonic() - started

    return inject


def kill_redis(run: Run) -> float:
    """kill -9 the run's redis-server; returns the seconds until it answers again."""
    client = redis.Redis.from_url(run.url)
    pid = client.info("server")["process_id"]
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    def answers_anew() -> bool:
        try:
            return client.info("server")["process_id"] != pid
        except redis.exceptions.ConnectionError:
            return False

    wait_until(answers_anew, 60, "redis-server back")
    return time.monotonic() - started


FAULTS: dict[str, tuple[Callable[[Run], float], str]] = {
    "kill -9 env worker": (kill_role("env_worker"), "env_worker/0 exited with code -9; restart"),
    "kill -9 rollout server": (
        kill_role("rollout_server"),
        "rollout_server/0 exited with code -9; restart",
    ),
    "kill -9 trainer": (kill_role("trainer"), "trainer/0 exited with code -9; restart"),
    "kill -9 weight broadcaster": (
        kill_role("weight_broadcaster"),
        "weight_broadcaster/0 exited with code -9; restart",
    ),
    "SIGSTOP rollout server (then SIGCONT)": (stop_role("rollout_server"), "STALLED"),
    "SIGSTOP trainer (then SIGCONT)": (stop_role("trainer"), "STALLED"),
    "kill -9 the run's redis-server": (kill_redis, "restarted from its append-only file"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_main_job_survives(tmp_path, fault: str) -> None:
    inject, said = FAULTS[fault]
    run_dir = tmp_path / "run"
    config = REPO / "launch" / "cartpole.yaml"
    args = [a for o in _OVERRIDES for a in ("--set", o)]
    launcher = start_launcher(config, run_dir, *args)
    try:
        wait_until(lambda: (run_dir / "run.json").exists(), 60, "run.json")
        url = json.loads((run_dir / "run.json").read_text())["redis_url"]
        run = Run(run_dir, Registry(url, "cartpole"), url)
        wait_until(
            lambda: run.registry.counters().get("env_steps", 0) >= _INJECT_AT_STEPS,
            180,
            f"{_INJECT_AT_STEPS} env steps",
        )
        recovery_s = inject(run)
        assert launcher.wait(timeout=300) == 0, launcher_output(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    output = launcher_output(run_dir)
    assert said in output, output
    summary = json.loads((run_dir / "summary.json").read_text())
    chunks = summary["chunk_accounting"]
    assert summary["solved"], summary["stop_reason"]
    assert chunks["balanced"], chunks
    _report(
        fault=fault,
        did=next(line for line in output.splitlines() if said in line),
        recovery_s=round(recovery_s, 2),
        chunks_produced=chunks["produced"],
        chunks_lost=chunks["lost"],
        solved=summary["solved"],
        env_steps=summary["env_steps"],
        wall_s=summary["wall_s"],
    )


def _report(**row: object) -> None:
    path = os.environ.get("RLVLA3_FAULT_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")
