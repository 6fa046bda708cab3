"""Hostile frames at a real socket of each kind a role listens on: nested arrays are counted and
dropped, oversized frames are dropped by libzmq (``ZMQ_MAXMSGSIZE``), and a CURVE socket
refuses a peer no ZAP handler admitted, even after its handler is closed."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq

from tests.conftest import wait_until
from tests.fuzz_frames import cartpole_chunk, nested_array_messages
from transport import security, sockets
from transport.codec import CodecError, MalformedFrame, encode
from transport.messages import ObsRequest, WeightsRequest, WeightsUpdate
from transport.socket_limits import (
    CONTROL_LIMITS,
    MIB,
    chunk_limits,
    request_limits,
    weights_limits,
)

# socket kind -> (the receiving socket's factory, its limits, the sender's type, a good message)
KINDS = {
    "requests": (
        sockets.RouterSocket,
        request_limits(observation_bytes=16, rows=1),
        zmq.DEALER,
        ObsRequest(env_key="0/0", request_id=1, obs={"state": np.zeros(4, np.float32)}),
    ),
    "chunks": (
        sockets.pull,
        chunk_limits(observation_bytes=16, chunk_len=32),
        zmq.PUSH,
        cartpole_chunk(2, "0/0#0"),
    ),
    "weights": (
        sockets.pull,
        weights_limits(8 * MIB),
        zmq.PUSH,
        WeightsUpdate(version=1, layout="x", flat=np.zeros(1000, np.float32)),
    ),
    "control": (
        sockets.RouterSocket,
        CONTROL_LIMITS,
        zmq.DEALER,
        WeightsRequest(after_version=-1),
    ),
}


class Receiver:
    """A role's listening socket of one kind, with its bad frames collected."""

    def __init__(self, kind: str) -> None:
        factory, limits, self.sender_type, self.good = KINDS[kind]
        self.bad: list[CodecError] = []
        self.socket = factory(on_bad_frame=self.bad.append, limits=limits)
        self.address = self.socket.bind()
        self.senders: list[zmq.Socket] = []

    def sender(self, configure: Callable[[zmq.Socket], None] = lambda _: None) -> zmq.Socket:
        sock = zmq.Context.instance().socket(self.sender_type)
        sock.setsockopt(zmq.LINGER, 0)
        configure(sock)
        sock.connect(self.address)
        self.senders.append(sock)
        return sock

    def next_message(self, timeout_s: float = 10) -> object | None:
        """The next message that decodes (None: none within ``timeout_s``); bad ones on the
        way go to ``bad``."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            got = (
                self.socket.recv_from(left)
                if isinstance(self.socket, sockets.RouterSocket)
                else self.socket.recv(left)
            )
            if got is not None:
                return got[1] if isinstance(got, tuple) else got
        return None

    def got_good(self) -> bool:
        """The next message that decodes is the good one (compared as encoded: by value)."""
        got = self.next_message()
        return got is not None and _wire(got) == _wire(self.good)

    def close(self) -> None:
        for sock in self.senders:
            sock.close()
        self.socket.close()


def _wire(msg: object) -> list[bytes]:
    return [bytes(frame) for frame in encode(msg)]


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(kind: str) -> Receiver:
        made.append(Receiver(kind))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("kind", ["requests", "chunks", "weights"])
def test_nested_arrays_are_counted_and_the_socket_keeps_serving(receiver, kind: str) -> None:
    """~200 KB of nested msgpack arrays where an array belongs, each message type of the
    fuzz suite: every one reaches the bad-frame handler, and a good message follows."""
    r = receiver(kind)
    nested = nested_array_messages()
    sender = r.sender()
    for frames in nested:
        sender.send_multipart(frames)
    sender.send_multipart(encode(r.good))
    assert r.got_good()
    assert len(r.bad) == len(nested) and all(isinstance(e, MalformedFrame) for e in r.bad)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_frame_over_the_sockets_limit_is_dropped_by_libzmq(receiver, kind: str) -> None:
    """A well-formed message larger than the socket kind takes (16 MiB; the codec's default
    limits would decode it) never arrives: libzmq drops it and disconnects its sender, which
    reconnects, and its next message arrives."""
    r = receiver(kind)
    too_big = WeightsUpdate(version=2, layout="x", flat=np.zeros(16 * MIB // 4, np.float32))
    sender = r.sender(lambda s: s.setsockopt(zmq.RECONNECT_IVL, 10))
    sender.send_multipart(encode(too_big))
    sender.send_multipart(encode(r.good))
    assert r.got_good()
    assert not r.bad  # (libzmq dropped it unread: the codec never saw it)


@pytest.fixture
def curve(monkeypatch):
    """CURVE on for the sockets this test makes, with this process's ZAP handler."""
    guard = security.CurveSecurity("a run secret", sockets.context())
    monkeypatch.setattr(security, "_active", guard)
    yield guard
    guard.close()


def test_a_closed_zap_handler_admits_no_unknown_key(receiver, curve) -> None:
    """With the ZAP handler closed libzmq admits any client key: each socket (a PULL and a
    ROUTER) still refuses every message of a peer the handler did not admit, counts it, and
    keeps serving the run's peers. (One test for both: a CURVE server's monitor endpoint is
    named after its fd, which a socket made right after another's close may reuse.)"""
    refused: list[str] = []
    curve.on_refused = refused.append
    served = {kind: receiver(kind) for kind in ("chunks", "requests")}
    peers = {"chunks": sockets.push(), "requests": sockets.dealer()}
    for kind, r in served.items():
        peers[kind].connect(r.address)
        assert peers[kind].send(r.good, timeout_s=5)
        assert r.got_good()  # admitted while the handler ran
    curve.close()

    def random_key(sock: zmq.Socket) -> None:
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey = curve.keys.server_public
        sock.curve_publickey, sock.curve_secretkey = public, secret

    for kind, r in served.items():
        refused.clear()
        r.sender(random_key).send_multipart(encode(r.good))
        arrived: list[object] = []

        def refusal_counted(r: Receiver = r, arrived: list = arrived) -> bool:
            msg = r.next_message(timeout_s=0.05)
            if msg is not None:
                arrived.append(msg)
            return bool(refused)

        wait_until(refusal_counted, 10, f"the refusal on {kind}")
        assert not arrived and "no ZAP handler admitted" in refused[0]
        assert peers[kind].send(r.good, timeout_s=5)
        assert r.got_good()
    for peer in peers.values():
        peer.close()


@pytest.mark.parametrize("kind", ["requests", "chunks", "weights"])
def test_an_empty_array_of_an_impossible_shape_is_counted_not_raised(receiver, kind) -> None:
    """Zero elements pass every size check, yet numpy refuses the shape ``[0, 2**40, 2**40]``:
    that must be a counted bad frame naming the field, not an exception out of ``recv``."""
    import msgpack

    from tests.fuzz_frames import _header_with

    r = receiver(kind)
    impossible = msgpack.packb(["float32", [0, 2**40, 2**40], b""])
    obs = b"\x81" + msgpack.packb("state") + impossible
    empty = ["float32", [0], b""]
    header = {
        "requests": _header_with("ObsRequest", ["0/0", 7], obs, []),
        "weights": _header_with("WeightsUpdate", [1, "x"], impossible, []),
        "chunks": _header_with("TrajectoryChunk", [0, 0, 0], obs, [*[empty] * 7, 0.0, "0/0#n", ""]),
    }[kind]
    sender = r.sender()
    sender.send_multipart([header])
    sender.send_multipart(encode(r.good))
    assert r.got_good()
    assert len(r.bad) == 1 and isinstance(r.bad[0], MalformedFrame)
    assert "array shape [0, 1099511627776, 1099511627776]" in str(r.bad[0])
