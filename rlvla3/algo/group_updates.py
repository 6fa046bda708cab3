"""One update of a learner, done by every rank of its training group alike.

Rank 0 (the leader) builds the batch from the chunks it holds, then posts it with what the update
needs (policy coefficient, learning rates, the shuffles' seed) to the other ranks, and all of them
run ``Objective.update`` on it with the gradient all-reduce (``rlvla3/algo/data_parallel.py``).
Without a group (``count: 1``) an update is ``Objective.update`` as it always was.
"""

from __future__ import annotations

import time
from collections.abc import Callable

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
from rlvla3.policy.base import ActorCritic
from rlvla3.runtime.train_group import GroupError, Message, TrainGroup


class GroupUpdates:
    """The updates of one rank (or of a lone learner).

    Args:
        group: the training group, None for a lone learner.
        objective: the learner's loss and update.
        policy, optimizer: what trains.
    """

    def __init__(
        self,
        group: TrainGroup | None,
        objective: Objective,
        policy: ActorCritic,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self.group, self.objective = group, objective
        self.policy, self.optimizer = policy, optimizer
        self.data_parallel = None if group is None else DataParallel(group)
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
            return
        message = self.group.wait(should_stop, lambda: time.sleep(0.02))
        if message is None:
            raise InterruptedError("stopped while waiting for the leader's state")
        load_state(message, self.policy, self.optimizer)

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
        self.posted_bytes += self.group.post("update", info, flatten_tree(batch))
        self.post_s += time.perf_counter() - started
        return self._update(batch, policy_coef, seed, reference)

    def follow(self, message: Message, reference: ActorCritic | None) -> dict[str, float]:
        """A follower's part of the update the leader posted as ``message``."""
        if message.kind != "update":
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
