"""The RL trainer's optimizer: Adam over the policy, with the value-only parameters in their own
parameter group so that they can learn at ``algo.value_lr``."""

from __future__ import annotations

import torch

from rlvla3.config.run_config import AlgoConfig
from rlvla3.policy.base import ActorCritic


def build_optimizer(policy: ActorCritic, algo: AlgoConfig) -> torch.optim.Adam:
    """Adam (eps 1e-5) over the trainable parameters (with LoRA: adapters and heads), with one
    group at ``algo.lr`` and, where the policy has value-only
    parameters, a second at ``algo.value_lr`` (``lr`` when None). Each group keeps its full
    rate as ``base_lr`` for ``scale_learning_rate``.

    Fused: one kernel per step instead of a handful of ops per parameter tensor (on the CI CPU,
    the CartPole MLP's step takes 0.27 ms against 1.25 ms for torch's CPU default).
    """
    value_ids = {id(p) for p in policy.value_parameters()}
    trained = trainable_parameters(policy)
    shared = [p for p in trained if id(p) not in value_ids]
    value = [p for p in trained if id(p) in value_ids]
    value_lr = algo.lr if algo.value_lr is None else algo.value_lr
    groups = [{"params": shared, "lr": algo.lr, "base_lr": algo.lr}]
    if value:
        groups.append({"params": value, "lr": value_lr, "base_lr": value_lr})
    return torch.optim.Adam(groups, eps=1e-5, fused=True)


def scale_learning_rate(optimizer: torch.optim.Optimizer, scale: float) -> None:
    """Set every group's rate to ``scale`` times its ``base_lr`` (linear annealing)."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * scale


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that train (a LoRA policy's frozen base left out: Adam would keep two
    moment buffers per frozen weight for nothing)."""
    return [p for p in module.parameters() if p.requires_grad]
