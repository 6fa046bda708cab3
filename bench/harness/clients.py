"""Request-reply clients that time a server: strict ping-pong through our codec and sockets
(``strict_client``) or as raw pyzmq bytes (``raw_client``), and many requests in flight on one
socket (``batched_client``). Each returns requests (or observations) per second."""

from __future__ import annotations

import time
from collections.abc import Sequence

import zmq

from transport import sockets
from transport.messages import ActionReply, ObsRequest

from .wire_messages import frames, obs_request


def strict_client(address: str, duration_s: float) -> tuple[float, float, float]:
    """(req/s, window start, window end) of one DEALER doing strict request-reply through our
    codec and sockets."""
    sock = sockets.dealer()
    sock.connect(address)
    _roundtrips(sock, 200)  # warm-up: connection up, server loop hot
    started = time.monotonic()
    count = 0
    while (now := time.monotonic()) - started < duration_s:
        count += _roundtrips(sock, 100)
    sock.close()
    return count / (now - started), started, now


def _roundtrips(sock: sockets.MessageSocket, n: int) -> int:
    for i in range(n):
        sock.send(obs_request(i))
        reply = sock.recv(timeout_s=30)
        if not isinstance(reply, ActionReply):
            raise RuntimeError(f"no reply from the rollout server (got {reply!r})")
    return n


def batched_client(
    address: str,
    inflight: int,
    duration_s: float,
    codec: bool,
    requests: Sequence[ObsRequest] = (),
) -> tuple[float, float, float]:
    """(obs/s, window start, window end) with ``inflight`` requests always outstanding.

    ``codec``: encode every request and decode every reply, as one env worker would; else send
    pre-encoded request bytes and only count replies, so the client costs little beside the
    server (64 envs are normally spread over several env-worker processes).
    ``requests``: the requests to send in turn (default: CartPole's ``obs_request``).
    """
    sock = sockets.dealer(hwm=10_000)
    sock.connect(address)
    messages = list(requests) or [obs_request(0)]
    encoded = [frames(m) for m in messages]

    def send(i: int) -> None:
        if codec:
            sock.send(messages[i % len(messages)] if requests else obs_request(i))
        else:
            sock.raw.send_multipart(encoded[i % len(encoded)])

    def receive() -> None:
        reply = sock.recv(timeout_s=30) if codec else sock.poll(30) and sock.raw.recv_multipart()
        if not reply or (codec and not isinstance(reply, ActionReply)):
            raise RuntimeError("no reply from the rollout server")

    for i in range(inflight):
        send(i)
    for i in range(10 * inflight):  # warm-up
        receive()
        send(i)
    started, count = time.monotonic(), 0
    while (now := time.monotonic()) - started < duration_s:
        receive()
        send(count)
        count += 1
    sock.close()
    return count / (now - started), started, now


def raw_client(address: str, duration_s: float) -> float:
    """Requests/s of a plain DEALER doing strict request-reply with pre-built request bytes."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    request = frames(obs_request(0))
    for _ in range(200):
        sock.send_multipart(request)
        sock.recv_multipart()
    started = time.monotonic()
    count = 0
    while (elapsed := time.monotonic() - started) < duration_s:
        for _ in range(100):
            sock.send_multipart(request)
            sock.recv_multipart()
        count += 100
    sock.close()
    return count / elapsed
