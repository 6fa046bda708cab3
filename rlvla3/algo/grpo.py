"""GRPO: group-relative advantages, no critic.

A group is ``algo.group_size`` episodes started from the same state (the same reset seed). Env
workers hand them out with ``GroupRounds``: each pool of ``group_size`` envs fills one group at
a time, and whichever env of the pool starts an episode takes the next place in the current
one, so the episodes of a group start within about one episode's time of each other even when
some envs finish episodes far sooner than others (a per-env episode count would let a fast env
run ahead of its slow mates' groups, and its chunks wait ever longer for them). Each chunk is
tagged with its episode's group (``TrajectoryChunk.group``). The trainer holds chunks in a
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

import threading
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


class GroupRounds:
    """The env side: which group, and which reset seed, each new episode of a worker's envs
    gets (thread-safe: a worker's runner threads share it).

    Args:
        group_size: episodes per group (``algo.group_size``).
        run_seed: ``run.seed``.
        worker_index: the env worker's index.
        incarnation: the worker process's unique start tag (a restarted worker's groups are
            new groups).
    """

    def __init__(self, group_size: int, run_seed: int, worker_index: int, incarnation: str):
        self.group_size = group_size
        self.run_seed, self.worker_index, self.incarnation = run_seed, worker_index, incarnation
        self._lock = threading.Lock()
        self._rounds: dict[int, tuple[int, int]] = {}  # pool -> (round, places taken)

    def start_episode(self, env_index: int) -> tuple[str, int]:
        """A new episode of env ``env_index``: its group's tag and reset seed (the next free
        place in the current round of the env's pool, ``env_index // group_size``)."""
        pool = env_index // self.group_size
        with self._lock:
            round_, taken = self._rounds.get(pool, (0, 0))
            if taken == self.group_size:
                round_, taken = round_ + 1, 0
            self._rounds[pool] = (round_, taken + 1)
        tag = f"{self.worker_index}/{pool}#{self.incarnation}:{round_}"
        key = [self.run_seed, self.worker_index, pool, round_]
        return tag, int(np.random.SeedSequence(key).generate_state(1)[0])


@dataclass
class _Group:
    episodes: list[list[TrajectoryChunk]] = field(default_factory=list)
    open: dict[str, int] = field(default_factory=dict)  # producer -> its unfinished episode
    ended: int = 0
    newest_version: int = -1

    def chunks(self) -> list[TrajectoryChunk]:
        return [c for episode in self.episodes for c in episode]


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

        A producer's chunks arrive in order, so a chunk continues its producer's unfinished
        episode in the group, or starts a new one (an env may run several of a group's
        episodes, one after the other).

        Raises:
            ValueError: the chunk has no group, or would start a ``group_size + 1``-th episode
                of its group (a producer that does not follow the grouping).
        """
        if not chunk.group:
            raise ValueError("group: empty (algo.kind grpo needs every chunk's episode group)")
        group = self._groups.setdefault(chunk.group, _Group())
        index = group.open.get(chunk.producer)
        if index is None:
            if len(group.episodes) >= self.group_size:
                raise ValueError(
                    f"group {chunk.group!r}: a {self.group_size + 1}th episode "
                    f"(from {chunk.producer}), but algo.group_size is {self.group_size}"
                )
            index = group.open[chunk.producer] = len(group.episodes)
            group.episodes.append([])
        group.episodes[index].append(chunk)
        group.newest_version = max(group.newest_version, int(chunk.policy_versions.max()))
        self.held += 1
        if ends_episode(chunk):
            del group.open[chunk.producer]
            group.ended += 1
        if group.ended < self.group_size:
            return None
        del self._groups[chunk.group]
        self.held -= sum(len(e) for e in group.episodes)
        returns = [sum(float(c.rewards.sum()) for c in episode) for episode in group.episodes]
        advantages = group_advantages(returns)
        return TrainableGroup(
            [(episode, float(a)) for episode, a in zip(group.episodes, advantages, strict=True)]
        )

    def evict_stale(self, version: int, max_staleness: int) -> list[TrajectoryChunk]:
        """Drop and return the chunks of incomplete groups none of whose steps is within
        ``max_staleness`` of ``version`` (nothing of them could be trained any more)."""
        stale = [k for k, g in self._groups.items() if version - g.newest_version > max_staleness]
        dropped = [c for k in stale for c in self._groups.pop(k).chunks()]
        self.held -= len(dropped)
        return dropped
