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
    load_state,
    post_state,
    shuffle_generator,
    unflatten_tree,
)
from rlvla3.algo.learners import Objective
from rlvla3.algo.sharding import (
    evaluate_shared,
    gather_module,
    gather_optimizer,
    shard_training,
)
from rlvla3.policy.base import ActorCritic, EvalOutput
from rlvla3.runtime.train_group import GroupError, Message, TrainGroup

UPDATE, EVALUATE, GATHER = "update", "evaluate", "gather"
"""The kinds of the leader's messages that every rank acts on alike."""


class GroupUpdates:
    """The updates of one rank (or of a lone learner).

    Args:
        group: the training group, None for a lone learner.
        objective: the learner's loss and update.
        policy, optimizer: what trains.
        rebuild_optimizer: sharded mode (None: every rank holds the whole model): builds the
            optimizer over the policy once ``share_state`` has sharded it.
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
        self.policy, self.optimizer = policy, optimizer
        self.rebuild_optimizer = None if group is None else rebuild_optimizer
        sharded = self.rebuild_optimizer is not None
        self.data_parallel = None if group is None else DataParallel(group, sharded)
        self.posted_bytes = 0
        """Bytes of batches the leader posted so far."""
        self.post_s = 0.0
        """Seconds the leader spent posting them."""

    def share_state(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Every rank starts from the leader's weights and optimizer state (what it resumed);
        a follower waits for them until ``should_stop``."""
        if self.group is None:
            return
        if self.group.leader:
            post_state(self.group, self.policy, self.optimizer)
        else:
            message = self.group.wait(should_stop, lambda: time.sleep(0.02))
            if message is None:
                raise InterruptedError("stopped while waiting for the leader's state")
            load_state(message, self.policy, self.optimizer)
        if self.rebuild_optimizer is not None:  # every rank starts alike, then keeps its shard
            self.optimizer = shard_training(
                self.policy, self.optimizer, self.rebuild_optimizer, self.group
            )

    @property
    def sharded(self) -> bool:
        """Whether the ranks hold shards of the policy (``settings.shard``)."""
        return self.rebuild_optimizer is not None

    def whole(self, optimizer: bool = False) -> tuple[Any, Any]:
        """The leader: the policy (and, with ``optimizer``, the optimizer) as publishing and
        checkpoints read them: themselves, or, sharded, their whole state gathered from every
        rank (the leader posts ``gather`` first, so the others join)."""
        if not self.sharded:
            return self.policy, self.optimizer
        assert self.group is not None and self.group.leader
        self.group.post(GATHER, {"optimizer": optimizer}, {})
        return self._gather(optimizer)

    def _gather(self, optimizer: bool) -> tuple[Any, Any]:
        module = gather_module(self.policy)
        return module, gather_optimizer(self.optimizer) if optimizer else None

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
        return self._update(batch, policy_coef, seed, reference)

    def follow(self, message: Message, reference: ActorCritic | None) -> dict[str, float] | None:
        """A follower's part of what the leader posted as ``message``: an update (returns its
        metrics), or, sharded, a shared evaluation or a gathering (returns None)."""
        if self.sharded and message.kind == EVALUATE:
            batch = unflatten_tree(message.tensors)
            evaluate_shared(self.policy, self.group, batch["obs"], batch["actions"])
            return None
        if self.sharded and message.kind == GATHER:
            self._gather(bool(message.info.get("optimizer")))
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
