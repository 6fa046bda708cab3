"""What a training group's ranks train, kept alike: the leader's weights and optimizer state
shared when the group forms, sharded over the ranks in the sharded mode (``settings.shard``),
and gathered whole again for publishing and checkpoints.

Both learner roles use it (the RL trainer through ``rlvla3/algo/group_updates.py``, the SFT
trainer directly). Sharded, a gathering is a collective: the leader posts ``gather`` before it
enters one, and every other rank joins it on that message (``join``).

What a rank holds whole, sharded: when the group forms, every rank shards its policy first; the
leader then sends its whole weights and optimizer state (it resumed them: it holds them until
they are sent) one tensor at a time, and every other rank keeps its slice of each as it comes.
A gathering holds whole tensors on the leader alone, in CPU memory (``rlvla3/algo/sharding.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlvla3.algo.data_parallel import load_state, load_tensors, post_state, whole_state
from rlvla3.algo.sharding import gather_module, gather_optimizer, shard_training
from rlvla3.runtime.train_group import GroupError, Message, TrainGroup

GATHER = "gather"
"""The kind of the leader's message that has every rank gather the whole state with it."""


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
        """Every rank starts from the leader's weights and optimizer state (what it resumed);
        sharded, each keeps only its slice of them. A follower waits for them until
        ``should_stop``. Returns the leader's ``info`` (plain fields: where it stands), on
        every rank."""
        if self.group is None:
            return info or {}
        leader = whole_state(self.policy, self.optimizer) if self.group.leader else {}
        if self.rebuild_optimizer is not None:  # shard first: the state arrives as slices
            self.optimizer = shard_training(
                self.policy, self.optimizer, self.rebuild_optimizer, self.group
            )
        if self.group.leader:
            post_state(self.group, leader, info)
            if self.sharded:  # its own state onto the shards, as the others take it
                load_tensors(leader.items(), self.policy, self.optimizer)
            return info or {}
        message = self.group.wait(should_stop, lazy=True)
        if message is None:
            raise InterruptedError("stopped while waiting for the leader's state")
        return load_state(self.group, message, self.policy, self.optimizer)

    def whole(self, optimizer: bool = False) -> tuple[Any, Any]:
        """The leader: the policy (and, with ``optimizer``, the optimizer) as publishing and
        checkpoints read them: themselves, or, sharded, their whole state gathered from every
        rank (the leader posts ``gather`` first, so the others join)."""
        if not self.sharded:
            return self.policy, self.optimizer
        assert self.group is not None and self.group.leader
        self.group.post(GATHER, {"optimizer": optimizer}, {})
        module = gather_module(self.policy)
        gathered = gather_optimizer(self.optimizer) if optimizer else None
        self.group.all_read()  # every rank has joined the all-gathers: it read the headers
        return module, gathered

    def join(self, message: Message) -> None:
        """A follower: take part in the gathering the leader posted as ``message`` (it keeps
        nothing of it: one whole tensor at a time, dropped before the next)."""
        if not (self.sharded and message.kind == GATHER):
            raise GroupError(f"group message: {message.kind!r} where a gather was expected")
        gather_module(self.policy, keep=False)
        if message.info.get("optimizer"):
            gather_optimizer(self.optimizer, keep=False)
