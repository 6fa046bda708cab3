"""What a training group's ranks train, kept alike: the leader's weights and optimizer state
shared when the group forms, sharded over the ranks in the sharded mode (``settings.shard``),
and gathered whole again for publishing and checkpoints.

Both learner roles use it (the RL trainer through ``rlvla3/algo/group_updates.py``, the SFT
trainer directly). Sharded, a gathering is a collective: the leader posts ``gather`` before it
enters one, and every other rank joins it on that message (``join``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rlvla3.algo.data_parallel import load_state, post_state
from rlvla3.algo.sharding import gather_module, gather_optimizer, shard_training
from rlvla3.runtime.train_group import GroupError, Message, TrainGroup

GATHER = "gather"
"""The kind of the leader's message that has every rank gather the whole state with it."""

_IDLE_S = 0.02  # between a follower's polls for the leader's state


class GroupState:
    """A rank's policy and optimizer in its group (or a lone learner's, unchanged).

    Args:
        group: the training group, None for a lone learner.
        policy, optimizer: what trains.
        rebuild_optimizer: sharded mode (None: every rank holds the whole model): builds the
            optimizer over the policy once ``share`` has sharded it.
    """

    def __init__(
        self,
        group: TrainGroup | None,
        policy: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        rebuild_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    ) -> None:
        self.group, self.policy, self.optimizer = group, policy, optimizer
        self.rebuild_optimizer = None if group is None else rebuild_optimizer

    @property
    def sharded(self) -> bool:
        """Whether the ranks hold shards of the policy (``settings.shard``)."""
        return self.rebuild_optimizer is not None

    def say_sharded(self, log: Any) -> None:
        """Log that the policy is sharded (nothing when it is not)."""
        if self.sharded and self.group is not None:
            n = self.group.world_size
            log.info(
                "policy sharded over %d ranks: this rank holds 1/%d of its parameters and "
                "optimizer state (settings.shard)",
                n,
                n,
            )

    def share(
        self, should_stop: Callable[[], bool] = lambda: False, info: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Every rank starts from the leader's weights and optimizer state (what it resumed),
        then, sharded, keeps its shard; a follower waits for them until ``should_stop``.
        Returns the leader's ``info`` (plain fields: where it stands), on every rank."""
        if self.group is None:
            return info or {}
        if self.group.leader:
            post_state(self.group, self.policy, self.optimizer, info)
            shared = info or {}
        else:
            message = self.group.wait(should_stop, lambda: time.sleep(_IDLE_S))
            if message is None:
                raise InterruptedError("stopped while waiting for the leader's state")
            shared = load_state(message, self.policy, self.optimizer)
        if self.rebuild_optimizer is not None:  # every rank starts alike, then keeps its shard
            self.optimizer = shard_training(
                self.policy, self.optimizer, self.rebuild_optimizer, self.group
            )
        return shared

    def whole(self, optimizer: bool = False) -> tuple[Any, Any]:
        """The leader: the policy (and, with ``optimizer``, the optimizer) as publishing and
        checkpoints read them: themselves, or, sharded, their whole state gathered from every
        rank (the leader posts ``gather`` first, so the others join)."""
        if not self.sharded:
            return self.policy, self.optimizer
        assert self.group is not None and self.group.leader
        self.group.post(GATHER, {"optimizer": optimizer}, {})
        return self._gather(optimizer)

    def join(self, message: Message) -> None:
        """A follower: take part in the gathering the leader posted as ``message``."""
        if not (self.sharded and message.kind == GATHER):
            raise GroupError(f"group message: {message.kind!r} where a gather was expected")
        self._gather(bool(message.info.get("optimizer")))

    def _gather(self, optimizer: bool) -> tuple[Any, Any]:
        module = gather_module(self.policy)
        return module, gather_optimizer(self.optimizer) if optimizer else None
