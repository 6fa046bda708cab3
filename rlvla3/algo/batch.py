"""Turn trajectory chunks into one PPO training batch, with the configured off-policy correction
(``build_batch``; ``build_grpo_batch`` for GRPO's group-relative advantages).

- ``none``: GAE on the behaviour values; PPO's ratio clipping is the only correction.
- ``truncated_is``: GAE advantages, and each sample's loss weighted by min(pi/mu, 1).
- ``vtrace``: V-trace value targets and advantages from the current policy's values/log-probs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rlvla3.algo.advantages import compute_gae, truncated_importance_weights, vtrace
from rlvla3.config.run_config import AlgoConfig
from rlvla3.policy.base import ActorCritic
from transport.messages import TrajectoryChunk

Batch = dict[str, torch.Tensor | dict[str, torch.Tensor]]


def chunk_staleness(chunk: TrajectoryChunk, version: int) -> int:
    """How many versions behind ``version`` the oldest step of ``chunk`` is; negative (how far
    ahead) when any step claims a version after ``version``: from the future, which no chunk
    can honestly be (``keep_chunk`` never keeps one)."""
    newest = int(chunk.policy_versions.max())
    if newest > version:
        return version - newest
    return version - int(chunk.policy_versions.min())


def keep_chunk(staleness: int, *, max_staleness: int, on_policy_only: bool) -> bool:
    """Whether a chunk this many versions old is trained on.

    ``on_policy_only`` (``sync`` and ``async_rollout`` modes: training per round) keeps only
    chunks of the current version; otherwise up to ``max_staleness`` versions of lag are kept.
    A chunk from the future (negative staleness) is a bookkeeping bug and is never kept.
    """
    if staleness < 0:
        return False
    return staleness == 0 if on_policy_only else staleness <= max_staleness


def build_batch(
    chunks: Sequence[TrajectoryChunk], policy: ActorCritic, algo: AlgoConfig, device: torch.device
) -> Batch:
    """Flat batch for ``ppo_update``: obs, actions, log_probs, values, advantages, returns[, is_weights]."""
    obs = {k: _cat([c.obs[k] for c in chunks], device) for k in chunks[0].obs}
    actions = _cat([c.actions for c in chunks], device)
    behaviour_log_probs = _cat([c.log_probs for c in chunks], device)
    behaviour_values = _cat([c.values for c in chunks], device)
    batch: Batch = {
        "obs": obs,
        "actions": actions,
        "log_probs": behaviour_log_probs,
        "values": behaviour_values,
    }
    if algo.correction == "none":
        target_log_probs, values = None, behaviour_values
    else:
        with torch.no_grad():
            out = policy.evaluate(obs, actions)
        target_log_probs, values = out.log_prob, out.value
    advantages, returns = [], []
    offset = 0
    for c in chunks:
        n = len(c.rewards)
        sl = slice(offset, offset + n)
        rewards = torch.tensor(c.rewards, device=device)  # (received arrays are read-only)
        ended = c.terminated if algo.bootstrap_truncated else c.terminated | c.truncated
        dones = torch.tensor(ended, device=device)
        if algo.correction == "vtrace":
            vs, adv = vtrace(
                behaviour_log_probs[sl],
                target_log_probs[sl],
                rewards,
                values[sl],
                c.bootstrap_value,
                algo.gamma,
                dones=dones,
            )
            advantages.append(adv)
            returns.append(vs)
        else:
            adv, ret = compute_gae(
                rewards, values[sl], c.bootstrap_value, algo.gamma, algo.lam, dones
            )
            advantages.append(adv)
            returns.append(ret)
        offset += n
    batch["advantages"] = torch.cat(advantages)
    batch["returns"] = torch.cat(returns)
    if algo.correction == "truncated_is":
        batch["is_weights"] = truncated_importance_weights(behaviour_log_probs, target_log_probs)
    return batch


def _cat(arrays: list[np.ndarray], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(arrays)).to(device)


def build_grpo_batch(
    episodes: Sequence[tuple[TrajectoryChunk, float]],
    policy: ActorCritic,
    algo: AlgoConfig,
    device: torch.device,
    version: int,
) -> tuple[Batch | None, int]:
    """Flat batch for ``ppo_update`` from GRPO chunks, each with its episode's group-relative
    advantage (``rlvla3/algo/grpo.py``). Steps more than ``algo.max_staleness`` versions behind
    ``version`` are left out (per sample); returns the batch (None when no step is left) and
    how many steps were left out. No critic: returns and values are zeros (train with
    ``vf_coef=0``)."""
    keep = [
        version - np.asarray(c.policy_versions, np.int64) <= algo.max_staleness for c, _ in episodes
    ]
    left_out = sum(int((~k).sum()) for k in keep)
    if not any(k.any() for k in keep):
        return None, left_out
    obs = {
        key: _cat([c.obs[key][k] for (c, _), k in zip(episodes, keep, strict=True)], device)
        for key in episodes[0][0].obs
    }
    actions = _cat([c.actions[k] for (c, _), k in zip(episodes, keep, strict=True)], device)
    log_probs = _cat([c.log_probs[k] for (c, _), k in zip(episodes, keep, strict=True)], device)
    advantages = torch.cat(
        [
            torch.full((int(k.sum()),), adv, dtype=torch.float32, device=device)
            for (_, adv), k in zip(episodes, keep, strict=True)
        ]
    )
    zeros = torch.zeros_like(advantages)
    batch: Batch = {
        "obs": obs,
        "actions": actions,
        "log_probs": log_probs,
        "values": zeros,
        "advantages": advantages,
        "returns": zeros,
    }
    if algo.correction == "truncated_is":
        with torch.no_grad():
            target = policy.evaluate(obs, actions).log_prob
        batch["is_weights"] = truncated_importance_weights(log_probs, target)
    return batch, left_out
