"""Authenticated weight versions: who may install weights, and which versions a receiver takes.

Every version the trainer publishes carries a tag: HMAC-SHA256, under the run's weights key,
of the version number and a SHA-256 digest of the flat float32 buffer (``weights_tag``). The
broadcaster checks it before it accepts an update and forwards it with the version over each
weight link; the rollout server checks it on the buffer it received before swapping that copy
in; a restarted trainer checks it before it takes the broadcaster's copy. Only a holder of the
key can make a tag, so a peer that reaches a weight link or the broadcaster's socket without
the run's secret cannot install weights.

The weights key is derived from the run secret like the CURVE keys (``transport/security.py``),
with its own label, so neither reveals the other. A one-host run has no secret and no CURVE:
its peers are the host's own processes, trusted on every socket, so its key is empty (b"").
The tag is then still checked (a corrupted buffer, a version mixed up with another's weights),
but it authenticates nothing, exactly as on its unencrypted sockets.

``VersionGate`` is the receiver's whole check: the tag, a version that moves forward and that
a trainer produced (``weights.trained`` in Redis), and finite values.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from typing import Any

import numpy as np

from transport.derived_keys import derive

TAG_BYTES = 32
NO_TAG = bytes(TAG_BYTES)
"""The tag of an unsigned version (no key can make it: refused everywhere)."""
_LABEL = b"rlvla3 weights"
_VERSION_BYTES = 8  # the version travels as an int64 in the link's header


def weights_key(secret: str | None) -> bytes:
    """The run's weights key: HMAC-SHA256 of the secret under its own label; b"" for a
    one-host run (no secret, see the module doc)."""
    if secret is None:
        return b""
    return derive(secret, _LABEL)


def new_link_id(role: str, index: int) -> str:
    """A fresh, unguessable weight-link id: the role and index (for the logs) and 128 random
    bits. Whoever knows a link's id can take the broadcaster's place in it at the store (and
    offer weights, which the tag then refuses)."""
    return f"{role}-{index}-{secrets.token_hex(16)}"


def host_array(flat: Any) -> np.ndarray:
    """A flat float32 buffer as a numpy array: itself, a view of a CPU tensor, or a host copy
    of a CUDA one (the digest needs the bytes in host memory, so the check makes that copy
    once)."""
    if isinstance(flat, np.ndarray):
        return flat
    return flat.detach().cpu().numpy()


def tensor_digest(flat: Any) -> bytes:
    """SHA-256 of the buffer's raw bytes: at about 1.3 GiB/s on the CI machine (SHA
    instructions) twice BLAKE2b's speed there. hashlib releases the GIL while it hashes, so a
    rollout server's receive thread does not stall its serving loop."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(host_array(flat))).cast("B")).digest()


def weights_tag(key: bytes, version: int, flat: Any) -> bytes:
    """The tag of ``flat`` as ``version``: HMAC-SHA256(key, label | version | digest).

    Raises:
        OverflowError: ``version`` does not fit the link's int64 header.
    """
    message = _LABEL + version.to_bytes(_VERSION_BYTES, "big", signed=True) + tensor_digest(flat)
    return hmac.new(key, message, hashlib.sha256).digest()


def tag_matches(key: bytes, version: int, flat: Any, tag: bytes) -> bool:
    """Whether ``tag`` is ``flat``'s tag as ``version`` under ``key`` (compared in constant
    time)."""
    if len(tag) != TAG_BYTES:
        return False
    try:
        return hmac.compare_digest(tag, weights_tag(key, version, flat))
    except OverflowError:
        return False


def all_finite(flat: Any) -> bool:
    """Whether no value of a float32 buffer is NaN or inf: its sum in float64 is finite exactly
    then (float32 values cannot overflow a float64 sum), at one pass and no N-sized mask."""
    return math.isfinite(float(np.add.reduce(host_array(flat), dtype=np.float64)))


class VersionGate:
    """A receiver's check of each weight version offered to it.

    Args:
        key: the run's weights key (``weights_key``).
        resends: take a version equal to the newest accepted when its tag is the same (the
            same weights sent again: a rollout server relinked to the broadcaster, which sends
            it the version it holds). Without it an equal version is refused.
        newest: the newest version the receiver holds already (-1: none).

    ``newest`` is the newest version accepted.
    """

    def __init__(self, key: bytes, resends: bool = False, newest: int = -1) -> None:
        self.key = key
        self.resends = resends
        self.newest = newest
        self._newest_tag = NO_TAG

    def problem(self, version: int, flat: Any, tag: bytes, trained: int) -> str | None:
        """Why ``flat`` must not be installed as ``version`` (None: it may; then call
        ``accept``). ``trained`` is the newest version a trainer recorded (``weights.trained``):
        a trainer records each version before it sends it, so none above it is genuine."""
        resent = self.resends and version == self.newest and tag == self._newest_tag
        if version <= self.newest and not resent:
            return f"not newer than v{self.newest}"
        if version > trained:
            return f"no trainer produced it (the newest trained version is v{trained})"
        flat = host_array(flat)  # (one host copy of a CUDA buffer, for both checks)
        if not tag_matches(self.key, version, flat, tag):
            return "its HMAC does not match (not signed with the run's weights key)"
        if not all_finite(flat):
            return "non-finite values (NaN or inf)"
        return None

    def accept(self, version: int, tag: bytes) -> None:
        """Record ``version`` (checked by ``problem``) as the newest accepted."""
        self.newest, self._newest_tag = version, tag
