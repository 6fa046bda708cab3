"""The launcher: starts the role processes of one node of a run, supervises them, stops them.

One YAML describes the run. ``rlvla3 launch cfg.yaml`` runs every node's roles on this host;
``--node NAME`` (or a Slurm step, see ``rlvla3/launch/cluster.py``) runs one node's. Every
node's launcher runs the same tick: tend its roles (``RoleSupervisor``,
``rlvla3/launch/supervisor.py``, restarts those that exit with an error or stall), beat, ask
its part in the run whether the run ends, print progress. That part is the head's
(``rlvla3/launch/head.py``: the run's Redis, the stop rules, the end) or another node's
(``rlvla3/launch/member.py``: follow the head's end, stop when the head is out of reach for
``run.head_timeout_s``). The first Ctrl-C (or SIGTERM) stops all roles gracefully, the second
kills them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rlvla3.config.role_table import STOP_ORDER
from rlvla3.config.run_config import Config
from rlvla3.config.typed_load import ConfigError
from rlvla3.launch import netaddr
from rlvla3.launch.cluster import Seat
from rlvla3.launch.head import HeadPolicy
from rlvla3.launch.member import MemberPolicy
from rlvla3.launch.node_run import (
    BUSY,
    TICK_S,
    JoinAborted,
    LauncherHeartbeat,
    NodeLink,
    NodePolicy,
    NodeRun,
    NodeSetup,
    RunHooks,
    redis_lost,
    wait_while,
)
from rlvla3.launch.processes import SpawnContext, stop_group, stop_stages
from rlvla3.launch.run_dir import config_path
from rlvla3.launch.stop_reason import (
    LAUNCHER_FAILED,
    STOPPED_BY_SIGNAL,
    StopKind,
    StopReason,
)
from rlvla3.launch.supervisor import REDIS_ERRORS, RoleSupervisor, try_bookkeeping
from rlvla3.runtime.signals import install_stop_signals


class Launcher:
    """Starts, supervises and stops the role processes of one node of a run.

    Args:
        cfg: the validated run config.
        run_dir: where the resolved config, logs, checkpoints and reports go.
        seat: this launcher's node (``rlvla3.launch.cluster.find_seat``).
        echo: where progress lines go.
        hooks: a command's own job in the run (``rlvla3 eval``), run by the head.
        resume: ``rlvla3 launch --resume``: a member node keeps an earlier run's files in its
            own run dir (the head's command keeps its own).

    Raises:
        ConfigError: no role would run (on this node).
    """

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        seat: Seat,
        echo: Callable[[str], None] = print,
        hooks: RunHooks | None = None,
        resume: bool = False,
    ) -> None:
        if cfg.total_processes() == 0:
            raise ConfigError(
                "roles: no role processes to start in this config (a run "
                "needs roles: see launch/cartpole.yaml)"
            )
        self.setup = NodeSetup(
            cfg=cfg,
            seat=seat,
            run_dir=run_dir,
            echo=echo,
            stop_requested=threading.Event(),
            kill_requested=threading.Event(),
            hooks=hooks,
            resume=resume,
        )
        self.policy: NodePolicy = (
            HeadPolicy(self.setup) if seat.is_head else MemberPolicy(self.setup)
        )
        self._next_progress = 0.0

    def run(self) -> int:
        """Run this node to the end. Returns 0 on a clean stop, 1 if a role failed for good,
        the run's Redis (or, on other nodes, the head) was lost or the head ended the run with
        an error, 130 if stopped by a signal (Ctrl-C)."""
        install_stop_signals(self._on_signal)
        try:
            with self.policy.join() as link:
                return self._run_roles(link)
        except JoinAborted as aborted:
            return aborted.exit_code

    # --- the run -------------------------------------------------------------------------------
    def _run_roles(self, link: NodeLink) -> int:
        setup = self.setup
        run = NodeRun(
            setup=setup,
            link=link,
            roles=RoleSupervisor(
                setup.cfg, setup.run_dir, link.registry, setup.echo, setup.stop_requested
            ),
            spawn=self._spawn_context(link),
            heartbeat=LauncherHeartbeat(setup, link),
            started=time.monotonic(),
        )
        reason = LAUNCHER_FAILED
        try:
            run.heartbeat.beat("running")
            run.roles.start(run.spawn, setup.my_nodes())
            setup.echo(
                f"{setup.who}started {len(run.roles.procs)} role processes (address "
                f"{link.address}); logs in {setup.run_dir / 'logs'}"
            )
            reason = self._supervise(run)
        except REDIS_ERRORS as err:
            reason = redis_lost(link.store, err)
        finally:  # whatever ended the loop, the roles stop in order and the run is reported
            code = 1 if run.roles.any_failed else reason.exit_code
            self._end(run, reason, code)
        return code

    def _spawn_context(self, link: NodeLink) -> SpawnContext:
        cfg, seat = self.setup.cfg, self.setup.seat
        if cfg.run.nccl_shared_gpu and "NCCL_HOSTID" in os.environ:
            self.setup.echo(
                "run.nccl_shared_gpu: NCCL_HOSTID is set in this environment, so every role "
                "inherits the same host id and links on a shared GPU stay on gloo"
            )
        return SpawnContext(
            config_path=config_path(self.setup.run_dir),
            run_dir=self.setup.run_dir,
            address=link.address,
            secret=link.secret,
            nccl_interface=netaddr.interface_of(link.address) if seat.multi_host else None,
            nccl_host_ids=cfg.run.nccl_shared_gpu,
        )

    def _supervise(self, run: NodeRun) -> StopReason:
        """Tick until the run ends or a signal stops it."""
        self._next_progress = time.monotonic() + self.setup.cfg.run.progress_interval_s
        while not self.setup.stop_requested.wait(TICK_S):
            reason = self._tick(run, time.monotonic())
            if reason is not None:
                return reason
        return STOPPED_BY_SIGNAL

    def _tick(self, run: NodeRun, now: float) -> StopReason | None:
        """Tend the roles, beat, ask the node's part whether the run ends, print progress."""
        try:
            self.policy.before_tend(run)
            failure = run.roles.tend(run.spawn, now)
            if failure:
                return self.policy.role_failed(run, StopReason(StopKind.ROLE_FAILED, failure))
            run.heartbeat.beat("running")
            reason = self.policy.check(run, now)
        except REDIS_ERRORS as err:
            reason = self.policy.unreachable(run, now, err)
        if reason is not None or now < self._next_progress:
            return reason
        try:
            line = self.policy.progress_line(run, now)
        except REDIS_ERRORS as err:
            return self.policy.unreachable(run, now, err)
        if line is not None:
            self.setup.echo(line)
        self._next_progress = now + self.setup.cfg.run.progress_interval_s
        return None

    def _end(self, run: NodeRun, reason: StopReason, code: int) -> None:
        wall_s = time.monotonic() - run.started
        self.policy.announce_end(run, reason, code)
        try_bookkeeping(lambda: run.heartbeat.beat("stopping"))
        self._stop_all(run)
        self.policy.finish(run, reason, code, wall_s)
        setup = self.setup
        setup.echo(f"{setup.who}run {setup.cfg.run.name} ended: {reason}; run dir {setup.run_dir}")
        run.link.registry.close()

    # --- stop ------------------------------------------------------------------------------------
    def _stop_all(self, run: NodeRun) -> None:
        """Stop producers before consumers (``STOP_ORDER``) so queued data is drained, not lost.

        In a multi-host run every node goes through the stages together: a node moves to the
        next role only once no instance of this one is still busy on any node, so a trainer on
        one host drains what env workers on another pushed until they stopped."""
        timeout_s = self.setup.cfg.run.stop_timeout_s
        local = dict(stop_stages(run.roles.procs))
        for role in (r for r in STOP_ORDER if r in self.setup.cfg.roles):
            stop_group(
                local.get(role, []),
                timeout_s,
                self.setup.kill_requested,
                on_tick=lambda: try_bookkeeping(lambda: run.heartbeat.beat("stopping")),
            )
            if self.setup.seat.multi_host:
                self._wait_remote(run, role, time.monotonic() + timeout_s)

    def _wait_remote(self, run: NodeRun, role: str, deadline: float) -> None:
        """Another host's processes: only Redis tells when they have ended."""

        def busy() -> bool:
            return any(
                r.role == role and r.alive and r.status in BUSY for r in run.link.registry.roles()
            )

        wait_while(
            busy,
            deadline,
            self.setup.kill_requested,
            on_tick=lambda: run.heartbeat.beat("stopping"),
        )

    def _on_signal(self, _signum: int, count: int) -> None:  # on the signal watcher thread
        if count > 1 or self.setup.stop_requested.is_set():
            self.setup.echo("second signal: killing all roles")
            self.setup.kill_requested.set()
        else:
            self.setup.echo("stopping all roles (Ctrl-C again to kill them)")
            self.setup.stop_requested.set()
