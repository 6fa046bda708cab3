"""Simulators that fail on demand (tests only). ``NaNCartPole``: every ``every``-th step returns a
broken observation, as an unstable physics step can, NaN and 1e30 (finite, but absurd) in turn,
and every 4th reset a NaN one.
``HangingCartPole``: one step never returns. Importing the module registers them, so a run uses
them as ``env.id: tests.faulty_env:NaNCartPole-v0``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np


class NaNCartPole(gym.Wrapper):
    def __init__(self, every: int = 40) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.every, self.steps, self.resets = every, 0, 0

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        obs, info = self.env.reset(**kwargs)
        self.resets += 1
        if self.resets % 4 == 0:
            obs = np.full_like(obs, np.nan)
        return obs, info

    def step(self, action: Any) -> tuple[Any, ...]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        if self.steps % self.every == 0:
            obs = np.full_like(obs, np.nan if (self.steps // self.every) % 2 else 1e30)
        return obs, reward, terminated, truncated, info


gym.register("NaNCartPole-v0", entry_point=NaNCartPole)


class HangingCartPole(gym.Wrapper):
    """A CartPole whose simulator hangs for good inside its ``hang_at``-th step, once per run:
    the first env to get there leaves ``marker`` behind, so the restarted worker's envs run."""

    def __init__(self, marker: str, hang_at: int = 200) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.marker, self.hang_at, self.steps = Path(marker), hang_at, 0

    def step(self, action: Any) -> tuple[Any, ...]:
        self.steps += 1
        if self.steps == self.hang_at:
            try:
                self.marker.touch(exist_ok=False)
            except FileExistsError:
                pass
            else:
                threading.Event().wait()  # a deadlocked physics engine, say
        return self.env.step(action)


gym.register("HangingCartPole-v0", entry_point=HangingCartPole)
