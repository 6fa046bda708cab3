"""Demonstrations cut into packed batches of at most ``token_budget`` tokens.

A sample's length is the number of tokens the policy gives it: the fixed tokens (for the VLA:
readout, proprio, image patches) plus what varies per frame (the VLA: its instruction's tokens,
real bytes or words; a token VLA: its prompt's text; ``rlvla3/policy/sft_tokens.py``). Each batch is the fullest best-fit-decreasing bin over a random pool of
samples, so no token is padding.

Two sources with one interface (``packed_batch``):

- :class:`DemoSet` holds every frame in memory (small datasets, e.g. generated demos);
- :class:`DemoStream` streams a dataset too large for memory: a background thread reads episodes
  in a shuffled order, epoch after epoch, into a bounded buffer of frames; each batch is packed
  from a random pool of the buffer, and the frames it takes leave the buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sft.lerobot import DatasetError, LeRobotDataset
from sft.packing import pack

VariableTokens = Callable[[dict[str, np.ndarray]], np.ndarray]
"""The frames' observations [N, ...] -> each frame's tokens beyond the fixed ones int[N]."""
_PREFIX = "observation."


@dataclass(frozen=True, slots=True)
class PackedFrames:
    """One batch: the frames' observations and actions, their tokens, how full the budget is."""

    obs: dict[str, np.ndarray]
    actions: np.ndarray
    num_tokens: int
    efficiency: float

    @property
    def num_samples(self) -> int:
        return len(self.actions)


def _check_dataset(dataset: LeRobotDataset, root: str | Path) -> None:
    if not dataset.episodes:
        raise DatasetError(f"{root}: the dataset has no episodes")
    if "action" not in dataset.features:
        raise DatasetError(
            f"{root}: no 'action' feature to learn (features: {sorted(dataset.features)})"
        )


def _lengths(
    obs: dict[str, np.ndarray], fixed_tokens: int, variable_tokens: VariableTokens | None
) -> np.ndarray:
    """Tokens per frame: the fixed ones plus the variable ones (default: the instruction's
    non-pad bytes)."""
    if variable_tokens is not None:
        real = np.asarray(variable_tokens(obs))
    elif "instruction" in obs:
        real = (obs["instruction"] != 0).sum(axis=1)
    else:
        real = np.zeros(len(next(iter(obs.values()))), np.int64)
    return (fixed_tokens + real).astype(np.int64)


def _episode_arrays(
    episode: dict[str, np.ndarray], action_steps: int = 1
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    obs = {k[len(_PREFIX) :]: v for k, v in episode.items() if k.startswith(_PREFIX)}
    actions = episode["action"].astype(np.float32)
    return obs, actions if action_steps == 1 else action_windows(actions, action_steps)


def action_windows(actions: np.ndarray, steps: int) -> np.ndarray:
    """An episode's actions ``[T, ...]`` as each frame's action chunk ``[T, steps, ...]``: frame
    ``t``'s next ``steps`` actions ``t .. t + steps - 1``, the episode's last action repeated
    past its end (as OpenVLA-OFT pads its chunks)."""
    index = np.minimum(np.arange(len(actions))[:, None] + np.arange(steps), len(actions) - 1)
    return actions[index]


def _pool_size(budget: int, mean_length: float, available: int) -> int:
    """About four budgets' worth of samples: enough choice for best-fit to fill a bin."""
    return min(available, max(1, int(4 * budget // max(mean_length, 1.0))))


def _check_budget(lengths: np.ndarray, budget: int, first_index: int = 0) -> None:
    too_long = np.flatnonzero(lengths > budget)
    if too_long.size:
        frame = first_index + int(too_long[0])
        raise ValueError(
            f"sft.token_budget: {budget} tokens, but frame {frame} of the "
            f"dataset needs {int(lengths[too_long[0]])} ({too_long.size} frames "
            "are too long)"
        )


def shard_positions(num_episodes: int, rank: int, world_size: int) -> list[int]:
    """The positions of the episodes rank ``rank`` of ``world_size`` reads: every
    ``world_size``-th from ``rank``, so the ranks' shards are disjoint and cover the dataset."""
    if num_episodes < world_size:
        raise ValueError(
            f"sft.dataset: {num_episodes} episodes for {world_size} ranks "
            "(roles.sft_trainer.count): each rank reads episodes of its own"
        )
    return list(range(rank, num_episodes, world_size))


class DemoSet:
    """Every frame of a LeRobot dataset as arrays: ``obs[key]`` [N, ...] and ``actions`` [N, D]
    (``[N, K, D]`` with action chunks).

    Args:
        root: dataset directory.
        fixed_tokens: tokens every sample has (``FrameTokens.fixed_tokens``).
        variable_tokens: the frames' observations -> each one's further tokens int[N]
            (``FrameTokens.variable_tokens``); default: the instruction's non-pad bytes.
        action_steps: above 1, each frame's action is the chunk of its episode's next
            ``action_steps`` actions ``[K, D]`` (``action_windows``).
        rank, world_size: a data-parallel SFT trainer's rank reads episodes ``rank``,
            ``rank + world_size``, ... only (``shard_positions``).
    """

    def __init__(
        self,
        root: str | Path,
        fixed_tokens: int,
        variable_tokens: VariableTokens | None = None,
        action_steps: int = 1,
        *,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        dataset = LeRobotDataset(root)
        _check_dataset(dataset, root)
        parts = [
            _episode_arrays(dataset.episode(dataset.episodes[i].episode_index), action_steps)
            for i in shard_positions(len(dataset.episodes), rank, world_size)
        ]
        self.obs = {k: np.concatenate([obs[k] for obs, _ in parts]) for k in parts[0][0]}
        self.actions = np.concatenate([actions for _, actions in parts])
        self.lengths = _lengths(self.obs, fixed_tokens, variable_tokens)
        self.num_episodes = len(parts)

    def __len__(self) -> int:
        return len(self.actions)

    def check_budget(self, budget: int) -> None:
        """Raise ValueError if a sample is longer than ``budget`` tokens (it could never be
        packed), naming the first such frame."""
        _check_budget(self.lengths, budget)

    def packed_batch(self, budget: int, rng: np.random.Generator) -> PackedFrames:
        """The fullest packed bin over a random pool of about four budgets' worth of samples."""
        pool = rng.choice(
            len(self), size=_pool_size(budget, self.lengths.mean(), len(self)), replace=False
        )
        bins = pack(self.lengths[pool].tolist(), budget)
        best = max(bins, key=lambda b: int(self.lengths[pool[b]].sum()))
        indices = pool[np.asarray(best)]
        tokens = int(self.lengths[indices].sum())
        return PackedFrames(
            obs={k: v[indices] for k, v in self.obs.items()},
            actions=self.actions[indices],
            num_tokens=tokens,
            efficiency=tokens / budget,
        )

    def close(self) -> None:
        """Nothing to release (the interface of :class:`DemoStream`)."""


class DemoStream:
    """Packed batches from a LeRobot dataset without holding it in memory.

    A background thread reads episodes (a new shuffled order each epoch, seeded) into a buffer of
    at most ``buffer_frames`` frames. ``packed_batch`` waits until the buffer holds a full pool
    (or the whole dataset, if smaller), packs the fullest bin from a random pool of it, and
    removes the frames it returns, so a frame is trained on once per pass of the loader.

    Args:
        root, fixed_tokens, variable_tokens: as for :class:`DemoSet`.
        buffer_frames: the buffer's capacity in frames (memory: this many frames).
        seed: the episode order's seed.
        rank, world_size: as for :class:`DemoSet` (this rank's episodes only).
    """

    def __init__(
        self,
        root: str | Path,
        fixed_tokens: int,
        variable_tokens: VariableTokens | None = None,
        *,
        buffer_frames: int = 20_000,
        seed: int = 0,
        action_steps: int = 1,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if buffer_frames < 1:
            raise ValueError(f"buffer_frames must be >= 1, got {buffer_frames}")
        self.dataset = LeRobotDataset(root, cache_episodes=1)
        _check_dataset(self.dataset, root)
        self._shard = set(shard_positions(len(self.dataset.episodes), rank, world_size))
        self.num_episodes = len(self._shard)
        lengths = [e.length for e in self.dataset.episodes]
        self.total_frames = sum(lengths[i] for i in self._shard)
        self.fixed_tokens, self.variable_tokens = fixed_tokens, variable_tokens
        self.action_steps = action_steps  # above 1: each frame's target is an action chunk
        self._first_frame = np.concatenate([[0], np.cumsum(lengths)])  # per episode position
        self._longest_episode = max(lengths)
        self.capacity = max(buffer_frames, self._longest_episode)
        self.budget: int | None = None
        # the buffer: one entry per frame (obs, action, tokens); order does not matter
        self._frames: list[tuple[dict[str, np.ndarray], np.ndarray, int]] = []
        self._tokens = 0  # tokens of the frames in the buffer
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._epochs = 0
        self._rng = np.random.default_rng(seed)
        self._loader = threading.Thread(target=self._load, name="demo-stream", daemon=True)
        self._loader.start()

    def __len__(self) -> int:
        return self.total_frames

    @property
    def epochs(self) -> int:
        """Passes over the dataset the loader has started."""
        return self._epochs

    def check_budget(self, budget: int) -> None:
        """Check the frames read so far against ``budget`` (ValueError naming one too long), and
        every frame the loader reads from now on (the first one too long stops the stream and
        ``packed_batch`` raises its ValueError)."""
        with self._cond:
            self.budget = budget
            for _obs, _action, length in self._frames:
                if length > budget:
                    raise ValueError(
                        f"sft.token_budget: {budget} tokens, but a frame of the "
                        f"dataset needs {length}"
                    )

    def _load(self) -> None:
        try:
            while not self._stop.is_set():
                self._epochs += 1
                for position in self._epoch_order():
                    episode = self.dataset.episodes[position]
                    obs, actions = _episode_arrays(
                        self.dataset.episode(episode.episode_index), self.action_steps
                    )
                    lengths = _lengths(obs, self.fixed_tokens, self.variable_tokens)
                    # each frame its own copy: a frame left in the buffer must not keep its
                    # whole episode alive (memory is capacity frames, not episodes)
                    frames = [
                        ({k: v[row].copy() for k, v in obs.items()}, actions[row].copy(), int(n))
                        for row, n in enumerate(lengths)
                    ]
                    with self._cond:
                        while len(self._frames) + len(frames) > self.capacity:
                            if self._stop.is_set():
                                return
                            self._cond.wait(0.5)
                        if self.budget is not None:  # read under the lock check_budget holds
                            _check_budget(lengths, self.budget, int(self._first_frame[position]))
                        self._frames.extend(frames)
                        self._tokens += int(lengths.sum())
                        self._cond.notify_all()
        except BaseException as err:  # handed to the consumer, which raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _epoch_order(self) -> list[int]:
        """Episode positions for one pass: data files in a shuffled order, the episodes of each
        file shuffled (several episodes share a v3.0 file, which is then read once a pass)."""
        by_file: dict[Path, list[int]] = {}
        for position, episode in enumerate(self.dataset.episodes):
            if position not in self._shard:
                continue
            by_file.setdefault(self.dataset.episode_path(episode.episode_index), []).append(
                position
            )
        groups = list(by_file.values())
        order: list[int] = []
        for g in self._rng.permutation(len(groups)):
            order.extend(self._rng.permutation(groups[g]).tolist())
        return order

    def packed_batch(
        self, budget: int, rng: np.random.Generator, timeout_s: float = 600.0
    ) -> PackedFrames:
        """The fullest packed bin over a random pool of the buffer; its frames leave the buffer."""
        with self._cond:
            want = min(self._pool_wanted(budget), self._always_reached())
            if not self._cond.wait_for(
                lambda: self._error is not None or len(self._frames) >= want, timeout_s
            ):
                raise TimeoutError(f"demo stream: no {want} frames within {timeout_s}s")
            if self._error is not None:
                raise self._error
            size = min(self._pool_wanted(budget), len(self._frames))
            pool = rng.choice(len(self._frames), size=size, replace=False)
            lengths = [self._frames[i][2] for i in pool]
            bins = pack(lengths, budget)
            best = max(bins, key=lambda b: sum(lengths[j] for j in b))
            chosen = sorted((int(pool[j]) for j in best), reverse=True)
            taken = [self._frames[i] for i in chosen]
            for i in chosen:  # swap-remove, highest index first so the others stay valid
                self._frames[i] = self._frames[-1]
                self._frames.pop()
            tokens = sum(n for *_, n in taken)
            self._tokens -= tokens
            self._cond.notify_all()
        obs = {k: np.stack([o[k] for o, _, _ in taken]) for k in taken[0][0]}
        actions = np.stack([a for _, a, _ in taken])
        return PackedFrames(obs=obs, actions=actions, num_tokens=tokens, efficiency=tokens / budget)

    def _pool_wanted(self, budget: int) -> int:
        mean = self._tokens / len(self._frames) if self._frames else self.fixed_tokens
        return _pool_size(budget, float(mean), self.capacity)

    def _always_reached(self) -> int:
        """A buffer size the loader always tops up to: it adds whole episodes while one fits."""
        return max(1, self.capacity - self._longest_episode + 1)

    def close(self) -> None:
        """Stop the loader thread."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._loader.join(timeout=5)
