"""Watching a training group's peers (``GroupWatch``): a rank that died or restarted brings
the whole group down, so that the launchers restart it together (one rank cannot rejoin a
group that is mid-update). ``rlvla3/runtime/train_group.py`` forms the group."""

from __future__ import annotations

import time

from rlvla3.runtime.role import Role
from rlvla3.runtime.train_group import GroupError, TrainGroup

_WATCH_PERIOD_S = 1.0


class GroupWatch:
    """Notices a rank of the group that died or restarted (its heartbeat gone, or another
    process in its place), so that every rank leaves and the launchers restart the whole group:
    one rank cannot rejoin a group that is mid-update.

    Args:
        role: this rank.
        group: its group.
    """

    def __init__(self, role: Role, group: TrainGroup) -> None:
        self.role, self.group = role, group
        self.pids = self._peer_pids()
        self._next_check = time.monotonic() + _WATCH_PERIOD_S
        self._unseen_since: dict[int, float] = {}
        """Peers without a heartbeat, since when (monotonic) this rank has seen them so."""
        self._grace_s = role.cfg.run.heartbeat_ttl_s
        """How long a peer may go unseen: after a Redis outage longer than a heartbeat's TTL
        every heartbeat has expired, and the peers beat again within a second of the link's
        return (a peer that restarted shows another pid at once)."""

    def _peer_pids(self) -> dict[int, int | None]:
        found = {r.index: r for r in self.role.registry.roles() if r.role == self.role.name}
        return {
            i: found[i].pid if i in found and found[i].alive else None
            for i in range(self.group.world_size)
            if i != self.group.rank
        }

    def check(self) -> None:
        """Raise ``GroupError`` if a peer left since the group formed (checked once a second)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + _WATCH_PERIOD_S
        for index, pid in self._peer_pids().items():
            if pid is None:
                since = self._unseen_since.setdefault(index, now)
                if now - since < self._grace_s:
                    continue
            else:
                self._unseen_since.pop(index, None)
            if pid is None or pid != self.pids[index]:
                raise GroupError(
                    f"{self.role.name}/{index} left the group (died or restarted): "
                    "the whole group restarts"
                )
