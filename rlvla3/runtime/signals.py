"""SIGINT/SIGTERM handling that cannot deadlock: callbacks run on a watcher thread.

A Python signal handler runs in the main thread between two bytecodes, possibly while that
thread holds a lock. ``threading.Event.wait`` holds its condition's (non-reentrant) lock for a
moment after every timeout, so a handler that calls ``event.set()`` on an event the main thread
polls with short waits deadlocks the process now and then: it never stops and has to be killed.
(An env worker polling its stop event every 10 ms once logged the SIGTERM and then never
stopped, under load, which is what this race looks like.)

Here the handler only counts; ``signal.set_wakeup_fd`` makes the C-level handler write the
signal number to a pipe, and a daemon thread reading that pipe calls the callbacks, holding no
lock of the main thread.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

StopCallback = Callable[[int, int], None]  # (signal number, how many stop signals so far)


def install_stop_signals(callback: StopCallback) -> bool:
    """Call ``callback(signum, count)`` on a watcher thread for each SIGINT/SIGTERM.

    Must be called from the main thread (Python installs handlers only there); returns False,
    installing nothing, when called from another thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def handler(_signum: int, _frame: object) -> None:
        pass  # the wake-up byte is already written; the watcher thread does the work

    count = 0

    def watch() -> None:
        nonlocal count
        while True:
            for signum in os.read(read_fd, 64):
                if signum in (signal.SIGINT, signal.SIGTERM):
                    count += 1
                    callback(signum, count)

    threading.Thread(target=watch, name="signals", daemon=True).start()
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return True
