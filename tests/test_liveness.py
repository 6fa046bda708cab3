"""Liveness is progress: stall deadlines in the registry, and the stacks a stalled role leaves."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from rlvla3.config.sections import RunConfig
from rlvla3.launch.processes import dump_stacks
from rlvla3.launch.supervisor import RedisReach, stall_verdict
from rlvla3.runtime.registry import Registry
from rlvla3.runtime.registry_records import RoleRecord
from tests.conftest import wait_until

_STUCK = """
import faulthandler, signal, threading
faulthandler.register(signal.SIGUSR1, all_threads=True)
def stuck_in_here():
    print("ready", flush=True)
    threading.Event().wait()
stuck_in_here()
"""


@pytest.fixture
def stuck_process(tmp_path):
    log_path = tmp_path / "role.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _STUCK], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        wait_until(lambda: "ready" in log_path.read_text(), 30, "the process to start")
        yield proc, log_path
    finally:
        proc.kill()
        proc.wait()


def test_a_stuck_process_writes_where_it_is_stuck(stuck_process) -> None:
    proc, log_path = stuck_process
    where = dump_stacks(proc.pid, log_path, threading.Event())
    assert where == f"every thread's stack is in {log_path}"
    text = log_path.read_text()
    assert "most recent call first" in text and "stuck_in_here" in text


def test_a_stopped_process_is_named_as_such(stuck_process) -> None:
    proc, log_path = stuck_process
    proc.send_signal(signal.SIGSTOP)
    wait_until(
        lambda: open(f"/proc/{proc.pid}/stat").read().rpartition(")")[2].split()[0] == "T",
        10,
        "the process to stop",
    )
    assert "stopped" in dump_stacks(proc.pid, log_path, threading.Event())


def test_the_registry_reports_a_missed_step_deadline(registry: Registry) -> None:
    registry.register("trainer", 0, node="n", host="127.0.0.1", pid=1)
    registry.set_status("trainer", 0, "running")
    now = time.time()
    registry.heartbeat("trainer", 0, 5.0, {}, stall_at=now + 60, busy="")
    (rec,) = registry.roles()
    assert rec.stalled_for_s == 0
    registry.heartbeat("trainer", 0, 5.0, {}, stall_at=now - 3, busy="PPO update")
    (rec,) = registry.roles()
    assert rec.stalled_for_s >= 3 and rec.busy == "PPO update"
    registry.set_status("trainer", 0, "stopping")  # only running roles can stall
    (rec,) = registry.roles()
    assert rec.stalled_for_s == 0
    # a restarted incarnation registers afresh: no deadline until it runs
    registry.register("trainer", 0, node="n", host="127.0.0.1", pid=2)
    registry.set_status("trainer", 0, "running")
    (rec,) = registry.roles()
    assert rec.stalled_for_s == 0


def _record(
    *, alive: bool, heartbeat_age_s: float, stalled_for_s: float = 0.0, busy: str = ""
) -> RoleRecord:
    return RoleRecord(
        role="rollout_server",
        index=0,
        node="n",
        host="127.0.0.1",
        pid=1,
        status="running",
        endpoints={},
        restarts=0,
        heartbeat_age_s=heartbeat_age_s,
        alive=alive,
        stats={},
        stalled_for_s=stalled_for_s,
        busy=busy,
    )


def test_a_frozen_role_is_stalled_after_the_heartbeat_ttl_not_the_stall_timeout() -> None:
    run = RunConfig()  # the defaults: heartbeat_ttl_s 5, stall_timeout_s 60
    frozen = _record(alive=False, heartbeat_age_s=6.0, busy="PPO update")
    what = stall_verdict(frozen, run, silence_counts=True)
    assert what is not None and "frozen" in what and "run.heartbeat_ttl_s 5" in what
    # after a Redis outage every heartbeat is old: silence does not count yet
    assert stall_verdict(frozen, run, silence_counts=False) is None
    # busy work beats: it keeps its long deadline however long it runs
    busy = _record(alive=True, heartbeat_age_s=0.5, busy="PPO update")
    assert stall_verdict(busy, run, silence_counts=True) is None
    late = _record(alive=True, heartbeat_age_s=0.5, stalled_for_s=2.0, busy="PPO update")
    assert stall_verdict(late, run, silence_counts=True) == (
        "no step finished for 62s (PPO update) (run.stall_timeout_s)"
    )


def test_a_read_that_hung_through_an_outage_breaks_the_launchers_reach() -> None:
    reach = RedisReach(max_gap_s=2.5)  # a stall check each second, heartbeat_ttl_s 3
    for t in range(10):
        reach.reached(float(t))
    assert reach.steady_for(9.0) == 9.0  # silence counts: the link held all along
    # the next read blocked through a 5 s network cut and returned once the link was back:
    # nothing raised, but the roles behind the link could not beat meanwhile either
    reach.reached(15.0)
    assert reach.steady_for(15.0) == 0.0
    reach.reached(16.0)
    assert reach.steady_for(16.0) == 1.0
    reach.lost()  # a failed read
    assert reach.steady_for(17.0) == 0.0
    reach.reached(17.0)
    assert reach.steady_for(18.0) == 1.0
