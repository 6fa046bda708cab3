"""ZeroMQ sockets that speak ``transport.messages`` through the codec.

- PUSH/PULL: one-way queues with high-water marks; a full queue blocks the sender (back-pressure)
  instead of growing memory.
- ROUTER/DEALER: request-reply across many clients and servers; a DEALER connected to several
  servers spreads its requests over them.

Binding always picks a free port (or a fresh ipc path); the caller publishes the address in Redis
(see ``rlvla3/runtime/registry.py``) and peers find it there. When ``transport.security`` is enabled
(multi-host runs), every tcp socket is a CURVE server (bound) or client (connected). Receivers never raise on bad input: a frame
that fails to decode is handed to ``on_bad_frame`` and dropped, and receiving carries on.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import zmq

from transport import security
from transport.bind_policy import check_bind
from transport.codec import DEFAULT_LIMITS, Codec, CodecError, CodecLimits

BadFrameHandler = Callable[[CodecError], None]
_ipc_counter = itertools.count()


def context() -> zmq.Context:
    """The process-wide ZeroMQ context."""
    return zmq.Context.instance()


class DeliveryContext:
    """A ZeroMQ context for sockets whose queued messages must reach their peer before the
    process exits (an env worker's chunks: counted as pushed once queued).

    A socket's ``LINGER`` keeps its queue after ``close`` only while the context's I/O thread
    lives, and roles end with ``os._exit`` (``rlvla3/runtime/role_main.py``), which never
    terminates the process-wide context: what was still queued died with the process. A
    context of their own lets these sockets be waited for alone (``finish``), whatever other
    sockets of the process are still open.
    """

    def __init__(self) -> None:
        self.raw = zmq.Context()

    def finish(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every socket of this context is closed and has sent
        what it queued (or its linger ran out); True when that happened in time."""
        done = threading.Event()

        def terminate() -> None:
            self.raw.term()  # blocks until then
            done.set()

        threading.Thread(target=terminate, name="zmq-delivery", daemon=True).start()
        return done.wait(timeout_s)


class MessageSocket:
    """A ZeroMQ socket that sends and receives messages (not raw bytes).

    Args:
        kind: a zmq socket type (``zmq.PUSH``, ``zmq.PULL``, ...).
        hwm: high-water mark, in messages, for both directions.
        on_bad_frame: called with the error when an incoming message fails to decode.
        limits: decode bounds for incoming frames; their largest frame is also the socket's
            ``ZMQ_MAXMSGSIZE``, so libzmq drops a larger frame (and disconnects its sender)
            before buffering it (``transport/socket_limits.py`` has one per socket kind).
        delivery: the context to open it in when what it queues must be delivered at exit
            (``DeliveryContext``); None: the process-wide one.
    """

    def __init__(
        self,
        kind: int,
        *,
        hwm: int = 1000,
        on_bad_frame: BadFrameHandler | None = None,
        limits: CodecLimits = DEFAULT_LIMITS,
        delivery: DeliveryContext | None = None,
    ) -> None:
        self.raw = (context() if delivery is None else delivery.raw).socket(kind)
        self.raw.setsockopt(zmq.LINGER, 0)
        self.raw.setsockopt(zmq.SNDHWM, hwm)
        self.raw.setsockopt(zmq.RCVHWM, hwm)
        self.raw.setsockopt(zmq.MAXMSGSIZE, max(limits.max_header_bytes, limits.max_frame_bytes))
        self._on_bad_frame = on_bad_frame
        self._codec = Codec(limits)  # a socket lives in one thread, so may its codec
        self._router = kind == zmq.ROUTER
        # zmq_poll on prebuilt item lists: Socket.poll builds a Poller on every call (~7 µs
        # against ~3), and receivers with a timeout poll once per message.
        self._poll_in = [(self.raw, zmq.POLLIN)]
        self._poll_out = [(self.raw, zmq.POLLOUT)]
        self.addresses: list[str] = []
        self._curve_client = False
        self._curve_server: security.CurveSecurity | None = None  # checks each message's peer

    def bind(self, host: str = "127.0.0.1", scheme: str = "tcp", ipc_dir: str | None = None) -> str:
        """Bind to a free port on ``host`` (tcp) or a new path in ``ipc_dir`` (ipc); return it."""
        if scheme == "tcp":
            curve = security.active()
            check_bind(host, curve is not None)
            if curve is not None and not self.addresses:
                curve.server(self.raw)
                self._curve_server = curve
            port = self.raw.bind_to_random_port(f"tcp://{host}")
            address = f"tcp://{host}:{port}"
        elif scheme == "ipc":
            directory = Path(ipc_dir or "/tmp")
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"rlvla3-{os.getpid()}-{next(_ipc_counter)}.sock"
            address = f"ipc://{path}"
            self.raw.bind(address)
        else:
            raise ValueError(f"scheme {scheme!r}: expected 'tcp' or 'ipc'")
        self.addresses.append(address)
        return address

    def connect(self, addresses: str | Iterable[str]) -> None:
        """Connect to one or more peer addresses not already connected."""
        for address in [addresses] if isinstance(addresses, str) else addresses:
            if address not in self.addresses:
                curve = security.active()
                if curve is not None and not self._curve_client and address.startswith("tcp"):
                    curve.client(self.raw)
                    self._curve_client = True
                self.raw.connect(address)
                self.addresses.append(address)

    def sync_peers(self, addresses: list[str]) -> None:
        """Be connected to exactly ``addresses`` (peers that went away are disconnected, so no
        message is queued for a dead peer)."""
        for address in [a for a in self.addresses if a not in addresses]:
            self.disconnect(address)
        self.connect(addresses)

    def disconnect(self, address: str) -> None:
        """Drop a peer (e.g. a server that went away)."""
        if address in self.addresses:
            self.raw.disconnect(address)
            self.addresses.remove(address)

    def send(self, msg: Any, timeout_s: float | None = None, prefix: list[bytes] = ()) -> bool:
        """Send ``msg``; wait up to ``timeout_s`` (None: forever) for queue space.

        Returns False if the queue stayed full for the whole timeout (the message is not sent).
        """
        if timeout_s is not None and not zmq.zmq_poll(self._poll_out, _ms(timeout_s)):
            return False
        frames = self._codec.encode(msg)
        if len(frames) == 1:  # the common case: one header frame, inline arrays
            # Part by part rather than send_multipart, whose per-part checks cost more than
            # the send itself for a reply of ~70 bytes.
            raw = self.raw
            for part in prefix:
                raw.send(part, zmq.SNDMORE)
            raw.send(frames[0])
            return True
        # data frames hold large arrays: hand zmq our buffers (zero-copy)
        self.raw.send_multipart([*prefix, *frames], copy=False)
        return True

    def recv(self, timeout_s: float | None = None) -> Any | None:
        """The next message, or None on timeout or when the incoming frames were bad."""
        frames = self._recv_frames(timeout_s)
        return None if frames is None else self._decode(frames)

    def poll(self, timeout_s: float) -> bool:
        """True when a message is ready to receive within ``timeout_s``."""
        return bool(zmq.zmq_poll(self._poll_in, _ms(timeout_s)))

    def close(self) -> None:
        """Close the socket, dropping anything unsent (LINGER 0)."""
        self.raw.close(linger=0)

    def _recv_frames(self, timeout_s: float | None) -> list[Any] | None:
        if timeout_s is not None and not self.poll(timeout_s):
            return None
        # Whether more parts follow is read from each zmq.Frame's ``more``: pyzmq's
        # getsockopt(RCVMORE) costs ~2 µs (it builds an enum per call), more than a whole
        # message's receive. A ROUTER's identity part is always followed by the peer's first
        # part, so it needs no check. The header is copied into bytes (cheaper than a view for
        # msgspec; for an inline image, decoding from a view measured no faster). Data frames
        # (arrays >= 64 KiB) stay zero-copy.
        raw = self.raw
        frames: list[Any] = [raw.recv()] if self._router else []
        part = raw.recv(copy=False)
        if self._curve_server is not None and not self._curve_server.admits(part):
            while part.more:  # (the rest of the message goes too)
                part = raw.recv(copy=False)
            self._curve_server.refuse_message(", ".join(self.addresses))
            return None
        frames.append(part.bytes)
        while part.more:
            part = raw.recv(copy=False)
            frames.append(part)
        return frames

    def _decode(self, frames: list[Any]) -> Any | None:
        try:
            return self._codec.decode(frames)
        except CodecError as err:
            if self._on_bad_frame is None:
                raise
            self._on_bad_frame(err)
            return None


def _ms(timeout_s: float) -> int:
    """zmq poll timeout in whole ms, rounded up: a wait of 0.4 ms must sleep, not spin."""
    return max(0, math.ceil(timeout_s * 1000))


class RouterSocket(MessageSocket):
    """Server side of request-reply: receives ``(peer_identity, message)`` from many DEALERs."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(zmq.ROUTER, **kwargs)

    def recv_from(self, timeout_s: float | None = None) -> tuple[bytes, Any] | None:
        """The next ``(identity, message)``, or None on timeout or bad frames."""
        frames = self._recv_frames(timeout_s)
        if frames is None:
            return None
        if len(frames) < 2:
            self._decode([])  # reports the malformed message through on_bad_frame
            return None
        msg = self._decode(frames[1:])
        return None if msg is None else (frames[0], msg)

    def send_to(self, identity: bytes, msg: Any) -> bool:
        """Reply to the peer ``identity``."""
        return self.send(msg, prefix=[identity])


def push(**kwargs: Any) -> MessageSocket:
    """A PUSH socket (sender side of a queue)."""
    return MessageSocket(zmq.PUSH, **kwargs)


def pull(**kwargs: Any) -> MessageSocket:
    """A PULL socket (receiver side of a queue)."""
    return MessageSocket(zmq.PULL, **kwargs)


def dealer(**kwargs: Any) -> MessageSocket:
    """A DEALER socket (client side of request-reply; round-robins over connected servers)."""
    return MessageSocket(zmq.DEALER, **kwargs)
