"""Which addresses a socket of a run may bind: never a wildcard, and beyond loopback only with
CURVE (``transport/security.py``), so nothing a run binds is reachable from another host
without the run's keys."""

from __future__ import annotations

import ipaddress

_WILDCARDS = frozenset({"*", "", "0", "0.0.0.0", "::", "[::]"})


class BindRefused(RuntimeError):
    """A socket was asked to bind a wildcard, or a non-loopback address without CURVE."""


def is_wildcard(host: str) -> bool:
    """True for an address that means every interface (``0.0.0.0``, ``::``, ZeroMQ's ``*``)."""
    text = host.strip()
    if text in _WILDCARDS:
        return True
    try:
        return ipaddress.ip_address(text.strip("[]")).is_unspecified
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ``::1`` and ``localhost`` (a name other hosts cannot reach)."""
    text = host.strip().strip("[]")
    if text == "localhost":
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def check_bind(host: str, curve: bool) -> None:
    """Refuse to bind ``host`` over TCP when it is a wildcard, or reachable from other hosts
    while ``curve`` is off.

    Raises:
        BindRefused: says which and what to do.
    """
    if is_wildcard(host):
        raise BindRefused(
            f"refusing to bind {host!r}: a wildcard address listens on every interface; "
            "bind the node's own address"
        )
    if not curve and not is_loopback(host):
        raise BindRefused(
            f"refusing to bind {host} without CURVE: an address beyond loopback needs the "
            "run's secret (the launcher hands it over to every role it starts there)"
        )
