"""The keys a role process of a multi-host run is handed: only those its role needs.

The launcher holds the run secret; a role never does. For each role it starts, the launcher
derives the keys the role table names for it (``RoleSpec.keys``, ``rlvla3/config/role_table.py``)
and hands them over as a small JSON bundle through a pipe (``--secret-fd``,
``run_secret.hand_over``). An env worker so holds the env user's Redis credentials
(``rlvla3/runtime/redis_auth.py``), the CURVE client key pair and its own chunk-tag key
(``transport/chunk_auth.py``, derived for its index), and neither the run user's password,
the weights key, the CURVE server secret key, another worker's chunk-tag key nor anything
from which to derive them: a compromised simulator process cannot sign weights, pose as a
server, send chunks under another worker's name or write the trainers' side of the chunk
ledger.

A role asked to do something it holds no key for fails with ``MissingKeyError`` naming the
key. A role started by hand with ``RLVLA3_RUN_SECRET`` derives its bundle the same way and
drops the secret from its environment at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rlvla3.config.role_table import ROLE_TABLE, RunKey, role_spec
from rlvla3.runtime import run_secret
from rlvla3.runtime.redis_auth import ENV_USER, RUN_USER, RedisAuth, env_password, run_password
from rlvla3.runtime.redis_tls import redis_tls_identity
from transport.chunk_auth import chunk_check_key, producer_key
from transport.derived_keys import MissingKeyError
from transport.security import RunKeys, run_keys
from transport.weight_auth import weights_key

_TEXT_FIELDS = ("redis_password", "redis_user", "redis_cert_pem")
_HEX_FIELDS = ("weights", "chunk_check", "chunk_sign")
_Z85_FIELDS = ("server_public", "server_secret", "client_public", "client_secret")
_Z85_KEY_CHARS = 40  # a 32-byte Curve25519 key in Z85


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleKeys:
    """What one role process holds of a multi-host run's keys (None: not handed to it)."""

    role: str
    """The role the bundle was made for (named in a missing key's error)."""
    redis_password: str | None
    """The Redis password: the run user's (``RunKey.REDIS``) or the env user's
    (``RunKey.REDIS_ENV``)."""
    redis_user: str | None
    """Whose password it is: ``RUN_USER`` or ``ENV_USER`` (None without a password)."""
    redis_cert_pem: str | None
    """The run Redis's certificate, pinned for TLS (public; with either Redis password)."""
    curve: RunKeys
    """The CURVE keys: both public keys, and the secret keys of the sides its role uses."""
    weights: bytes | None
    """The weights key (``RunKey.WEIGHTS``)."""
    chunk_check: bytes | None = None
    """The chunk check key (``RunKey.CHUNK_CHECK``): a trainer's."""
    chunk_sign: bytes | None = None
    """This env worker's own chunk-tag key (``RunKey.CHUNK_SIGN``)."""

    def redis_auth(self) -> RedisAuth:
        """The role's credentials on the run's Redis: the run user's, or the env user's."""
        if self.redis_password is None:
            spec = ROLE_TABLE.get(self.role)
            env = spec is not None and RunKey.REDIS_ENV in spec.keys
            raise missing_key(self.role, RunKey.REDIS_ENV if env else RunKey.REDIS)
        return RedisAuth(self.redis_password, self.redis_user, self.redis_cert_pem)

    def names(self) -> frozenset[RunKey]:
        """The keys this bundle holds."""
        held = {
            RunKey.REDIS: self.redis_password is not None and self.redis_user == RUN_USER,
            RunKey.REDIS_ENV: self.redis_password is not None and self.redis_user == ENV_USER,
            RunKey.CURVE_CLIENT: self.curve.client_secret is not None,
            RunKey.CURVE_SERVER: self.curve.server_secret is not None,
            RunKey.WEIGHTS: self.weights is not None,
            RunKey.CHUNK_CHECK: self.chunk_check is not None,
            RunKey.CHUNK_SIGN: self.chunk_sign is not None,
        }
        return frozenset(name for name, present in held.items() if present)

    def to_text(self) -> str:
        """The bundle as JSON, for the pipe."""
        fields: dict[str, Any] = {"role": self.role}
        fields.update({name: _hex(getattr(self, name)) for name in _HEX_FIELDS})
        fields.update({name: getattr(self, name) for name in _TEXT_FIELDS})
        for name in _Z85_FIELDS:
            value = getattr(self.curve, name)
            fields[name] = None if value is None else value.decode()
        return json.dumps(fields)


def keys_for(role: str, secret: str, *, index: int) -> RoleKeys:
    """The bundle of process ``index`` of ``role``: the keys its row of the role table names,
    derived from ``secret`` (the launcher's); an env worker's chunk-tag key is its index's."""
    wanted = role_spec(role).keys
    curve = run_keys(secret).only(
        server=RunKey.CURVE_SERVER in wanted, client=RunKey.CURVE_CLIENT in wanted
    )
    env_user = RunKey.REDIS_ENV in wanted
    redis = RunKey.REDIS in wanted or env_user
    password = env_password(secret) if env_user else run_password(secret)
    return RoleKeys(
        role=role,
        redis_password=password if redis else None,
        redis_user=(ENV_USER if env_user else RUN_USER) if redis else None,
        redis_cert_pem=redis_tls_identity(secret).cert_pem if redis else None,
        curve=curve,
        weights=weights_key(secret) if RunKey.WEIGHTS in wanted else None,
        chunk_check=chunk_check_key(secret) if RunKey.CHUNK_CHECK in wanted else None,
        chunk_sign=(
            producer_key(chunk_check_key(secret), index) if RunKey.CHUNK_SIGN in wanted else None
        ),
    )


def from_text(text: str, where: str) -> RoleKeys:
    """A bundle ``to_text`` wrote.

    Raises:
        run_secret.SecretError: ``text`` is no bundle (names ``where`` and what is wrong).
    """
    try:
        fields = json.loads(text)
        curve = {name: _z85(fields[name], required=name.endswith("public")) for name in _Z85_FIELDS}
        return RoleKeys(
            role=str(fields["role"]),
            redis_password=_text(fields["redis_password"]),
            redis_user=_text(fields["redis_user"]),
            redis_cert_pem=_text(fields["redis_cert_pem"]),
            curve=RunKeys(**curve),
            **{name: _unhex(fields[name]) for name in _HEX_FIELDS},
        )
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise run_secret.SecretError(
            f"{where}: not a key bundle of this rlvla3 ({err!r})"
        ) from None


def take(fd: int | None, role: str, index: int) -> RoleKeys | None:
    """A role's keys: the bundle in the pipe ``fd`` (its launcher's), read and closed; without
    one, derived from ``RLVLA3_RUN_SECRET`` (a role started by hand), which then leaves
    ``os.environ`` and is not kept; None in a one-host run (neither)."""
    if fd is not None:
        return from_text(run_secret.read_pipe(fd), f"--secret-fd {fd}")
    secret = run_secret.pop_env()
    return None if secret is None else keys_for(role, secret, index=index)


def missing_key(role: str, key: RunKey) -> MissingKeyError:
    """The error of ``role`` asked to use ``key``, which its launcher did not hand it."""
    return MissingKeyError(
        f"{role} holds no {key.value} key: its launcher hands each role only the keys its row "
        "of the role table names (rlvla3/config/role_table.py)"
    )


def _hex(value: bytes | None) -> str | None:
    return None if value is None else value.hex()


def _unhex(value: object) -> bytes | None:
    """A key in hex, or None; an empty one is no key (b"" would read as a one-host run's)."""
    if value is None:
        return None
    key = bytes.fromhex(_text(value) or "")
    if not key:
        raise ValueError("an empty key")
    return key


def _text(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"expected a string, got {type(value).__name__}")


def _z85(value: object, *, required: bool) -> bytes | None:
    """A Z85 key of the bundle (40 characters); None only where it may be absent."""
    text = _text(value)
    if text is None and not required:
        return None
    if text is None or len(text) != _Z85_KEY_CHARS:
        raise ValueError(f"a CURVE key of {_Z85_KEY_CHARS} characters expected")
    return text.encode()
