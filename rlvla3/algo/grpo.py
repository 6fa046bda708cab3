"""GRPO: group-relative advantages, no critic.

Env workers start ``algo.group_size`` envs from the same state (the same reset seed) and tag
each chunk with its episode's group (``TrajectoryChunk.group``). The trainer holds chunks in a
``GroupAssembler`` until every episode of their group has ended; then each episode's advantage
is its return relative to its group's::

    A_i = (R_i - mean(R)) / (std(R) + eps)        R_i: episode i's undiscounted return

and every step of episode i is trained with ``A_i`` (outcome supervision). Under the
asynchronous mode the staleness bound applies per sample when the group is trained: steps more
than ``algo.max_staleness`` versions behind are dropped (their episode's return still counts in
the group's baseline), and the truncated importance weights correct the rest. A group of which
no step is still fresh enough (e.g. its producer died before finishing it) is dropped whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from transport.messages import TrajectoryChunk


def group_advantages(returns: Sequence[float], eps: float = 1e-6) -> np.ndarray:
    """float32 advantages of a group's episodes: returns centred on the group mean and scaled by
    the group's (population) standard deviation; all zero when every return is the same."""
    r = np.asarray(returns, dtype=np.float64)
    return ((r - r.mean()) / (r.std() + eps)).astype(np.float32)


def ends_episode(chunk: TrajectoryChunk) -> bool:
    """Whether the chunk's last step ended its episode (chunks are cut at episode ends)."""
    return bool(chunk.terminated[-1] or chunk.truncated[-1])


@dataclass
class _Group:
    episodes: dict[str, list[TrajectoryChunk]] = field(default_factory=dict)  # by producer
    ended: set[str] = field(default_factory=set)
    newest_version: int = -1

    def chunks(self) -> list[TrajectoryChunk]:
        return [c for episode in self.episodes.values() for c in episode]


@dataclass(frozen=True)
class TrainableGroup:
    """A complete group: each episode's chunks, in order, with the episode's advantage."""

    episodes: list[tuple[list[TrajectoryChunk], float]]

    def chunks(self) -> list[TrajectoryChunk]:
        return [c for chunks, _ in self.episodes for c in chunks]


class GroupAssembler:
    """Holds chunks until their group's ``group_size`` episodes have all ended.

    Args:
        group_size: episodes per group.
    """

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._groups: dict[str, _Group] = {}
        self.held = 0  # chunks held, for the chunk accounting

    def add(self, chunk: TrajectoryChunk) -> TrainableGroup | None:
        """Hold ``chunk``; return its group once complete (and hold it no longer).

        Raises:
            ValueError: the chunk has no group, or its group already has ``group_size`` other
                episodes (a producer that does not follow the grouping).
        """
        if not chunk.group:
            raise ValueError("group: empty (algo.kind grpo needs every chunk's episode group)")
        group = self._groups.setdefault(chunk.group, _Group())
        if chunk.producer not in group.episodes and len(group.episodes) >= self.group_size:
            raise ValueError(
                f"group {chunk.group!r}: a {self.group_size + 1}th episode "
                f"(from {chunk.producer}), but algo.group_size is {self.group_size}"
            )
        group.episodes.setdefault(chunk.producer, []).append(chunk)
        group.newest_version = max(group.newest_version, int(chunk.policy_versions.max()))
        self.held += 1
        if ends_episode(chunk):
            group.ended.add(chunk.producer)
        if len(group.ended) < self.group_size:
            return None
        del self._groups[chunk.group]
        self.held -= sum(len(e) for e in group.episodes.values())
        producers = list(group.episodes)
        returns = [sum(float(c.rewards.sum()) for c in group.episodes[p]) for p in producers]
        advantages = group_advantages(returns)
        return TrainableGroup(
            [(group.episodes[p], float(a)) for p, a in zip(producers, advantages, strict=True)]
        )

    def evict_stale(self, version: int, max_staleness: int) -> list[TrajectoryChunk]:
        """Drop and return the chunks of incomplete groups none of whose steps is within
        ``max_staleness`` of ``version`` (nothing of them could be trained any more)."""
        stale = [k for k, g in self._groups.items() if version - g.newest_version > max_staleness]
        dropped = [c for k in stale for c in self._groups.pop(k).chunks()]
        self.held -= len(dropped)
        return dropped
