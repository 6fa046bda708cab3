"""Sockets on loopback: queues with back-pressure, request-reply, pub-sub, bad-frame handling."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from transport import sockets
from transport.codec import CodecError
from transport.messages import ActionReply, ObsRequest, WeightsUpdate


def ping(seq: int, n: int = 4) -> WeightsUpdate:
    return WeightsUpdate(version=seq, layout="t", flat=np.full(n, seq, np.float32))


@pytest.fixture
def pair():
    made: list[sockets.MessageSocket] = []

    def make(factory, **kwargs):
        sock = factory(**kwargs)
        made.append(sock)
        return sock

    yield make
    for sock in made:
        sock.close()


@pytest.mark.parametrize("scheme", ["tcp", "ipc"])
def test_push_pull_round_trip(pair, scheme: str, tmp_path) -> None:
    receiver = pair(sockets.pull)
    address = receiver.bind(scheme=scheme, ipc_dir=str(tmp_path))
    assert address.startswith(f"{scheme}://")
    sender = pair(sockets.push)
    sender.connect(address)
    for i in range(50):
        assert sender.send(ping(i), timeout_s=5)
    got = [receiver.recv(timeout_s=5) for _ in range(50)]
    assert [g.version for g in got] == list(range(50))
    np.testing.assert_array_equal(got[7].flat, np.full(4, 7, np.float32))


def test_tcp_binds_a_free_port_on_loopback(pair) -> None:
    a, b = pair(sockets.pull), pair(sockets.pull)
    addr_a, addr_b = a.bind(), b.bind()
    assert addr_a.startswith("tcp://127.0.0.1:") and addr_a != addr_b


def test_full_queue_applies_back_pressure(pair) -> None:
    receiver = pair(sockets.pull, hwm=2)
    receiver.raw.setsockopt(zmq.RCVBUF, 1024)
    address = receiver.bind()
    sender = pair(sockets.push, hwm=2)
    sender.raw.setsockopt(zmq.SNDBUF, 1024)
    sender.connect(address)
    big = ping(0, n=1 << 16)
    sent = 0
    while sender.send(big, timeout_s=0.2):
        sent += 1
        assert sent < 1000, "queue never filled: no back-pressure"
    assert sent >= 2  # the receiver is not reading: the sender is told the queue is full
    assert receiver.recv(timeout_s=5) is not None  # draining makes room again
    assert sender.send(ping(1), timeout_s=5)


def test_router_dealer_request_reply_across_two_servers(pair) -> None:
    servers = [pair(sockets.RouterSocket) for _ in range(2)]
    client = pair(sockets.dealer)
    client.connect([s.bind() for s in servers])
    for i in range(4):
        client.send(ObsRequest(env_key="0/0", request_id=i, obs={"state": np.zeros(3, np.float32)}))
    seen = {0: 0, 1: 0}
    for _ in range(4):
        for k, server in enumerate(servers):
            got = server.recv_from(timeout_s=0.01)
            if got is not None:
                identity, req = got
                seen[k] += 1
                reply = ActionReply(
                    request_id=req.request_id,
                    action=np.array(1),
                    log_prob=-0.1,
                    value=0.5,
                    policy_version=3,
                )
                assert server.send_to(identity, reply)
    assert seen == {0: 2, 1: 2}  # a DEALER spreads requests round-robin over its servers
    ids = sorted(client.recv(timeout_s=5).request_id for _ in range(4))
    assert ids == [0, 1, 2, 3]


def test_bad_frames_go_to_the_handler_and_receiving_carries_on(pair) -> None:
    errors: list[CodecError] = []
    receiver = pair(sockets.pull, on_bad_frame=errors.append)
    address = receiver.bind()
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    try:
        raw.send_multipart([b"\xc1not msgpack"])
        raw.send_multipart([b"\x93\x01"])
        raw.send_multipart([b"\xc1" * 5000])
        assert receiver.recv(timeout_s=5) is None
        assert receiver.recv(timeout_s=5) is None
        assert receiver.recv(timeout_s=5) is None
        sender = pair(sockets.push)
        sender.connect(address)
        sender.send(ping(5))
        assert receiver.recv(timeout_s=5).version == 5
    finally:
        raw.close()
    assert len(errors) == 3 and all(isinstance(e, CodecError) for e in errors)


def test_without_a_handler_bad_frames_raise(pair) -> None:
    receiver = pair(sockets.pull)
    address = receiver.bind()
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    try:
        raw.send(b"junk")
        with pytest.raises(CodecError):
            receiver.recv(timeout_s=5)
    finally:
        raw.close()


def test_multi_part_messages_are_received_whole_on_router_and_pull(pair) -> None:
    """Big arrays travel as extra parts; junk parts are consumed with their message, so the
    next message is intact (parts are read until ZeroMQ says none follow)."""
    big = ping(1, n=1 << 15)  # 128 KiB: its own zero-copy data frame
    errors: list[CodecError] = []
    server = pair(sockets.RouterSocket, on_bad_frame=errors.append)
    client = pair(sockets.dealer)
    client.connect(server.bind())
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.addresses[0])
    try:
        raw.send_multipart([b"\xc1junk", b"more junk", b"and more"])
        raw.send_multipart([b"\xc1junk again"])
        assert server.recv_from(timeout_s=5) is None  # the first junk, whole
        assert server.recv_from(timeout_s=5) is None  # (else this would be "more junk")
        assert len(errors) == 2
        client.send(big)
        client.send(ping(2))
        identity, got = server.recv_from(timeout_s=5)
        np.testing.assert_array_equal(got.flat, big.flat)
        assert server.recv_from(timeout_s=5)[1].version == 2
        assert len(errors) == 2
        server.send_to(identity, big)
        np.testing.assert_array_equal(client.recv(timeout_s=5).flat, big.flat)
    finally:
        raw.close()


def test_an_image_observation_arrives_intact(pair) -> None:
    """An 84x84x3 image travels inline in the header frame (under 64 KiB) and arrives intact."""
    receiver = pair(sockets.pull)
    sender = pair(sockets.push)
    sender.connect(receiver.bind())
    image = np.random.default_rng(0).integers(0, 255, (84, 84, 3), dtype=np.uint8)
    sender.send(ObsRequest(env_key="1/2", request_id=7, obs={"image": image}))
    got = receiver.recv(timeout_s=5)
    np.testing.assert_array_equal(got.obs["image"], image)
    assert got.env_key == "1/2" and got.request_id == 7
