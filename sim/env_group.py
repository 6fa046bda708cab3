"""A group of envs an env worker steps together: one action request per step for all of them.

``EnvGroup`` is the one interface: reset an env, step every env with one action each. Two
implementations:

- ``SeparateEnvs``: one ``SimAdapter`` per env (any backend), stepped one after the other.
- ``VectorEnvs``: one gymnasium vector env (``gymnasium.make_vec``; CartPole and other classic
  control envs step natively as numpy arrays). It resets finished envs itself: in the same step
  (``AutoresetMode.SAME_STEP``, gymnasium's own vector wrappers), where the step reports the
  episode's last observation for the bootstrap value and the next episode's first one, or at
  their next step (``NEXT_STEP``, native vector envs such as CartPole's), which is then reported
  as ``restarted`` instead of a transition.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from sim.adapter import Obs, SimAdapter


@dataclass(frozen=True, slots=True)
class Stepped:
    """One env's step in a group step.

    Attributes:
        obs: the observation after the step (the episode's last one when it ended).
        reward, terminated, truncated, info: as ``SimAdapter.step`` returns them.
        reset_obs: the next episode's first observation when the group reset the env itself
            in the same step (vector envs), else None: the caller resets it.
        restarted: this was no step but the env's reset (a vector env that resets its finished
            envs at their next step, ignoring their action): ``obs`` is the new episode's first
            observation, and there is no transition to record.
    """

    obs: Obs
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    reset_obs: Obs | None = None
    restarted: bool = False


class EnvGroup(abc.ABC):
    """``size`` envs stepped together."""

    size: int
    observation_space: spaces.Dict

    @abc.abstractmethod
    def reset(self, i: int, seed: int | None = None) -> Obs:
        """Start env ``i``'s next episode (``seed``: that episode's seed)."""

    @abc.abstractmethod
    def step(self, actions: list[Any]) -> list[Stepped]:
        """Step every env with its action, in order."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the simulators."""


class SeparateEnvs(EnvGroup):
    """One simulator object per env."""

    def __init__(self, envs: list[SimAdapter]) -> None:
        self.envs = envs
        self.size = len(envs)
        self.observation_space = envs[0].observation_space

    def reset(self, i: int, seed: int | None = None) -> Obs:
        return self.envs[i].reset(seed=seed)[0]

    def step(self, actions: list[Any]) -> list[Stepped]:
        return [Stepped(*env.step(a)) for env, a in zip(self.envs, actions, strict=True)]

    def close(self) -> None:
        for env in self.envs:
            env.close()


class VectorEnvs(EnvGroup):
    """A gymnasium vector env of ``size`` copies of ``env_id``, observations flattened to
    ``{"state": float32[obs_dim]}`` as ``sim.gym_adapter.GymAdapter`` does.

    Args:
        env_id: a gymnasium id.
        size: envs in the vector.
        seed: seeds of the first episodes are ``seed, seed + 1, ...``.
        **kwargs: passed to ``gymnasium.make_vec``'s env.
    """

    def __init__(
        self, env_id: str, size: int, *, seed: int, mode: str | None = None, **kwargs: Any
    ) -> None:
        """``mode``: gymnasium's ``vectorization_mode`` (None: the env's native vector env if it
        has one, else ``sync``)."""
        self.size = size
        if mode is None:
            mode = "vector_entry_point" if _has_vector_entry_point(env_id) else "sync"
        same_step = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}
        self.vec = gym.make_vec(
            env_id,
            num_envs=size,
            vectorization_mode=mode,
            vector_kwargs=same_step if mode != "vector_entry_point" else None,
            **kwargs,
        )
        self.next_step_reset = (
            self.vec.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
            == gym.vector.AutoresetMode.NEXT_STEP
        )
        self._pending = np.zeros(size, bool)  # NEXT_STEP: envs their next step resets
        self._single_space = self.vec.single_observation_space
        flat = spaces.flatten_space(self._single_space)
        self.observation_space = spaces.Dict(
            {
                "state": spaces.Box(
                    low=flat.low.astype(np.float32),
                    high=flat.high.astype(np.float32),
                    dtype=np.float32,
                )
            }
        )
        self.action_space = self.vec.single_action_space
        self._seed = seed
        self._obs: np.ndarray | None = None

    def _row(self, batch: Any, i: int) -> Obs:
        if isinstance(self._single_space, spaces.Box):
            row = np.asarray(batch[i], np.float32).reshape(-1)
        else:  # a structured space: unbatch it, then flatten as the single adapter does
            row = spaces.flatten(
                self._single_space, list(spaces.iterate(self.vec.observation_space, batch))[i]
            )
        return {"state": np.asarray(row, np.float32)}

    def reset(self, i: int, seed: int | None = None) -> Obs:
        """The first call resets every env (seeds ``seed + j``); later calls return the env's
        current observation: a vector env resets its envs itself when they finish (for one that
        resets at the next step, this is its last observation, acted on in vain)."""
        if self._obs is None:
            first = self._seed if seed is None else seed
            # gymnasium's vector wrappers take a seed per env; a native vector env one seed
            seeds = first if self.next_step_reset else [first + j for j in range(self.size)]
            self._obs, _ = self.vec.reset(seed=seeds)
        return self._row(self._obs, i)

    def _actions(self, actions: list[Any]) -> np.ndarray:
        space = self.action_space
        if isinstance(space, spaces.Discrete):
            return np.array([int(np.asarray(a).reshape(-1)[0]) for a in actions], np.int64)
        arr = np.asarray(actions, dtype=space.dtype).reshape(self.size, *space.shape)
        return np.clip(arr, space.low, space.high)

    def step(self, actions: list[Any]) -> list[Stepped]:
        obs, rewards, terms, truncs, infos = self.vec.step(self._actions(actions))
        self._obs = obs
        done = np.logical_or(terms, truncs)
        final = infos.get("final_obs") if done.any() and not self.next_step_reset else None
        restarted, self._pending = self._pending, done & self.next_step_reset
        out = []
        for i in range(self.size):
            info = {k: v[i] for k, v in infos.items() if not k.startswith(("_", "final_"))}
            if restarted[i]:
                out.append(Stepped(self._row(obs, i), 0.0, False, False, {}, restarted=True))
            elif done[i] and final is not None:
                last = {
                    "state": np.asarray(spaces.flatten(self._single_space, final[i]), np.float32)
                }
                out.append(
                    Stepped(
                        last,
                        float(rewards[i]),
                        bool(terms[i]),
                        bool(truncs[i]),
                        info,
                        reset_obs=self._row(obs, i),
                    )
                )
            else:
                out.append(
                    Stepped(
                        self._row(obs, i), float(rewards[i]), bool(terms[i]), bool(truncs[i]), info
                    )
                )
        return out

    def close(self) -> None:
        self.vec.close()


def _has_vector_entry_point(env_id: str) -> bool:
    spec = gym.spec(env_id)
    return getattr(spec, "vector_entry_point", None) is not None
