"""A role's liveness: when it counts as stalled, the heartbeat thread that says so, and the clock
of a Redis outage that the thread and the role's loop share.

Liveness is progress: the heartbeat carries the time by which the next step must have finished
(the last one plus ``run.stall_timeout_s``). Work that is slow by nature says so (``busy``) and
moves the deadline; work stuck beside the loop (an env thread inside its simulator) brings it
forward. Every half second the thread flushes the role's counters; at most once a second (and at least
three times per ``run.heartbeat_ttl_s``) it publishes a heartbeat: the role's gauges and the
time by which its next step must have finished. A role whose launcher died stops rather than
linger. While Redis cannot be reached the role rides the outage out for ``run.head_timeout_s``,
then stops; when Redis answers again in time, the beats resume and the role is part of the run
again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

_FLUSH_PERIOD_S = 0.5


class Liveness:
    """When a role counts as stalled, in wall-clock time (the launcher compares it with its
    own clock)."""

    def __init__(self, stall_timeout_s: float, busy_timeout_s: float) -> None:
        """``run.stall_timeout_s`` and ``run.busy_timeout_s``."""
        self.stall_timeout_s = stall_timeout_s
        self.busy_timeout_s = busy_timeout_s
        self._progress_at = 0.0  # when the last step finished (0: not running)
        self._busy: tuple[str, float] | None = None  # what the role is busy with, until when

    def progress(self) -> None:
        """The role finished a step (or a milestone of long work)."""
        self._progress_at = time.time()

    def stopping(self) -> None:
        """The role is stopping: it is no longer held to the step deadline."""
        self._progress_at = 0.0

    @contextlib.contextmanager
    def busy(self, what: str, up_to_s: float | None = None) -> Iterator[None]:
        """The enclosed work is slow by nature: the deadline moves up to ``up_to_s`` (default
        ``run.busy_timeout_s``) ahead while it runs."""
        limit = self.busy_timeout_s if up_to_s is None else up_to_s
        self._busy = (what, time.time() + limit)
        try:
            yield
        finally:
            self._busy = None
            self.progress()

    def deadline(self, stuck_work: Callable[[], tuple[float, str] | None]) -> tuple[float, str]:
        """(wall time after which the role counts as stalled, 0 when not running; what it is
        busy with, or where it is stuck). ``stuck_work`` is asked only while the role runs:
        (when the oldest unfinished work beside the loop began, what it is), or None."""
        if not self._progress_at:
            return 0.0, ""
        timeout = self.stall_timeout_s
        deadline, what = self._progress_at + timeout, ""
        busy = self._busy
        if busy is not None:
            deadline, what = max(deadline, busy[1]), busy[0]
        stuck = stuck_work()
        if stuck is not None and stuck[0] + timeout < deadline:
            deadline, what = stuck[0] + timeout, stuck[1]
        return deadline, what


class RedisOutage:
    """Since when Redis has failed a role, if it has. Thread-safe: the role's loop and its
    heartbeat thread both note failures."""

    def __init__(self, limit_s: float) -> None:
        """``limit_s``: how long an outage may last before the role gives up (``run.head_timeout_s``)."""
        self.limit_s = limit_s
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic time of the first failure; None: reachable

    def mark_lost(self, now: float) -> bool:
        """Note that Redis failed at ``now``; True when this starts an outage."""
        with self._lock:
            if self._since is not None:
                return False
            self._since = now
            return True

    def clear(self) -> None:
        """Redis answered: the outage (if any) is over."""
        with self._lock:
            self._since = None

    def duration_s(self) -> float:
        """How long Redis has been failing (0: it has not)."""
        since = self._since
        return 0.0 if since is None else time.monotonic() - since

    def gone_for_good(self) -> bool:
        """The outage has lasted longer than the role may wait."""
        return self.duration_s() >= self.limit_s


class Heartbeat:
    """The thread that flushes a role's counters and publishes its heartbeats.

    Args:
        beat: publishes one heartbeat (raises when Redis fails).
        flush: sends the counters gathered since the last flush.
        ttl_s: the heartbeat's time to live (``run.heartbeat_ttl_s``).
        outage: the role's Redis outage clock.
        stop_event: set to stop the role (launcher gone, Redis gone for good).
        log: the role's logger.
    """

    def __init__(
        self,
        *,
        beat: Callable[[], None],
        flush: Callable[[], None],
        ttl_s: float,
        outage: RedisOutage,
        stop_event: threading.Event,
        log: logging.Logger,
    ) -> None:
        self._beat, self._flush, self._ttl_s = beat, flush, ttl_s
        self._outage, self._stop_role, self._log = outage, stop_event, log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self) -> None:
        """Start beating."""
        self._thread.start()

    def stop(self) -> None:
        """Stop beating (waits up to 5 s for a beat in progress)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        last_beat = last_success = time.monotonic()
        parent = os.getppid()
        while not self._stop.wait(_FLUSH_PERIOD_S):
            if os.getppid() != parent:  # the launcher died without stopping us: do not linger
                self._log.error("launcher (pid %d) is gone: stopping", parent)
                self._stop_role.set()
            self._flush()
            if time.monotonic() - last_beat < min(self._ttl_s / 3, 1.0):
                continue
            last_beat = time.monotonic()
            try:
                self._beat()
                self._outage.clear()
                now = time.monotonic()
                if now - last_success > self._ttl_s:
                    # beats failed, or hung on a dead link until it came back: either way the
                    # role was shown LOST meanwhile, and is back now
                    self._log.info(
                        "Redis reachable again after %.0fs: rejoined the run", now - last_success
                    )
                last_success = now
            except Exception as err:  # an outage: ride it out up to run.head_timeout_s
                if self._outage.mark_lost(last_beat):
                    self._log.warning("heartbeat failed: %s", err)
                if self._outage.gone_for_good():
                    self._log.error(
                        "Redis unreachable for %.0fs: stopping", self._outage.duration_s()
                    )
                    self._stop_role.set()
