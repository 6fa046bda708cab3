"""The role processes of one node: started, restarted when they exit with an error, and killed
(their stacks written first) when STALLED.

A role that exits with an error is restarted per its restart policy (``roles.<role>.restart``:
exponential back-off, at most ``max_restarts``); a role out of restarts fails the run. A role
that is alive but STALLED has every thread's stack written to its log, is killed, and is then
restarted the same way. It is STALLED when it finished no step by the deadline its heartbeat
carries (``rlvla3/runtime/role.py``; ``busy()`` work moves that deadline up to
``run.busy_timeout_s``), or at once when its heartbeat thread too has been silent for longer
than ``run.heartbeat_ttl_s`` while its process lives: a busy role still beats, so a silent one
is frozen (stopped, or hung with the GIL held) and waiting ``run.stall_timeout_s`` for it only
costs the run time. Silence counts only while this launcher has reached Redis for a whole TTL:
after an outage every heartbeat is old until the roles beat again. The launcher
(``rlvla3/launch/launcher.py``) decides when the run ends and stops these processes in order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import redis

from rlvla3.config.run_config import Config
from rlvla3.config.sections import RunConfig
from rlvla3.launch.processes import RoleProcess, SpawnContext, dump_stacks, spawn
from rlvla3.runtime.registry import Registry
from rlvla3.runtime.registry_records import RoleRecord

REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
_STALL_CHECK_PERIOD_S = 1.0


def try_bookkeeping(action: Callable[..., object], *args: object) -> None:
    """Run a Redis bookkeeping ``action(*args)``; an unreachable Redis only skips it."""
    try:
        action(*args)
    except REDIS_ERRORS:
        pass


class RoleSupervisor:
    """Starts and tends this node's role processes.

    Args:
        cfg: the run config.
        run_dir: the run dir (role logs go to ``logs/<role>-<index>.log``).
        registry: the run's Redis bookkeeping.
        echo: where what happens to the processes is said.
        stop_requested: set when the launcher was asked to stop (cuts a stack dump short).
    """

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        registry: Registry,
        echo: Callable[[str], None],
        stop_requested: threading.Event,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.registry = registry
        self.echo = echo
        self.stop_requested = stop_requested
        self.procs: list[RoleProcess] = []
        self._next_stall_check = 0.0
        self._reach = RedisReach(max_gap_s=_STALL_CHECK_PERIOD_S + cfg.run.heartbeat_ttl_s / 2)

    def start(self, ctx: SpawnContext, nodes: Iterable[str]) -> None:
        """Start every role instance placed on one of ``nodes``."""
        mine = set(nodes)
        for role in self.cfg.roles:
            devices = self.cfg.device_plan(role)
            for index, node in enumerate(self.cfg.placement(role)):
                if node not in mine:
                    continue
                log_path = self.run_dir / "logs" / f"{role}-{index}.log"
                proc = RoleProcess(
                    role=role, index=index, node=node, log_path=log_path, device=devices[index]
                )
                self.procs.append(proc)
                spawn(proc, ctx)

    def tend(self, ctx: SpawnContext, now: float) -> str | None:
        """Kill stalled roles (at most once a second), note exits, restart those due; the
        reason the run must fail when a role is out of restarts, else None."""
        if now >= self._next_stall_check:
            self._next_stall_check = now + _STALL_CHECK_PERIOD_S
            try:
                self._kill_stalled()
            except REDIS_ERRORS:
                self._reach.lost()  # heartbeats are not news until Redis is back
        for proc in self.procs:
            failure = self._check_process(proc, now)
            if failure:
                return failure
            if proc.restart_at is not None and now >= proc.restart_at:
                spawn(proc, ctx)
        return None

    @property
    def restarts(self) -> int:
        """Restarts so far, of every process."""
        return sum(p.restarts for p in self.procs)

    @property
    def all_finished(self) -> bool:
        """Every process exited cleanly (code 0)."""
        return all(p.finished for p in self.procs)

    @property
    def any_failed(self) -> bool:
        """A process ran out of restarts."""
        return any(p.failed for p in self.procs)

    @property
    def running(self) -> int:
        """Processes alive now."""
        return sum(p.popen is not None and p.popen.poll() is None for p in self.procs)

    def _check_process(self, proc: RoleProcess, now: float) -> str | None:
        if proc.popen is None or proc.finished or proc.restart_at is not None:
            return None
        code = proc.popen.poll()
        if code is None:
            return None
        if code == 0:
            proc.finished = True
            return None
        try_bookkeeping(lambda: self.registry.mark_dead(proc.role, proc.index))
        policy = self.cfg.roles[proc.role].restart
        if proc.restarts >= policy.max_restarts:
            proc.failed = True
            self.echo(f"{proc.name} exited with code {code}; out of restarts (see {proc.log_path})")
            return f"{proc.name} failed"
        delay = policy.backoff_s * (2**proc.restarts)
        proc.restarts += 1
        try_bookkeeping(lambda: self.registry.record_restart(proc.role, proc.index))
        proc.restart_at = now + delay
        self.echo(f"{proc.name} exited with code {code}; restart {proc.restarts} in {delay:.1f}s")
        return None

    def _kill_stalled(self) -> None:
        """Kill this node's roles that are alive but stalled (``stall_verdict``), their stacks
        written to their logs first; ``_check_process`` then restarts them."""
        records = {(r.role, r.index): r for r in self.registry.roles()}
        reached = time.monotonic()
        self._reach.reached(reached)
        silence_counts = self._reach.steady_for(reached) > self.cfg.run.heartbeat_ttl_s
        for proc in self.procs:
            rec = records.get((proc.role, proc.index))
            popen = proc.popen
            if rec is None or popen is None or popen.poll() is not None or rec.pid != popen.pid:
                continue  # not running, or the record is still an earlier incarnation's
            what = stall_verdict(rec, self.cfg.run, silence_counts=silence_counts)
            if what is None:
                continue
            where = dump_stacks(popen.pid, proc.log_path, self.stop_requested)
            self.echo(f"{proc.name} STALLED: {what}; {where}; killing it")
            self.registry.incr("role_stalls")
            popen.kill()
            popen.wait()


class RedisReach:
    """How long the launcher has reached Redis without a break: only then is a role's silent
    heartbeat news about the role rather than the link. A read that failed is a break, and so
    are two reads further apart than ``max_gap_s``: a call that hung through a network outage
    and returned once the link was back raised nothing, yet the roles behind that link could
    not beat meanwhile either."""

    def __init__(self, max_gap_s: float) -> None:
        self.max_gap_s = max_gap_s
        self._since: float | None = None
        self._last: float | None = None

    def reached(self, at: float) -> None:
        """A read succeeded at ``at`` (monotonic seconds)."""
        if self._since is None or self._last is None or at - self._last > self.max_gap_s:
            self._since = at
        self._last = at

    def lost(self) -> None:
        """A read failed."""
        self._since = None

    def steady_for(self, at: float) -> float:
        """Seconds of unbroken reach up to ``at``."""
        return 0.0 if self._since is None else at - self._since


def stall_verdict(rec: RoleRecord, run: RunConfig, *, silence_counts: bool) -> str | None:
    """Why the live process behind ``rec`` counts as stalled (None: it does not).

    Frozen: its heartbeat thread has been silent past ``run.heartbeat_ttl_s`` (only when
    ``silence_counts``: the launcher reached Redis all that time), whatever it said it was
    busy with. Stalled: its work loop missed the step deadline its heartbeat carries."""
    beating = rec.status in ("starting", "running")
    if silence_counts and beating and not rec.alive:
        if rec.heartbeat_age_s > run.heartbeat_ttl_s:
            return (
                f"no heartbeat for {rec.heartbeat_age_s:.0f}s (run.heartbeat_ttl_s "
                f"{run.heartbeat_ttl_s:g}): the whole process is frozen"
            )
    if rec.stalled_for_s <= 0:
        return None
    what = f"no step finished for {run.stall_timeout_s + rec.stalled_for_s:.0f}s"
    if rec.busy:
        what += f" ({rec.busy})"
    return f"{what} (run.stall_timeout_s)"
