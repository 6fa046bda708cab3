"""Demonstrations in memory, cut into packed batches of at most ``token_budget`` tokens.

A sample's length is the number of tokens the VLA policy gives it: the fixed tokens (readout,
proprio, image patches) plus its instruction's tokens (``VLAConfig.instruction_token_counts``:
real bytes, or words). Each batch is the fullest
best-fit-decreasing bin over a random pool of samples, so no token is padding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sft.lerobot import DatasetError, LeRobotDataset
from sft.packing import pack


@dataclass(frozen=True, slots=True)
class PackedIndices:
    """One batch: which samples, how many real tokens, and how full the budget is."""

    indices: np.ndarray
    num_tokens: int
    efficiency: float


class DemoSet:
    """Every frame of a LeRobot dataset as arrays: ``obs[key]`` [N, ...] and ``actions`` [N, D].

    Args:
        root: dataset directory.
        fixed_tokens: tokens every sample has besides its instruction (``VLAConfig``'s
            ``num_fixed_tokens``).
        instruction_tokens: byte tokens int[N, L] -> the policy's instruction tokens per sample
            int[N] (``VLAConfig.instruction_token_counts``); default: the non-pad bytes.
    """

    def __init__(
        self,
        root: str | Path,
        fixed_tokens: int,
        instruction_tokens: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        dataset = LeRobotDataset(root)
        if not dataset.episodes:
            raise DatasetError(f"{root}: the dataset has no episodes")
        if "action" not in dataset.features:
            raise DatasetError(f"{root}: no 'action' feature to learn (features: "
                               f"{sorted(dataset.features)})")  # fmt: skip
        episodes = [dataset.episode(e.episode_index) for e in dataset.episodes]
        prefix = "observation."
        keys = [k for k in episodes[0] if k.startswith(prefix)]
        self.obs = {k[len(prefix) :]: np.concatenate([ep[k] for ep in episodes]) for k in keys}
        self.actions = np.concatenate([ep["action"] for ep in episodes]).astype(np.float32)
        instr = self.obs.get("instruction")
        if instr is None:
            real = np.zeros(len(self.actions), np.int64)
        elif instruction_tokens is None:
            real = (instr != 0).sum(axis=1)
        else:
            real = np.asarray(instruction_tokens(instr))
        self.lengths = (fixed_tokens + real).astype(np.int64)
        self.num_episodes = len(episodes)

    def __len__(self) -> int:
        return len(self.actions)

    def check_budget(self, budget: int) -> None:
        """Raise ValueError if a sample is longer than ``budget`` tokens (it could never be
        packed), naming the first such frame."""
        too_long = np.flatnonzero(self.lengths > budget)
        if too_long.size:
            frame = int(too_long[0])
            raise ValueError(f"sft.token_budget: {budget} tokens, but frame {frame} of the "
                             f"dataset needs {int(self.lengths[frame])} ({too_long.size} frames "
                             "are too long)")  # fmt: skip

    def packed_batch(self, budget: int, rng: np.random.Generator) -> PackedIndices:
        """The fullest packed bin over a random pool of about four budgets' worth of samples."""
        pool_size = min(len(self), max(1, 4 * budget // int(self.lengths.mean())))
        pool = rng.choice(len(self), size=pool_size, replace=False)
        bins = pack(self.lengths[pool].tolist(), budget)
        best = max(bins, key=lambda b: int(self.lengths[pool[b]].sum()))
        indices = pool[np.asarray(best)]
        tokens = int(self.lengths[indices].sum())
        return PackedIndices(indices=indices, num_tokens=tokens, efficiency=tokens / budget)
