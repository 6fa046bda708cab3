"""A CartPole whose simulator "blows up" on demand (tests only): every ``every``-th step returns a
NaN observation, as an unstable physics step can, and every 4th reset does too. Importing the module registers it, so a run
uses it as ``env.id: tests.faulty_env:NaNCartPole-v0``."""

from __future__ import annotations

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
            obs = np.full_like(obs, np.nan)
        return obs, reward, terminated, truncated, info


gym.register("NaNCartPole-v0", entry_point=NaNCartPole)
