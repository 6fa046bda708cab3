"""Chunks an env worker counted as pushed leave its process before it exits.

Roles end with ``os._exit`` (no ZeroMQ teardown), so a socket's ``LINGER`` alone keeps
nothing: what the process still queued died with it, and the chunk ledger counted those
chunks lost in transit. ``transport.sockets.DeliveryContext`` is waited for at exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import zmq

from transport import sockets

MESSAGES = 40
MESSAGE_BYTES = 1 << 20  # 40 MiB in all: far beyond what the kernel's socket buffers hold

_SENDER = textwrap.dedent(
    """
    import os, sys
    import zmq
    from transport import sockets
    from transport.messages import WeightsUpdate
    import numpy as np

    address, wait = sys.argv[1], sys.argv[2] == "wait"
    delivery = sockets.DeliveryContext() if wait else None
    push = sockets.push(hwm={messages}, delivery=delivery)
    push.raw.setsockopt(zmq.LINGER, 30_000)
    push.connect([address])
    flat = np.zeros({size} // 4, np.float32)
    for version in range({messages}):
        push.send(WeightsUpdate(version=version, layout="t", flat=flat))
    push.raw.close()
    print("closed", flush=True)  # the receiver has read nothing yet: all is queued here
    sys.stdin.readline()  # the receiver starts reading
    if delivery is not None:
        assert delivery.finish(timeout_s=60), "not delivered in time"
    os._exit(0)  # as a role ends (rlvla3/runtime/role_main.py)
    """
).format(messages=MESSAGES, size=MESSAGE_BYTES)


def _send_and_exit(wait: bool) -> int:
    """Messages a receiver gets from a process that queued them all, closed its socket and
    exited with ``os._exit`` (after waiting for its delivery context when ``wait``)."""
    pull = sockets.pull(hwm=1)
    address = pull.bind()
    sender = subprocess.Popen(
        [sys.executable, "-c", _SENDER, address, "wait" if wait else "exit"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sender.stdout.readline().strip() == "closed"
        sender.stdin.write("go\n")
        sender.stdin.flush()
        received = 0
        # after the last one, a second of nothing: a sender that exits early sends no more
        while received < MESSAGES and (msg := pull.recv(timeout_s=1.0)) is not None:
            assert msg.version == received
            received += 1
        assert sender.wait(timeout=60) == 0
        return received
    finally:
        if sender.poll() is None:
            sender.kill()
        pull.close()


def test_a_delivery_context_delivers_everything_queued_before_os_exit() -> None:
    assert _send_and_exit(wait=True) == MESSAGES


def test_without_it_what_was_queued_dies_with_the_process() -> None:
    # the failure the context exists for: the sender exits while its queue is still full
    assert _send_and_exit(wait=False) < MESSAGES


def test_finish_is_bounded_while_a_socket_stays_open() -> None:
    delivery = sockets.DeliveryContext()
    left_open = delivery.raw.socket(zmq.PUSH)
    try:
        assert not delivery.finish(timeout_s=0.2)
    finally:
        left_open.close(linger=0)
