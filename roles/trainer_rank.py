"""A learner's rank other than 0 in its training group (``trainer.count`` > 1).

It binds no chunk socket, publishes no weights and writes no checkpoints: it takes the leader's
state when the group forms, then trains each update the leader posts, its slice of every
minibatch, gradients all-reduced (``rlvla3/algo/group_updates.py``); sharded, it also joins the
leader's critic passes and gatherings of the whole weights. When a peer leaves the group
(``GroupWatch``) or the leader's store goes away, it leaves with an error, so the launchers
restart the whole group from the last checkpoint.
"""

from __future__ import annotations

from rlvla3.algo.group_updates import GroupUpdates
from rlvla3.policy.base import ActorCritic
from rlvla3.runtime.group_watch import GroupWatch
from rlvla3.runtime.role import Role
from rlvla3.runtime.train_group import POLL_IDLE_S, STOP, Message


class FollowerRank:
    """The loop of a follower rank.

    Args:
        role: the rank's role process.
        updates: its updates, over the group.
        reference: the KL term's frozen policy (None without one).
        busy_what: what the role says it is busy with during an update.
    """

    def __init__(
        self,
        role: Role,
        updates: GroupUpdates,
        reference: ActorCritic | None,
        busy_what: str = "update (follower rank)",
    ) -> None:
        assert updates.group is not None
        self.role, self.updates, self.reference = role, updates, reference
        self.group = updates.group
        self.busy_what = busy_what
        updates.share_state(should_stop=role.stop_event.is_set)
        self.watch = GroupWatch(role, self.group)
        self.done = 0
        """Updates trained."""
        self.told_to_stop = False

    def step(self) -> None:
        """Train the next posted update, or wait a moment for it; raise when the group broke."""
        self.watch.check()
        message = self.group.poll(POLL_IDLE_S)  # (seen as soon as it is posted)
        if message is None:
            return
        if message.kind == STOP:
            self.told_to_stop = True
            self.role.stop_event.set()
        else:
            self._follow(message)

    def finish(self, timeout_s: float) -> None:
        """At a stop: go on following until the leader says ``stop`` (it may have posted an
        update this rank must take part in), its store goes away, or ``timeout_s`` passes."""
        if not self.told_to_stop:
            self.told_to_stop = self.group.follow_to_stop(self._follow, timeout_s)
        if not self.told_to_stop:
            self.role.log.warning(
                "the leader did not say stop (it is gone, or not within %.0fs)", timeout_s
            )

    def _follow(self, message: Message) -> None:
        with self.role.busy(self.busy_what):
            metrics = self.updates.follow(message, self.reference)
        self.done += metrics is not None  # (not a sharded group's evaluation or gathering)
