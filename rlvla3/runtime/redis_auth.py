"""How a client authenticates to Redis: a plain password, or a multi-host run's credentials.

A multi-host run's private Redis (``rlvla3/launch/redis_server.py``) has its default user
disabled and the run user, ``RUN_USER``, whose password is derived from the run secret under
its own label (never the secret itself) and whose ACL allows only the commands rlvla3 sends
(``RUN_USER_COMMANDS``): no CONFIG, MODULE, REPLICAOF, DEBUG, SHUTDOWN, ACL, MIGRATE,
FLUSHALL, KEYS, EVAL, so a holder of the password cannot write files as the run's user or take
the server over. Across hosts it speaks only TLS, and the client trusts only the run's
certificate (``redis_tls.py``), so the password never travels in cleartext and never reaches a
server that does not hold the secret.

Env workers, the roles closest to untrusted code (simulators), log in as ``ENV_USER`` with a
password of their own: the same commands, every key readable, but writable only under
``keys.PREFIX``, not the guarded keys (``keys.GUARDED_PREFIX``: the trainers' side of the chunk
ledger, the chunks handed back, the weight versions, the learning curve, what launchers write
of the run). A compromised env worker can so not move a producer's settled mark. Key
permissions need Redis 7 (``%R~``); with an older redis-server the env user may write every
key, as the run user, and the launcher says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlvla3.runtime import keys
from rlvla3.runtime.redis_tls import redis_tls_identity
from transport.derived_keys import derive

RUN_USER = "rlvla3"
"""The Redis user of a multi-host run's launchers and roles but its env workers."""
ENV_USER = "rlvla3-env"
"""The Redis user of a multi-host run's env workers (the module doc)."""
_PASSWORD_LABEL = b"rlvla3 redis password"
_ENV_PASSWORD_LABEL = b"rlvla3 redis env password"

RUN_USER_COMMANDS = (
    # connection set-up (redis-py sends HELLO; CLIENT SETINFO it tolerates being refused)
    "ping", "hello", "select",
    # what rlvla3/runtime/registry.py sends, and MULTI/EXEC/WATCH for its transactions
    "get", "set", "del", "exists", "scan",
    "hget", "hgetall", "hset", "hsetnx", "hincrby",
    "sadd", "smembers", "rpush", "lrange", "ltrim",
    "multi", "exec", "discard", "watch", "unwatch",
    # what rlvla3/runtime/eval_queue.py sends besides (a protocol evaluation's episode list)
    "llen", "lmove", "lrem", "lpush", "srem",
)  # fmt: skip
"""Every command the run user may send; ``tests/test_redis_auth.py`` runs a real run with
nothing else allowed."""


@dataclass(frozen=True, slots=True)
class RedisAuth:
    """What a client presents to a Redis server."""

    password: str
    """AUTH's password."""
    username: str | None = None
    """AUTH's user (None: the default user)."""
    tls_ca_pem: str | None = None
    """The one certificate a TLS (``rediss://``) connection trusts (None: the system's CAs)."""

    def client_options(self, url: str) -> dict[str, Any]:
        """The ``redis.Redis`` options that present these credentials on ``url``."""
        options: dict[str, Any] = {"password": self.password}
        if self.username is not None:
            options["username"] = self.username
        if url.startswith("rediss:") and self.tls_ca_pem is not None:
            # the pinned certificate is the whole trust: it names no host (the head is found
            # by address), so the name check has nothing to add
            options.update(
                ssl_ca_data=self.tls_ca_pem, ssl_cert_reqs="required", ssl_check_hostname=False
            )
        return options


def as_auth(value: RedisAuth | str | None) -> RedisAuth | None:
    """A plain password as ``RedisAuth`` (the default user's); ``RedisAuth`` and None as given."""
    return RedisAuth(value) if isinstance(value, str) else value


def run_password(secret: str) -> str:
    """The run user's password: derived from the secret, revealing neither it nor other keys."""
    return derive(secret, _PASSWORD_LABEL).hex()


def env_password(secret: str) -> str:
    """The env user's password (``ENV_USER``), derived like the run user's under its own
    label: neither reveals the other."""
    return derive(secret, _ENV_PASSWORD_LABEL).hex()


def run_redis_auth(secret: str) -> RedisAuth:
    """The credentials of a multi-host run's private Redis: the run user, its password, and
    the run's certificate pinned for TLS."""
    return RedisAuth(run_password(secret), RUN_USER, redis_tls_identity(secret).cert_pem)


def acl_lines(
    password: str, env_password: str | None = None, *, key_permissions: bool = True
) -> list[str]:
    """``redis.conf`` lines: the default user off, the run user allowed ``RUN_USER_COMMANDS``
    on every key and nothing else, and (``env_password``) the env user allowed the same
    commands, writing only under ``keys.PREFIX`` and reading every key; without
    ``key_permissions`` (a redis-server before 7) writing every key."""
    allowed = " ".join(f"+{command}" for command in RUN_USER_COMMANDS)
    lines = ["user default off", f"user {RUN_USER} on >{password} ~* -@all {allowed}"]
    if env_password is not None:
        scope = f"~{keys.PREFIX}:* %R~{keys.GUARDED_PREFIX}:*" if key_permissions else "~*"
        lines.append(f"user {ENV_USER} on >{env_password} {scope} -@all {allowed}")
    return lines
