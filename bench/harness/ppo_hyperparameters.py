"""PPO's hyperparameters as ``ppo_update`` takes them, read from any settings that name them as
it does (the run config's ``algo`` section, the CartPole reference's ``Settings``), so a probe
updates with exactly the numbers it was given."""

from __future__ import annotations

from typing import Any

_NAMES = ("epochs", "minibatch_size", "clip_coef", "vf_coef", "ent_coef", "max_grad_norm")


def ppo_hyperparameters(settings: Any) -> dict[str, Any]:
    """``ppo_update``'s keyword arguments ``epochs`` .. ``max_grad_norm`` from ``settings``."""
    return {name: getattr(settings, name) for name in _NAMES}
