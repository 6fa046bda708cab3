"""Trainer side of the weight sync: each new version of the model, flattened, pushed over ZeroMQ
to the weight broadcaster, which sends it on to the rollout servers (``transport/weights.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch import nn

from transport import sockets
from transport.messages import WeightsUpdate
from transport.weight_auth import weights_tag
from transport.weights import FlatLayout

_SEND_TIMEOUT_S = 1.0  # how long a publish waits for room in the broadcaster's queue
_LOOKUP_EVERY_S = 2.0  # how often, after a send that went through, to look for a moved broadcaster
_RETRY_S = 0.5  # how soon a version whose send found no room is tried again


class WeightPublisher:
    """Trainer side: flattens the model and pushes it to the broadcaster as the next version.

    Args:
        module: the model whose weights are published.
        broadcaster: the broadcaster's ``updates`` address, or a function returning the current
            one (None: none live); with a function the publisher follows a restarted broadcaster
            to its new address.
        version: the version published last (the next publish sends ``version + 1``).
        announce: called with each version before it is sent (the trainer records it in Redis).
        key: the run's weights key (``transport.weight_auth.weights_key``): each version is
            signed with it, and receivers take no version without its signature.

    Publishing never blocks training for long: if the broadcaster takes nothing for
    ``_SEND_TIMEOUT_S`` (busy, dead, or gone to a new address), that version is not sent
    (``last_sent`` is False), and the trainer's calls of ``resend_if_due`` between updates send
    it again once there is room or the broadcaster has moved. While sends fail, each publish
    first looks for a moved broadcaster and does not wait for room, so a restarted broadcaster
    gets the newest version at the next publish, and training does not slow down meanwhile.
    """

    def __init__(
        self,
        module: nn.Module,
        broadcaster: str | Callable[[], str | None],
        version: int = -1,
        announce: Callable[[int], None] | None = None,
        key: bytes = b"",
    ) -> None:
        self.layout = FlatLayout.of(module)
        self.key = key
        self.version = version
        self.announce = announce
        self.last_sent = True
        self._last: WeightsUpdate | None = None  # the last one published, for resending
        self._lookup = broadcaster if callable(broadcaster) else None
        self._next_check = time.monotonic() + _LOOKUP_EVERY_S
        self.address = broadcaster if isinstance(broadcaster, str) else broadcaster()
        if self.address is None:
            raise ConnectionError("no live weight broadcaster")
        self.socket = sockets.push(hwm=4)
        self.socket.connect(self.address)

    def publish(self, module: nn.Module) -> int:
        """Send the module's current weights as a new version; returns that version."""
        self.version += 1
        if self.announce is not None:
            self.announce(self.version)
        flat = self.layout.flatten(module).detach().cpu().numpy()
        tag = weights_tag(self.key, self.version, flat)
        self._last = WeightsUpdate(
            version=self.version, layout=self.layout.digest, flat=flat, tag=tag
        )
        # After a failed send the broadcaster is down or has moved: follow it now (a trainer
        # that trains back to back would otherwise never be between publishes long enough for
        # ``resend_if_due``), and do not wait for room while it is away.
        timeout_s = _SEND_TIMEOUT_S
        if not self.last_sent:
            self._reconnect_if_moved()
            timeout_s = 0.0
        self.last_sent = self.socket.send(self._last, timeout_s=timeout_s)
        if not self.last_sent:
            self._next_check = time.monotonic() + _RETRY_S
        return self.version

    def resend_if_due(self) -> bool:
        """Call between publishes; never blocks. Sends the last version again (same number, same
        weights) when its send found no room, or when the broadcaster moved (restarted: it holds
        no weights). Checked at most every ``_RETRY_S`` after a failed send, else every
        ``_LOOKUP_EVERY_S``. Returns True when it sent.

        Without it the servers could wait for weights that never come: they keep acting with old
        weights, their chunks grow too stale to train on, and no training means no publish."""
        now = time.monotonic()
        if self._last is None or now < self._next_check:
            return False
        self._next_check = now + (_LOOKUP_EVERY_S if self.last_sent else _RETRY_S)
        moved = self._reconnect_if_moved()
        if not moved and self.last_sent:
            return False
        self.last_sent = self.socket.send(self._last, timeout_s=0)
        return self.last_sent

    def _reconnect_if_moved(self) -> bool:
        address = self._lookup() if self._lookup is not None else None
        if address is None or address == self.address:
            return False
        # a new socket: the old one's queue holds versions for a broadcaster that is gone
        self.socket.close()
        self.socket = sockets.push(hwm=4)
        self.socket.connect(address)
        self.address = address
        return True

    def close(self) -> None:
        """Close the socket."""
        self.socket.close()
