"""CURVE on every ZeroMQ socket of a multi-host run: only peers holding the run's secret talk.

Keys come from the run secret (``run_keys``): one server key pair that every bound socket uses,
and one client key pair that every connecting socket uses. The server's public key is not
secret (a peer still needs the client key, which only the secret gives); the client key pair
is. A ZAP handler in each process admits a connecting peer only when it presents the run's
client public key, so a peer without the secret is refused before it can send a message; a
watch on every bound socket counts each refused handshake (``on_refused``), whatever its kind
(wrong key, a plain unencrypted peer, garbage from a port scan).

Admission fails closed. libzmq admits any client key when no ZAP handler answers (its thread
died, or it was closed), so the handler also gives each admitted peer the identity
``PEER_USER_ID``, which libzmq attaches to every message of that connection (``User-Id``), and
every bound socket drops (and counts) a message without it (``admits``). The alternative, the
role exiting when its handler dies, leaves a window in which a peer admitted without a key
stays connected until the exit; the check per message has none, and costs ~1 µs a message on
CURVE sockets only.

``enable(keys)`` switches it on for the whole process; ``transport.sockets`` then applies it
to every socket it binds or connects. A role holds only the secret keys its role needs
(``RunKeys.only``): an env worker, which binds nothing, has no server secret key, and a socket
it tried to bind would fail with ``MissingKeyError`` naming that key. One-host runs leave it
off: loopback traffic needs no keys and keeps its speed (``bench/codec_sockets.py`` measures
what CURVE costs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from transport.derived_keys import MissingKeyError, derive

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_DOMAIN = b"rlvla3"
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_WATCHED = _FAILED | zmq.EVENT_MONITOR_STOPPED
_POLL_MS = 200
PEER_USER_ID = "rlvla3 peer"
"""The identity the ZAP handler gives a peer it admits (``User-Id`` of its messages)."""

RefusedHandler = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class RunKeys:
    """The run's CURVE keys, Z85-encoded as libzmq takes them. The public keys are no secret
    (a peer still needs a secret key to complete a handshake); a secret key is None where
    this process was not handed it."""

    server_public: bytes
    """What every connecting socket checks the server against."""
    server_secret: bytes | None
    """What every bound socket proves itself with (None: this process binds nothing)."""
    client_public: bytes
    """What the ZAP handler admits."""
    client_secret: bytes | None
    """What every connecting socket proves itself with (None: this process connects to
    nothing)."""

    def only(self, *, server: bool, client: bool) -> RunKeys:
        """These keys less the secret keys of the sides not asked for."""
        return RunKeys(
            self.server_public,
            self.server_secret if server else None,
            self.client_public,
            self.client_secret if client else None,
        )


def run_keys(secret: str) -> RunKeys:
    """The key pairs every process of a run derives from its secret (HMAC-SHA256, so nothing
    about the secret can be read back from a public key)."""

    def key_pair(label: bytes) -> tuple[bytes, bytes]:
        raw = derive(secret, b"rlvla3 curve " + label)
        private = z85.encode(raw)  # any 32 bytes are a Curve25519 secret key
        return zmq.curve_public(private), private

    server_public, server_secret = key_pair(b"server")
    client_public, client_secret = key_pair(b"client")
    return RunKeys(server_public, server_secret, client_public, client_secret)


class CurveSecurity:
    """CURVE options for sockets and this process's ZAP handler and handshake watch.

    Args:
        keys: the run's CURVE keys (``RunKeys``), or the run secret to derive them all from.
        context: the ZeroMQ context whose sockets it guards.
        on_refused: called (from the watch thread) with a description of each refused peer.
    """

    def __init__(
        self,
        keys: RunKeys | str,
        context: zmq.Context,
        on_refused: RefusedHandler | None = None,
    ) -> None:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support; multi-host runs need it")
        self.keys = run_keys(keys) if isinstance(keys, str) else keys
        self.on_refused = on_refused
        self._client_raw = z85.decode(self.keys.client_public)
        self._context = context
        self._new_monitors: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._zap = context.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(_ZAP_ENDPOINT)  # before any socket binds: ZAP applies from then on
        self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self._thread.start()

    def server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (about to bind) a CURVE server that asks ZAP about every peer.

        Raises:
            MissingKeyError: this process holds no CURVE server secret key.
        """
        secret_key = _held(self.keys.server_secret, "server", "binds no socket")
        sock.curve_server = True
        sock.curve_secretkey = secret_key
        sock.curve_publickey = self.keys.server_public
        sock.zap_domain = _ZAP_DOMAIN
        monitor = sock.get_monitor_socket(_WATCHED)
        with self._lock:
            self._new_monitors.append(monitor)

    def client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (about to connect) a CURVE client holding the run's client key.

        Raises:
            MissingKeyError: this process holds no CURVE client secret key.
        """
        secret_key = _held(self.keys.client_secret, "client", "connects to no socket")
        sock.curve_serverkey = self.keys.server_public
        sock.curve_publickey = self.keys.client_public
        sock.curve_secretkey = secret_key

    def close(self) -> None:
        """Stop the handler thread (sockets bound afterwards would get no ZAP answers)."""
        self._stop.set()
        self._thread.join(timeout=2)

    # --- the handler thread --------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        monitors: list[zmq.Socket] = []
        try:
            while not self._stop.is_set():
                with self._lock:
                    added, self._new_monitors = self._new_monitors, []
                for monitor in added:
                    poller.register(monitor, zmq.POLLIN)
                    monitors.append(monitor)
                try:
                    ready = poller.poll(_POLL_MS)
                except zmq.ContextTerminated:
                    return  # the process is tearing ZeroMQ down: nothing left to guard
                for sock, _ in ready:
                    if sock is self._zap:
                        self._answer(sock.recv_multipart())
                    elif not self._watch(sock):
                        poller.unregister(sock)
                        monitors.remove(sock)
                        sock.close(linger=0)
        finally:
            for sock in [self._zap, *monitors]:
                sock.close(linger=0)

    def _answer(self, request: list[bytes]) -> None:
        """One ZAP request (RFC 27): admit the run's client key, refuse anything else."""
        version, request_id, _domain, _address, _identity, mechanism, *credentials = request
        admitted = mechanism == b"CURVE" and credentials[:1] == [self._client_raw]
        if admitted:
            reply = [b"200", b"OK", PEER_USER_ID.encode(), b""]
        else:
            reply = [b"400", b"not a peer of this run", b"", b""]
        self._zap.send_multipart([version, request_id, *reply])

    def admits(self, frame: zmq.Frame) -> bool:
        """Whether ``frame`` came over a connection this process's ZAP handler admitted."""
        try:
            return frame.get("User-Id") == PEER_USER_ID
        except zmq.ZMQError:  # (no User-Id: admitted by no handler)
            return False

    def refuse_message(self, where: str) -> None:
        """Report a message dropped for coming from a peer no handler admitted."""
        if self.on_refused is not None:
            self.on_refused(f"a message from a peer no ZAP handler admitted, on {where}")

    def _watch(self, monitor: zmq.Socket) -> bool:
        """Report a failed handshake; False once the watched socket has closed."""
        event = parse_monitor_message(monitor.recv_multipart())
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:
            return False
        if event["event"] & _FAILED and self.on_refused is not None:
            self.on_refused(
                f"{zmq.Event(event['event']).name.lower()} (code {event['value']}) "
                f"on {event['endpoint'].decode(errors='replace')}"
            )
        return True


def _held(key: bytes | None, side: str, why_not: str) -> bytes:
    """``key``, or the error of a process that was not handed it."""
    if key is None:
        raise MissingKeyError(
            f"no CURVE {side} secret key: this role {why_not} by the role table's keys "
            "(rlvla3/config/role_table.py), so its launcher did not hand it one"
        )
    return key


_active: CurveSecurity | None = None


def available() -> bool:
    """Whether this libzmq has CURVE (multi-host runs need it)."""
    return bool(zmq.has("curve"))


def enable(keys: RunKeys | str, on_refused: RefusedHandler | None = None) -> CurveSecurity:
    """Turn CURVE on for every socket this process binds or connects from now on, with
    ``keys`` (or every key of a run secret)."""
    global _active
    if _active is None:
        _active = CurveSecurity(keys, zmq.Context.instance(), on_refused)
    return _active


def active() -> CurveSecurity | None:
    """The process's CURVE settings, None when off (one-host runs)."""
    return _active
