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
        sim_steps: simulator steps it took: 1, or the executed steps of an action chunk
            (``reward`` then their sum; the env worker's ``roles/env/action_chunks.py``).
    """

    obs: Obs
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    reset_obs: Obs | None = None
    restarted: bool = False
    sim_steps: int = 1


@dataclass(frozen=True, slots=True)
class VectorStep:
    """A vector env's step as arrays, one row per env (``VectorEnvs.step_arrays``).

    Attributes:
        next_obs: ``[size, obs_dim]``: what each env acts on next (a finished env's next
            episode's first observation when the vector env reset it in the same step; its last
            one when it resets at the next step).
        last_obs: ``[size, obs_dim]``: the observation each transition ended in (differs from
            ``next_obs`` only in the rows of episodes that ended and were reset in this step).
        rewards, terminated, truncated: ``[size]``; 0 and False in ``restarted`` rows.
        restarted: ``[size]``: rows that were no step but their env's reset (``Stepped``).
        success: ``[size]`` bool when the env reports ``info["success"]``, else None.
        infos: the vector env's info dict, as it returned it.
    """

    next_obs: np.ndarray
    last_obs: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    restarted: np.ndarray
    success: np.ndarray | None
    infos: dict[str, Any]


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
        self.native = mode == "vector_entry_point"
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

    def _flat(self, batch: Any) -> np.ndarray:
        """A batch of observations as float32 ``[size, obs_dim]`` rows, flattened as the single
        adapter flattens one."""
        if isinstance(self._single_space, spaces.Box):
            return np.asarray(batch, np.float32).reshape(self.size, -1)
        # a structured space: unbatch it, then flatten each env's part
        parts = spaces.iterate(self.vec.observation_space, batch)
        return np.stack([spaces.flatten(self._single_space, part) for part in parts]).astype(
            np.float32
        )

    def reset_all(self, seed: int | None = None) -> np.ndarray:
        """Reset every env (seeds ``seed + j``; default the constructor's) and return their first
        observations, ``[size, obs_dim]``."""
        first = self._seed if seed is None else seed
        # gymnasium's vector wrappers take a seed per env; a native vector env one seed
        seeds = first if self.next_step_reset else [first + j for j in range(self.size)]
        obs, _ = self.vec.reset(seed=seeds)
        self._obs = self._flat(obs)
        self._pending[:] = False
        return self._obs

    def reset(self, i: int, seed: int | None = None) -> Obs:
        """The first call resets every env (seeds ``seed + j``); later calls return the env's
        current observation: a vector env resets its envs itself when they finish (for one that
        resets at the next step, this is its last observation, acted on in vain)."""
        if self._obs is None:
            self.reset_all(seed)
        return {"state": self._obs[i]}

    def reset_rows(self, rows: np.ndarray) -> np.ndarray | None:
        """Reset the envs where ``rows`` (bool ``[size]``) is True, the others untouched, and
        return every env's current observation, ``[size, obs_dim]``. None for a native vector
        env, which cannot reset one env (gymnasium's ``reset_mask`` option is its sync and
        async vector envs')."""
        if self.native:
            return None
        obs, _ = self.vec.reset(options={"reset_mask": np.asarray(rows, bool)})
        self._obs = self._flat(obs)
        return self._obs

    def _actions(self, actions: Any) -> np.ndarray:
        space = self.action_space
        if isinstance(space, spaces.Discrete):
            return np.asarray(actions).reshape(self.size, -1)[:, 0].astype(np.int64)
        arr = np.asarray(actions, dtype=space.dtype).reshape(self.size, *space.shape)
        return np.clip(arr, space.low, space.high)

    def step_arrays(self, actions: Any) -> VectorStep:
        """Step every env with its row of ``actions``; the whole group as arrays."""
        obs, rewards, terms, truncs, infos = self.vec.step(self._actions(actions))
        next_obs = self._flat(obs)
        self._obs = next_obs
        terminated = np.asarray(terms, bool)
        truncated = np.asarray(truncs, bool)
        done = terminated | truncated
        restarted, self._pending = self._pending, done & self.next_step_reset
        last_obs = next_obs
        if done.any() and not self.next_step_reset and "final_obs" in infos:
            # SAME_STEP: ``obs`` already holds the next episodes' first observations; the
            # finished episodes' last ones are in ``final_obs``
            last_obs = next_obs.copy()
            for i in np.flatnonzero(done):
                last_obs[i] = spaces.flatten(self._single_space, infos["final_obs"][i])
        success = infos.get("success")
        if success is not None:
            success = np.asarray(success, bool)
            final = infos.get("final_info", {})
            if "success" in final and not self.next_step_reset:
                # SAME_STEP: a finished env's own step info is under final_info; its row of
                # ``success`` already belongs to the next episode's reset
                success = np.where(done, np.asarray(final["success"], bool), success)
        return VectorStep(
            next_obs=next_obs,
            last_obs=last_obs,
            rewards=np.where(restarted, 0.0, np.asarray(rewards, np.float64)),
            terminated=terminated & ~restarted,
            truncated=truncated & ~restarted,
            restarted=restarted,
            success=success,
            infos=infos,
        )

    def step(self, actions: list[Any]) -> list[Stepped]:
        out = self.step_arrays(actions)
        reset_here = not self.next_step_reset
        stepped = []
        for i in range(self.size):
            if out.restarted[i]:
                stepped.append(
                    Stepped({"state": out.next_obs[i]}, 0.0, False, False, {}, restarted=True)
                )
                continue
            info = {k: v[i] for k, v in out.infos.items() if not k.startswith(("_", "final_"))}
            done = out.terminated[i] or out.truncated[i]
            stepped.append(
                Stepped(
                    {"state": out.last_obs[i]},
                    float(out.rewards[i]),
                    bool(out.terminated[i]),
                    bool(out.truncated[i]),
                    info,
                    reset_obs={"state": out.next_obs[i]} if done and reset_here else None,
                )
            )
        return stepped

    def close(self) -> None:
        self.vec.close()


def _has_vector_entry_point(env_id: str) -> bool:
    spec = gym.spec(env_id)
    return getattr(spec, "vector_entry_point", None) is not None
