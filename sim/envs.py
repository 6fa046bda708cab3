"""The env registry: :func:`make_env` maps an env id to its backend.

``rlvla3/...`` ids are the built-in tasks, ``maniskill/...`` and ``libero/...`` the adapters
behind optional extras (their simulator packages are imported only when such an env is made),
anything else a registered gymnasium id wrapped by :class:`sim.gym_adapter.GymAdapter`. Backends
import only the contract (``sim.adapter``); this module imports them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from sim.adapter import SimAdapter, SimulatorNotInstalledError
from sim.gym_adapter import GymAdapter
from sim.libero import make_libero_env
from sim.maniskill import make_maniskill
from sim.straggler import StragglerAdapter, StragglerConfig
from sim.tabletop import TableTopConfig, TableTopEnv

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
        env_id: ``rlvla3/<Task>-vN`` (built-in), ``maniskill/...`` or ``libero/...`` (their
            extra installed, else :class:`SimulatorNotInstalledError` naming it), or a gymnasium id.
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
        env = make_libero_env(env_id, seed=seed, **kwargs)  # kwargs: LiberoConfig fields
    elif env_id.startswith("maniskill/") and importlib.util.find_spec("mani_skill") is not None:
        env = make_maniskill(env_id, seed=seed, **kwargs)  # kwargs: ManiSkillConfig fields
    else:
        _reserved(env_id)
        env = GymAdapter(env_id, seed=seed, **kwargs)
    if straggler is None:
        return env
    return StragglerAdapter(env, straggler, default_seed=seed)
