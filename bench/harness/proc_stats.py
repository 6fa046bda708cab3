"""A process's CPU time and placement, from Linux's /proc: what a server costs per request, and
keeping a client and its servers on CPUs of their own while they are timed."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid``, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Run every thread of process ``pid`` on ``cpus`` only (threads it starts later inherit
    the affinity of the thread that starts them). Linux."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def placed_apart(server_pids: list[int], pin: bool) -> Iterator[str]:
    """With ``pin`` and at least two usable CPUs: this process (the client) on the first, the
    servers on the second, until the block ends; yields how the processes were placed.

    Ping-pong at batch 1 is mostly wake-ups: client, server and their ZeroMQ I/O threads hand
    each message on. Left to the scheduler, whether a server shares a core with its I/O thread
    or with the client changes from one process to the next, and with it the rate (the same
    server measured from about 5,700 to 11,500 req/s on the 2-core machine). Every case is
    placed alike, so the ratios compare servers, not placements.
    """
    usable = sorted(os.sched_getaffinity(0))
    if not pin or len(usable) < 2:
        yield "unpinned (left to the scheduler)"
        return
    for pid in server_pids:
        pin_threads(pid, {usable[1]})
    pin_threads(os.getpid(), {usable[0]})
    try:
        yield f"pinned: client on CPU {usable[0]}, servers on CPU {usable[1]}"
    finally:
        pin_threads(os.getpid(), set(usable))
