"""The RL optimizer: value-only parameters in their own group at ``algo.value_lr``."""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch

from rlvla3.algo.optim import build_optimizer, scale_learning_rate
from rlvla3.config.run_config import load_config
from rlvla3.config.typed_load import ConfigError
from rlvla3.policy.base import ActorCritic
from rlvla3.policy.mlp import MLPPolicy
from rlvla3.policy.vla import VLAConfig, VLAPolicy


def _vla() -> VLAPolicy:
    return VLAPolicy(
        VLAConfig(
            image_size=16,
            patch_size=8,
            d_model=32,
            num_layers=1,
            num_heads=2,
            action_head="gaussian",
        )
    )


def _obs(policy: ActorCritic) -> dict[str, torch.Tensor]:
    if isinstance(policy, MLPPolicy):
        return {"state": torch.randn(5, 4)}
    return {
        "image": torch.randint(0, 255, (5, 16, 16, 3), dtype=torch.uint8),
        "instruction": torch.randint(1, 200, (5, 12), dtype=torch.int32),
        "proprio": torch.randn(5, policy.config.proprio_dim),
    }


@pytest.mark.parametrize(
    "make", [lambda: MLPPolicy(4, gym.spaces.Discrete(3)), _vla], ids=["mlp", "vla"]
)
def test_value_parameters_move_the_value_only(make) -> None:
    """Changing ``value_parameters`` changes the value and leaves the action distribution."""
    torch.manual_seed(0)
    policy = make()
    obs = _obs(policy)
    with torch.no_grad():
        before = policy.act(obs, deterministic=True)
        for p in policy.value_parameters():
            p.add_(torch.randn_like(p))
        after = policy.act(obs, deterministic=True)
    assert policy.value_parameters()
    torch.testing.assert_close(after.action, before.action)
    torch.testing.assert_close(after.log_prob, before.log_prob)
    assert not torch.allclose(after.value, before.value)


def test_value_lr_groups_and_annealing() -> None:
    policy = _vla()
    cfg = load_config(None, ["algo.lr=0.0001", "algo.value_lr=0.001"])
    optimizer = build_optimizer(policy, cfg.algo)
    shared, value = optimizer.param_groups
    assert all(p is q for p, q in zip(value["params"], policy.value_parameters(), strict=True))
    assert len(shared["params"]) + len(value["params"]) == len(list(policy.parameters()))
    assert (shared["lr"], value["lr"]) == (1e-4, 1e-3)
    scale_learning_rate(optimizer, 0.5)
    assert (shared["lr"], value["lr"]) == (5e-5, 5e-4)
    default = build_optimizer(policy, load_config(None, ["algo.lr=0.0002"]).algo)
    assert [g["lr"] for g in default.param_groups] == [2e-4, 2e-4]  # value_lr None: lr


def test_value_lr_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="algo.value_lr: must be > 0"):
        load_config(None, ["algo.value_lr=0"])
