"""Any registered gymnasium env as a :class:`sim.adapter.SimAdapter` (observations flattened)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from sim.adapter import Obs, SimAdapter, StepResult


class GymAdapter(SimAdapter):
    """Wraps any registered gymnasium env id; observations are flattened to ``{"state": ...}``.

    Box, Discrete (one-hot), MultiDiscrete, Tuple and Dict observation spaces are flattened with
    ``gymnasium.spaces.flatten`` into ``float32[obs_dim]``. Box actions are clipped to the action
    space bounds (policies with Gaussian heads emit unbounded actions); Discrete actions are
    converted to a python int.

    Args:
        env_id: a gymnasium id, e.g. ``"CartPole-v1"``.
        seed: the seed used by the first ``reset()`` called without one.
        **kwargs: passed to ``gymnasium.make``.
    """

    def __init__(self, env_id: str, *, seed: int | None = None, **kwargs: Any) -> None:
        self._env = gym.make(env_id, **kwargs)
        self._inner_obs_space = self._env.observation_space
        flat = spaces.flatten_space(self._inner_obs_space)
        if not isinstance(flat, spaces.Box):
            raise TypeError(f"{env_id}: cannot flatten observation space {self._inner_obs_space}")
        state_space = spaces.Box(
            low=flat.low.astype(np.float32), high=flat.high.astype(np.float32), dtype=np.float32
        )
        self.observation_space = spaces.Dict({"state": state_space})
        self.action_space = self._env.action_space
        self._pending_seed = seed
        spec = self._env.spec
        self._max_steps = spec.max_episode_steps if spec is not None else None

    @property
    def max_episode_steps(self) -> int | None:
        return self._max_steps

    def _wrap(self, obs: Any) -> Obs:
        flat = spaces.flatten(self._inner_obs_space, obs)
        return {"state": np.asarray(flat, dtype=np.float32)}

    def reset(self, seed: int | None = None) -> tuple[Obs, dict[str, Any]]:
        seed = self._reset_seed(seed)
        obs, info = self._env.reset(seed=seed)
        return self._wrap(obs), dict(info)

    def _convert_action(self, action: Any) -> Any:
        space = self.action_space
        if isinstance(space, spaces.Discrete):
            return int(np.asarray(action).reshape(-1)[0])
        if isinstance(space, spaces.Box):
            arr = np.asarray(action, dtype=space.dtype).reshape(space.shape)
            return np.clip(arr, space.low, space.high)
        return action

    def step(self, action: Any) -> StepResult:
        obs, reward, terminated, truncated, info = self._env.step(self._convert_action(action))
        return self._wrap(obs), float(reward), bool(terminated), bool(truncated), dict(info)

    def close(self) -> None:
        self._env.close()
