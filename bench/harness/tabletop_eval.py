"""The table-top probes' held-out measure: a greedy policy on fresh seeded episodes, stepped as
one batch, scored by success and by how far its actions are from the scripted expert's.

``bench/sft_tabletop_probe.py`` evaluates as it trains with it; ``bench/rl_tabletop_probe.py``
once at the end.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sim.envs import make_env
from sim.experts import TableTopExpert


@torch.no_grad()
def evaluate(
    policy: Any,
    env_id: str,
    num_episodes: int,
    seed: int,
    drop_velocity: bool = False,
    kwargs: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Greedy success rate on ``num_episodes`` fresh episodes, stepped as one batch.

    Also ``action_err``: mean L2 distance between the policy's env action and the clean scripted
    expert's action in the states the policy visits (0 = imitates perfectly), and ``first_err``
    on the first step of each episode (start states, which the demos cover)."""
    was_training = policy.training
    policy.eval()
    envs = [make_env(env_id, seed=seed + i, **(kwargs or {})) for i in range(num_episodes)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    live = list(range(num_episodes))
    success = np.zeros(num_episodes, bool)
    length = np.zeros(num_episodes, int)
    expert, errors, first = TableTopExpert(), [], []
    while live:
        batch = {k: torch.from_numpy(np.stack([obs[i][k] for i in live])) for k in obs[live[0]]}
        if drop_velocity:
            batch["proprio"][:, 2:] = 0.0
        actions = policy.to_env_action(policy.act(batch, deterministic=True).action).numpy()
        still = []
        for i, action in zip(live, actions, strict=True):
            err = float(np.linalg.norm(action - expert.act(envs[i].privileged_state())))
            errors.append(err)
            if length[i] == 0:
                first.append(err)
            obs[i], _, terminated, truncated, info = envs[i].step(action)
            length[i] += 1
            if terminated or truncated:
                success[i] = bool(info.get("success", False))
            else:
                still.append(i)
        live = still
    policy.train(was_training)
    return {
        "success_rate": float(success.mean()),
        "mean_len": float(length.mean()),
        "action_err": float(np.mean(errors)),
        "first_err": float(np.mean(first)),
    }
