"""One update of a learner, done by every rank of its training group alike.

Rank 0 (the leader) builds the batch from the chunks it holds, then posts it with what the update
needs (policy coefficient, learning rates, the shuffles' seed) to the other ranks, and all of them
run ``Objective.update`` on it with the gradient all-reduce (``rlvla3/algo/data_parallel.py``).
Without a group (``count: 1``) an update is ``Objective.update`` as it always was.

Sharded (``settings.shard``, ``rlvla3/algo/sharding.py``), a forward pass and a gathering of the
whole weights are collectives, so the leader posts them too before it enters them: ``evaluate``
(its critic pass over a batch it builds) and ``gather`` (weights to publish, a checkpoint).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rlvla3.algo.batch import Batch
from rlvla3.algo.data_parallel import (
    DataParallel,
    flatten_tree,
    shuffle_generator,
    unflatten_tree,
)
from rlvla3.algo.group_state import GATHER, GroupState
from rlvla3.algo.learners import Objective
from rlvla3.algo.sharding import evaluate_shared
from rlvla3.policy.base import ActorCritic, EvalOutput
from rlvla3.runtime.train_group import GroupError, Message, TrainGroup

UPDATE, EVALUATE = "update", "evaluate"
"""The kinds of the leader's messages that every rank acts on alike (and ``GATHER``)."""


class GroupUpdates:
    """The updates of one rank (or of a lone learner).

    Args:
        objective: the learner's loss and update.
        group, policy, optimizer, rebuild_optimizer: the rank's ``GroupState``
            (``rlvla3/algo/group_state.py``; ``rebuild_optimizer`` set: the sharded mode).
    """

    def __init__(
        self,
        group: TrainGroup | None,
        objective: Objective,
        policy: ActorCritic,
        optimizer: torch.optim.Optimizer,
        rebuild_optimizer: Callable[[ActorCritic], torch.optim.Optimizer] | None = None,
    ) -> None:
        self.group, self.objective = group, objective
        self.state = GroupState(group, policy, optimizer, rebuild_optimizer)
        self.data_parallel = None if group is None else DataParallel(group, self.state.sharded)
        self.posted_bytes = 0
        """Bytes of batches the leader posted so far."""
        self.post_s = 0.0
        """Seconds the leader spent posting them."""

    @property
    def policy(self) -> ActorCritic:
        """The rank's policy (sharded or whole)."""
        return self.state.policy  # type: ignore[return-value]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (sharded: over the shards, once ``share_state`` has run)."""
        return self.state.optimizer

    def share_state(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Every rank starts from the leader's weights and optimizer state (what it resumed);
        a follower waits for them until ``should_stop`` (``GroupState.share``)."""
        self.state.share(should_stop)

    @property
    def sharded(self) -> bool:
        """Whether the ranks hold shards of the policy (``settings.shard``)."""
        return self.state.sharded

    def whole(self, optimizer: bool = False) -> tuple[Any, Any]:
        """The leader: the policy (and optimizer) whole, as ``GroupState.whole``."""
        return self.state.whole(optimizer)

    def batch_policy(self) -> Any:
        """What the leader builds a batch with (its critic pass): the policy, or, sharded, the
        group's shared evaluation of it."""
        return _SharedEvaluation(self) if self.sharded else self.policy

    def lead(
        self, batch: Batch, *, policy_coef: float, reference: ActorCritic | None
    ) -> dict[str, float]:
        """The leader's update on ``batch`` (every rank's, when there is a group)."""
        if self.group is None:
            return self.objective.update(
                self.policy, self.optimizer, batch, policy_coef=policy_coef, reference=reference
            )
        seed = int(torch.randint(0, 2**62, ()).item())
        info = {
            "policy_coef": policy_coef,
            "seed": seed,
            "lrs": [g["lr"] for g in self.optimizer.param_groups],
        }
        started = time.perf_counter()
        self.posted_bytes += self.group.post(UPDATE, info, flatten_tree(batch))
        self.post_s += time.perf_counter() - started
        metrics = self._update(batch, policy_coef, seed, reference)
        if self.sharded:  # FSDP's all-gathers needed every rank: each read the headers
            self.group.all_read()
        return metrics

    def follow(self, message: Message, reference: ActorCritic | None) -> dict[str, float] | None:
        """A follower's part of what the leader posted as ``message``: an update (returns its
        metrics), or, sharded, a shared evaluation or a gathering (returns None)."""
        if self.sharded and message.kind == EVALUATE:
            batch = unflatten_tree(message.tensors)
            evaluate_shared(self.policy, self.group, batch["obs"], batch["actions"])
            return None
        if message.kind == GATHER:
            self.state.join(message)
            return None
        if message.kind != UPDATE:
            raise GroupError(f"group message: {message.kind!r} where an update was expected")
        info = message.info
        lrs = info.get("lrs")
        if not isinstance(lrs, list) or len(lrs) != len(self.optimizer.param_groups):
            raise GroupError(f"group message update: lrs {lrs!r:.80} do not fit the optimizer")
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = float(lr)
        batch = unflatten_tree(message.tensors)
        return self._update(batch, float(info["policy_coef"]), int(info["seed"]), reference)

    def _update(
        self, batch: Batch, policy_coef: float, seed: int, reference: ActorCritic | None
    ) -> dict[str, float]:
        return self.objective.update(
            self.policy,
            self.optimizer,
            batch,
            policy_coef=policy_coef,
            reference=reference,
            generator=shuffle_generator(seed),
            data_parallel=self.data_parallel,
        )


class _SharedEvaluation:
    """The leader's stand-in for a sharded policy in a batch's critic pass: posts the batch
    (``evaluate``), so that every rank scores its slice (``evaluate_shared``)."""

    def __init__(self, updates: GroupUpdates) -> None:
        self.updates = updates

    def evaluate(self, obs: dict[str, torch.Tensor], actions: torch.Tensor) -> EvalOutput:
        """``ActorCritic.evaluate``, without gradients, by the group."""
        group = self.updates.group
        assert group is not None
        group.post(EVALUATE, {}, flatten_tree({"obs": obs, "actions": actions}))
        return evaluate_shared(self.updates.policy, group, obs, actions)
