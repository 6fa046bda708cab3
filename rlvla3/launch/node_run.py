"""What one node's launcher works with, shared by its core (``rlvla3/launch/launcher.py``) and
its part in the run: the head's (``rlvla3/launch/head.py``) or another node's
(``rlvla3/launch/member.py``), each a ``NodePolicy``."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rlvla3.config.run_config import Config
from rlvla3.launch.cluster import Seat
from rlvla3.launch.processes import SpawnContext
from rlvla3.launch.rendezvous import RunStore
from rlvla3.launch.stop_reason import StopKind, StopReason
from rlvla3.launch.supervisor import REDIS_ERRORS, RoleSupervisor
from rlvla3.runtime.registry import Registry

TICK_S = 0.2
"""How often a launcher tends its roles and checks the run."""
BUSY = ("starting", "running", "stopping")
"""The statuses of a role or launcher that has not ended yet."""


class RunHooks(Protocol):
    """What a command that launches a run for a job of its own (``rlvla3 eval``) adds to the
    head's launcher: called with the run's registry on the head only."""

    def started(self, registry: Registry) -> None:
        """The run's Redis is up and clean; no role has started yet."""

    def check(self, registry: Registry) -> StopReason | None:
        """Every tick: why the run ends now (its job is done), or None to go on."""

    def progress_line(self, registry: Registry, elapsed_s: float) -> str | None:
        """The progress line to print instead of training's, None for none."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSetup:
    """What a node's launcher knows before it joins the run."""

    cfg: Config
    """The validated run config."""
    seat: Seat
    """This launcher's node."""
    run_dir: Path
    """Where the resolved config, logs, checkpoints and reports go."""
    echo: Callable[[str], None]
    """Where progress lines go."""
    stop_requested: threading.Event
    """Set by the first Ctrl-C (or SIGTERM): stop the roles gracefully."""
    kill_requested: threading.Event
    """Set by the second: kill them."""
    hooks: RunHooks | None = None
    """A command's own job in the run (the head alone runs them), None for a training run."""
    resume: bool = False
    """``rlvla3 launch --resume``: keep an earlier run's files in the run dir (its checkpoints),
    on a member node's own run dir too."""

    @property
    def who(self) -> str:
        """``node NAME: `` to begin a line with in a multi-host run, else nothing."""
        return f"node {self.seat.label}: " if self.seat.multi_host else ""

    def my_nodes(self) -> list[str]:
        """The nodes whose roles this launcher runs (every node on one host)."""
        if self.seat.node is None:
            return [n.name for n in self.cfg.all_nodes()]
        return [self.seat.node.name]


@dataclass(frozen=True, slots=True)
class NodeLink:
    """What joining the run gives a node's launcher."""

    store: RunStore
    """The run's Redis."""
    secret: str | None
    """The run secret (multi-host runs), None on one host."""
    address: str
    """This node's address, which its roles bind and advertise."""
    registry: Registry
    """The run's bookkeeping in that Redis."""


class LauncherHeartbeat:
    """This node's launcher heartbeat in a multi-host run (at most once a second while the
    status stays the same); nothing on one host, where no other launcher reads it."""

    def __init__(self, setup: NodeSetup, link: NodeLink) -> None:
        self._setup = setup
        self._link = link
        self._next_beat = 0.0

    def beat(self, status: str) -> None:
        """Record this launcher's ``status`` (``running``, ``stopping``, ``done``, ``error``)."""
        now = time.monotonic()
        if not self._setup.seat.multi_host or (
            status in ("running", "stopping") and now < self._next_beat
        ):
            return
        self._next_beat = now + 1.0
        self._link.registry.launcher_heartbeat(
            self._setup.seat.label,
            ttl_s=self._setup.cfg.run.heartbeat_ttl_s,
            status=status,
            address=self._link.address,
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRun:
    """A joined node whose roles run."""

    setup: NodeSetup
    """What the launcher knew before joining."""
    link: NodeLink
    """What joining gave it."""
    roles: RoleSupervisor
    """This node's role processes."""
    spawn: SpawnContext
    """What they are started with."""
    heartbeat: LauncherHeartbeat
    """This launcher's heartbeat."""
    started: float
    """When the roles started, ``time.monotonic()`` seconds."""


class JoinAborted(Exception):
    """The node did not join the run; the launcher exits with ``exit_code``."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code


class NodePolicy(Protocol):
    """What differs between the head's launcher and another node's; the launcher's core calls
    these in this order on every tick: ``before_tend``, (``role_failed``), ``check`` (or
    ``unreachable`` when Redis was not), ``progress_line``; at the end ``announce_end``, then,
    once the roles stopped, ``finish``."""

    def join(self) -> AbstractContextManager[NodeLink]:
        """Join the run (the head starts it), for as long as the context lasts.

        Raises:
            JoinAborted: the node could not join.
        """

    def before_tend(self, run: NodeRun) -> None:
        """What must be up before the roles are tended."""

    def role_failed(self, run: NodeRun, reason: StopReason) -> StopReason:
        """A role of this node ran out of restarts: why the run ends."""

    def check(self, run: NodeRun, now: float) -> StopReason | None:
        """Why the run ends now, or None to go on."""

    def unreachable(self, run: NodeRun, now: float, err: Exception) -> StopReason | None:
        """Redis could not be reached this tick: why the run ends, or None to ride it out."""

    def progress_line(self, run: NodeRun, now: float) -> str | None:
        """The progress line to print now, None for none."""

    def announce_end(self, run: NodeRun, reason: StopReason, exit_code: int) -> None:
        """The run ends with ``reason`` (before the roles stop)."""

    def finish(self, run: NodeRun, reason: StopReason, exit_code: int, wall_s: float) -> None:
        """The roles have stopped: what remains to be done before the launcher exits."""


def redis_lost(store: RunStore, err: Exception) -> StopReason:
    """The reason a launcher ends when the run's Redis is gone for good."""
    return StopReason(StopKind.REDIS_LOST, f"lost the run's Redis at {store.url} ({err})")


def wait_while(
    busy: Callable[[], bool],
    deadline: float,
    kill_requested: threading.Event,
    on_tick: Callable[[], None] = lambda: None,
) -> None:
    """Wait, a tick at a time, while ``busy()`` and before ``deadline`` (monotonic seconds);
    a kill request or an unreachable Redis ends the wait."""
    try:
        while busy() and time.monotonic() < deadline:
            on_tick()
            if kill_requested.wait(TICK_S):
                return
    except REDIS_ERRORS:
        pass
