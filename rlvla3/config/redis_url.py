"""A configured ``run.redis_url`` without its password: what files, Redis and logs may show.

A URL such as ``redis://:PASSWORD@host:6379/0`` keeps its password only in memory and in the
run dir's ``redis_password`` (mode 0600); ``config.yaml``, ``run.json``, the config copy in
Redis and every log line show ``redis://:***@host:6379/0``.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit, urlunsplit

REDACTED = "***"
"""What stands for a password in a URL that is shown or stored."""


def password_of(url: str) -> str | None:
    """The password in ``url``'s user part (None: it has none)."""
    password = urlsplit(url).password
    return None if password is None else unquote(password)


def redacted(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{host}"))


def without_password(url: str) -> str:
    """``url`` with no password at all (its user name kept), for a client given the password
    separately."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}@" if parts.username else ""
    return urlunsplit(parts._replace(netloc=user + parts.netloc.rpartition("@")[2]))
