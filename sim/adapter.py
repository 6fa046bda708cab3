"""The one simulator contract every backend implements (and imports, alone of ``sim``).

Every simulator an env worker drives is a :class:`SimAdapter`. Observations are dicts of numpy
arrays, exactly what goes on the wire:

- classic gymnasium envs: ``{"state": float32[obs_dim]}``
- VLA tasks: ``{"image": uint8[H, W, 3], "instruction": int32[L] (UTF-8 bytes + 1, 0 = pad,
  ``sim.tokenizer``), "proprio": float32[P]}``

``sim.envs.make_env`` maps an env id to its backend.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np
from gymnasium import spaces

Obs = dict[str, np.ndarray]
StepResult = tuple[Obs, float, bool, bool, dict[str, Any]]


class SimulatorNotInstalledError(ImportError):
    """An env id needs an optional extra (a simulator package) that is not installed."""


class SimAdapter(abc.ABC):
    """A single simulator instance with the gymnasium step API and dict-of-numpy observations.

    Attributes:
        observation_space: a ``gymnasium.spaces.Dict`` whose keys, shapes and dtypes match every
            observation returned by ``reset`` and ``step``.
        action_space: a gymnasium space (``Box`` for continuous, ``Discrete`` for discrete envs).
    """

    observation_space: spaces.Dict
    action_space: spaces.Space

    def _reset_seed(self, seed: int | None) -> int | None:
        """The seed for this reset: the given one, else the construction seed on the first reset
        (``_pending_seed``, then cleared). Also seeds the action space with it."""
        if seed is None:
            seed = getattr(self, "_pending_seed", None)
        self._pending_seed = None
        if seed is not None:
            self.action_space.seed(seed)
        return seed

    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> tuple[Obs, dict[str, Any]]:
        """Start a new episode; a given ``seed`` makes it deterministic. Returns ``(obs, info)``."""

    @abc.abstractmethod
    def step(self, action: Any) -> StepResult:
        """Apply one action. Returns ``(obs, reward, terminated, truncated, info)``.

        ``reward`` is a python float, ``terminated``/``truncated`` python bools. Task envs put
        ``info["success"]`` (bool) in every info dict.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, most adapters hold nothing
        """Release simulator resources. Safe to call twice."""

    @property
    def instruction(self) -> str | None:
        """The current episode's language instruction, or None for envs without one."""
        return None

    @property
    def max_episode_steps(self) -> int | None:
        """Steps after which an episode is truncated, or None when unknown/unbounded."""
        return None
