"""Stop signals never deadlock a process that polls its stop event with short waits."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.launching import REPO

CHILD = """
import sys, threading
from rlvla3.runtime.signals import install_stop_signals
stop = threading.Event()
install_stop_signals(lambda signum, count: stop.set())
def busy():  # GIL contention: the main thread is often switched out while holding a lock
    while True:
        pass
for _ in range(2):
    threading.Thread(target=busy, daemon=True).start()
print("ready", flush=True)
while not stop.wait(0.0002):  # like an env worker's step loop in sync mode, but tighter
    pass
print("stopped", flush=True)
"""


def test_sigterm_stops_a_tight_event_polling_loop_every_time() -> None:
    # A handler calling stop.set() inside the main thread deadlocked now and then: when the
    # signal landed while Event.wait held its condition lock. Each child must stop promptly.
    for _ in range(15):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            child.send_signal(signal.SIGTERM)
            assert child.wait(timeout=10) == 0
            assert child.stdout.read().strip() == "stopped"
        finally:
            if child.poll() is None:
                child.kill()


def test_install_from_another_thread_installs_nothing() -> None:
    import threading

    from rlvla3.runtime.signals import install_stop_signals

    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(install_stop_signals(print)))
    thread.start()
    thread.join(timeout=10)
    assert result == [False]
