"""The typed records ``Registry`` reads back from Redis: one role instance, one node's launcher.

Each record is built from the raw Redis hash of its key (strings only) and the moment it is
read, so ages and stall times are as of that read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleRecord:
    """One role instance as the registry knows it.

    Attributes:
        role: role name, e.g. ``env_worker``.
        index: instance index within the role.
        node: node name from the config; host: the address it advertises; pid: its process id.
        status: ``starting``, ``running``, ``stopping``, ``done`` or ``error``.
        endpoints: name → ZeroMQ address of every socket it bound.
        restarts: how often the launcher restarted it.
        heartbeat_age_s: seconds since its last heartbeat.
        alive: whether its heartbeat key has not expired.
        stats: the role's own gauges (rates, queue depths...).
        stalled_for_s: how long past its stall deadline the role is (0: not stalled); the
            deadline is its last finished step plus ``run.stall_timeout_s``, or the end of
            what it said it is busy with, whichever is later.
        busy: what the role says it is busy with ("" when nothing).
    """

    role: str
    index: int
    node: str
    host: str
    pid: int
    status: str
    endpoints: dict[str, str]
    restarts: int
    heartbeat_age_s: float
    alive: bool
    stats: dict[str, float]
    stalled_for_s: float = 0.0
    busy: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class LauncherRecord:
    """One node's launcher as the registry knows it.

    Attributes:
        node: the node it runs on.
        status: ``starting``, ``running``, ``stopping`` or ``done`` / ``error``.
        address: the address its node's roles bind and advertise.
        hostname: the host's name.
        pid: the launcher's process id on that host.
        heartbeat_age_s: seconds since its last heartbeat.
        alive: whether that heartbeat is within its TTL.
    """

    node: str
    status: str
    address: str
    hostname: str
    pid: int
    heartbeat_age_s: float
    alive: bool


def role_record(
    role: str, index: int, raw: dict[str, str], *, alive: bool, stats: dict[str, str], now: float
) -> RoleRecord:
    """The record of role instance ``role``/``index`` from its registry hash ``raw`` and its stats
    hash ``stats``; ``alive``: whether its heartbeat key still exists; ``now``: unix time."""
    endpoints = json.loads(raw.get("endpoints") or "{}")
    if not isinstance(endpoints, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in endpoints.items()
    ):
        raise ValueError(f"endpoints: not a map of names to addresses: {endpoints!r:.60}")
    return RoleRecord(
        role=role,
        index=index,
        node=raw.get("node", ""),
        host=raw.get("host", ""),
        pid=int(raw.get("pid", 0)),
        status=raw.get("status", "?"),
        endpoints=endpoints,
        restarts=int(raw.get("restarts", 0)),
        heartbeat_age_s=max(0.0, now - float(raw.get("heartbeat_at", now))),
        alive=alive,
        stats={k: float(v) for k, v in stats.items()},
        stalled_for_s=_stalled_for(float(raw.get("stall_at", 0) or 0), raw, now),
        busy=raw.get("busy", ""),
    )


def launcher_record(node: str, raw: dict[str, str], *, alive: bool, now: float) -> LauncherRecord:
    """The record of ``node``'s launcher from its registry hash ``raw``; ``alive``: whether its
    heartbeat key still exists; ``now``: unix time."""
    return LauncherRecord(
        node=node,
        status=raw.get("status", "?"),
        address=raw.get("address", ""),
        hostname=raw.get("hostname", ""),
        pid=int(raw.get("pid", 0)),
        heartbeat_age_s=max(0.0, now - float(raw.get("heartbeat_at", now))),
        alive=alive,
    )


def _stalled_for(stall_at: float, raw: dict[str, str], now: float) -> float:
    """Seconds past ``stall_at`` of a running role (0: not stalled, or not checked)."""
    if stall_at <= 0 or raw.get("status") != "running":
        return 0.0
    return max(0.0, now - stall_at)
