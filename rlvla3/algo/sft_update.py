"""One supervised (behaviour-cloning) step, alone or as one rank of a data-parallel group.

The loss is the negative log-likelihood of the demonstrated actions, averaged over the samples
of the *global* batch: each rank sums its own samples' terms and divides by the sample count of
all ranks together (one small all-reduce), and the gradients are summed over the ranks. So N
ranks with a batch each take the step one process would take on the union of their batches.

Sharded (``settings.shard``, ``rlvla3/algo/sharding.py``), FSDP sums the gradients during the
backward pass: each rank's loss, its sum over the global count, is already its weighted share,
so nothing is left to reduce after it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from rlvla3.algo.data_parallel import DataParallel
from rlvla3.algo.optim import trainable_parameters
from rlvla3.algo.sharding import whole
from rlvla3.policy.base import ActorCritic

_MAX_GRAD_NORM = 1.0


def sft_update(
    policy: ActorCritic,
    optimizer: torch.optim.Optimizer,
    evaluate: Callable[..., object],
    obs: dict[str, torch.Tensor],
    actions: torch.Tensor,
    *,
    precision: Callable[[], AbstractContextManager[object]],
    data_parallel: DataParallel | None = None,
) -> tuple[float, float]:
    """One optimizer step on this rank's ``obs`` and ``actions``; returns the global batch's
    mean loss and the gradient norm before clipping.

    Args:
        evaluate: the policy family's batch evaluation (``rlvla3/policy/sft_tokens.py``).
        precision: the autocast context of the forward pass.
        data_parallel: the group's ranks (None: a lone SFT trainer).
    """
    with precision():
        nll = -evaluate(obs, actions).log_prob
    local = nll.float().sum()
    totals = torch.stack([local.detach(), torch.tensor(float(nll.numel()), device=local.device)])
    if data_parallel is not None:
        data_parallel.group.all_reduce_sum_(totals)
    loss = local / totals[1]
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = trainable_parameters(policy)
    if data_parallel is not None:
        data_parallel.reduce_gradients(params, weight=1.0)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, _MAX_GRAD_NORM)
    optimizer.step()
    return (totals[0] / totals[1]).item(), whole(grad_norm).item()
