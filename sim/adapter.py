"""The one simulator adapter contract, a gymnasium wrapper, and the env factory.

Every simulator an env worker drives is a :class:`SimAdapter`. Observations are dicts of numpy
arrays, exactly what goes on the wire:

- classic gymnasium envs: ``{"state": float32[obs_dim]}``
- VLA tasks: ``{"image": uint8[H, W, 3], "instruction": int32[L] (UTF-8 bytes + 1, 0 = pad),
  "proprio": float32[P]}``

:func:`make_env` maps an env id to an adapter: ``rlvla3/...`` ids are our built-in tasks,
``maniskill/...`` and ``libero/...`` are reserved for adapters behind optional extras, anything
else is a registered gymnasium id wrapped by :class:`GymAdapter`.
"""

from __future__ import annotations

import abc
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

if TYPE_CHECKING:
    from sim.straggler import StragglerConfig

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


EnvFactory = Callable[..., SimAdapter]
_REGISTRY: dict[str, EnvFactory] = {}
_EXTRAS = {"maniskill/": ("maniskill", "mani_skill"), "libero/": ("libero", "libero")}


def register_env(env_id: str, factory: EnvFactory) -> None:
    """Register a built-in env id; ``factory(seed=..., **kwargs)`` must return a SimAdapter."""
    if env_id in _REGISTRY:
        raise ValueError(f"env id {env_id!r} is already registered")
    _REGISTRY[env_id] = factory


def registered_envs() -> list[str]:
    """The built-in (``rlvla3/...``) env ids, sorted."""
    return sorted(_REGISTRY)


def _make_tabletop(*, seed: int, easy: bool = False, **kwargs: Any) -> SimAdapter:
    from sim.tabletop import TableTopConfig, TableTopEnv

    return TableTopEnv(TableTopConfig(easy=easy, **kwargs), seed=seed)


def _make_tabletop_easy(*, seed: int, **kwargs: Any) -> SimAdapter:
    return _make_tabletop(seed=seed, easy=True, **kwargs)


register_env("rlvla3/TableTop-v0", _make_tabletop)
register_env("rlvla3/TableTopEasy-v0", _make_tabletop_easy)


def _reserved(env_id: str) -> None:
    for prefix, (extra, module) in _EXTRAS.items():
        if not env_id.startswith(prefix):
            continue
        if importlib.util.find_spec(module) is None:
            raise SimulatorNotInstalledError(
                f"env {env_id!r} needs the {extra!r} extra: pip install 'rlvla3[{extra}]'"
            )
        raise NotImplementedError(f"env {env_id!r}: the {extra} adapter is not implemented yet")


def make_env(
    env_id: str, *, seed: int, straggler: StragglerConfig | None = None, **kwargs: Any
) -> SimAdapter:
    """Build the adapter for ``env_id``.

    Args:
        env_id: ``rlvla3/<Task>-vN`` (built-in), ``maniskill/...`` or ``libero/...`` (reserved,
            raise :class:`SimulatorNotInstalledError` naming the extra), or a gymnasium id.
        seed: seed of the first episode (later ``reset()`` calls without a seed continue the
            env's own random stream). Also seeds the straggler delays when ``straggler.seed`` is
            None.
        straggler: when given, wrap the env in a :class:`sim.straggler.StragglerAdapter`.
        **kwargs: env-specific options (for ``rlvla3/TableTop-v0``: fields of
            :class:`sim.tabletop.TableTopConfig`; for gymnasium ids: ``gymnasium.make`` kwargs).
    """
    if env_id.startswith("rlvla3/"):
        if env_id not in _REGISTRY:
            raise KeyError(f"unknown built-in env {env_id!r}; known: {registered_envs()}")
        env = _REGISTRY[env_id](seed=seed, **kwargs)
    elif env_id.startswith("libero/") and importlib.util.find_spec("libero") is not None:
        from sim.libero import make_libero_env  # kwargs: sim.libero.LiberoConfig fields

        env = make_libero_env(env_id, seed=seed, **kwargs)
    elif env_id.startswith("maniskill/") and importlib.util.find_spec("mani_skill") is not None:
        from sim.maniskill import make_maniskill  # kwargs: sim.maniskill.ManiSkillConfig fields

        env = make_maniskill(env_id, seed=seed, **kwargs)
    else:
        _reserved(env_id)
        env = GymAdapter(env_id, seed=seed, **kwargs)
    if straggler is None:
        return env
    from sim.straggler import StragglerAdapter

    return StragglerAdapter(env, straggler, default_seed=seed)
