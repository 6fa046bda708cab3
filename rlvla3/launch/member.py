"""Another node's part in a run (any node but the head): it joins the head's Redis, follows the
head's end of the run, and ends the run on its own when the head stays out of reach for
``run.head_timeout_s`` or one of its roles fails for good."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from urllib.parse import urlparse

from rlvla3.config.typed_load import ConfigError
from rlvla3.launch.cluster import own_address
from rlvla3.launch.node_run import BUSY, TICK_S, JoinAborted, NodeLink, NodeRun, NodeSetup
from rlvla3.launch.progress import member_line
from rlvla3.launch.rendezvous import JoinError, find_head_store
from rlvla3.launch.run_dir import claim_member_run_dir, prepare_run_dir
from rlvla3.launch.stop_reason import StopKind, StopReason
from rlvla3.launch.supervisor import try_bookkeeping


class MemberPolicy:
    """A member node's side of a node's launcher (a ``NodePolicy``).

    Raises:
        ConfigError: no role is placed on this node.
    """

    def __init__(self, setup: NodeSetup) -> None:
        self.setup = setup
        self._last_contact = 0.0  # when the head was last seen alive, monotonic seconds
        cfg = setup.cfg
        placed = {n for role in cfg.roles for n in cfg.placement(role)}
        if not placed & set(setup.my_nodes()):
            raise ConfigError(f"roles: no role processes to start on node {setup.seat.label!r}")

    @contextlib.contextmanager
    def join(self) -> Iterator[NodeLink]:
        """Wait for the head's Redis and launch mark, then make this node's run dir."""
        cfg, seat, run_dir = self.setup.cfg, self.setup.seat, self.setup.run_dir
        try:
            joined = find_head_store(cfg, seat, run_dir, self.setup.stop_requested, self.setup.echo)
        except InterruptedError:
            raise JoinAborted(130) from None
        except JoinError as err:
            self.setup.echo(str(err))
            raise JoinAborted(1) from None
        address = own_address(seat, urlparse(joined.store.url).hostname)
        claim_member_run_dir(run_dir, cfg, seat, joined, self.setup.echo, self.setup.resume)
        prepare_run_dir(run_dir, seat, address, joined.secret)
        self._last_contact = time.monotonic()
        yield NodeLink(joined.store, joined.secret, address, joined.store.registry(cfg.run.name))

    def before_tend(self, run: NodeRun) -> None:
        pass  # the head keeps the run's Redis up

    def role_failed(self, run: NodeRun, reason: StopReason) -> StopReason:
        """Ask the head to end the run too."""
        request = f"{reason.text} on node {self.setup.seat.label}"
        try_bookkeeping(run.link.registry.request_stop, request)
        return reason

    def check(self, run: NodeRun, now: float) -> StopReason | None:
        """The head's end of the run, or the head's absence for too long."""
        end = run.link.registry.run_end()
        if end is not None:
            text, code = end
            return StopReason(
                StopKind.HEAD_ENDED, f"the head ended the run: {text}", head_exit_code=code
            )
        if self._head_alive(run):
            self._last_contact = now
        return self._head_lost(now)

    def unreachable(self, run: NodeRun, now: float, err: Exception) -> StopReason | None:
        """A network outage: ride it out up to ``run.head_timeout_s``."""
        return self._head_lost(now)

    def _head_alive(self, run: NodeRun) -> bool:
        head = self.setup.seat.head.name
        return any(
            rec.node == head and rec.alive and rec.status in BUSY
            for rec in run.link.registry.launchers()
        )

    def _head_lost(self, now: float) -> StopReason | None:
        lost_s = now - self._last_contact
        if lost_s < self.setup.cfg.run.head_timeout_s:
            return None
        return StopReason(
            StopKind.HEAD_LOST,
            f"lost the head node {self.setup.seat.head.name!r} for {lost_s:.0f}s "
            "(run.head_timeout_s)",
        )

    def progress_line(self, run: NodeRun, now: float) -> str | None:
        lost_s = now - self._last_contact
        return member_line(
            now - run.started,
            self.setup.seat.label,
            run.roles.running,
            len(run.roles.procs),
            run.roles.restarts,
            self.setup.seat.head.name,
            None if lost_s < 2 * TICK_S + 1 else lost_s,
        )

    def announce_end(self, run: NodeRun, reason: StopReason, exit_code: int) -> None:
        pass  # the head ends the run for every node

    def finish(self, run: NodeRun, reason: StopReason, exit_code: int, wall_s: float) -> None:
        try_bookkeeping(lambda: run.heartbeat.beat("done" if exit_code == 0 else "error"))
