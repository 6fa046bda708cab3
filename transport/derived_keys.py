"""Keys derived from the run secret, one per use, none revealing another or the secret.

Each key is HMAC-SHA256(secret, label) under its own label (HKDF's expand step with one
block): the Redis password, the Redis TLS key, the CURVE server and client key pairs and the
weights key. Knowing one of them (a role that holds only the Redis password, a sniffed
handshake) gives no way back to the secret, and so none to the others.
"""

from __future__ import annotations

import hashlib
import hmac


def derive(secret: str, label: bytes) -> bytes:
    """The 32-byte key of ``label`` under the run secret (HMAC-SHA256)."""
    return hmac.new(secret.encode(), label, hashlib.sha256).digest()


class MissingKeyError(RuntimeError):
    """A process asked to do something it holds no key for: its launcher handed it only the
    keys its role needs (the role table's ``keys``, ``rlvla3/config/role_table.py``)."""
