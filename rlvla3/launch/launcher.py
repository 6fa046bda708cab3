"""The launcher: starts the role processes of one node of a run, supervises them, stops them.

One YAML describes the run. ``rlvla3 launch cfg.yaml`` runs every node's roles on this host;
``--node NAME`` (or a Slurm step, see ``rlvla3/launch/cluster.py``) runs one node's. The head node's
launcher starts the run's Redis (``rlvla3/launch/rendezvous.py``), checks the stop rules and ends the
run; every other node's launcher joins it, follows the head's end, and stops its roles when it
cannot reach the head for ``run.head_timeout_s``. Each launcher's ``RoleSupervisor``
(``rlvla3/launch/supervisor.py``) restarts its node's roles that exit with an error or stall. The
first Ctrl-C (or SIGTERM) stops all roles gracefully, the second kills them.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import redis

from rlvla3.config.role_table import STOP_ORDER
from rlvla3.config.run_config import Config, dump_config
from rlvla3.config.typed_load import ConfigError
from rlvla3.launch import netaddr
from rlvla3.launch.cluster import Seat, own_address
from rlvla3.launch.processes import SpawnContext, stop_group, stop_stages
from rlvla3.launch.redis_server import RedisServerError
from rlvla3.launch.rendezvous import (
    Joined,
    JoinError,
    RunStore,
    find_head_store,
    head_store,
    read_run_info,
    write_node_info,
    write_run_info,
)
from rlvla3.launch.run_report import (
    ProgressTracker,
    evaluation_episodes,
    stop_condition,
    write_report,
)
from rlvla3.launch.supervisor import REDIS_ERRORS, RoleSupervisor, try_bookkeeping
from rlvla3.runtime import run_secret
from rlvla3.runtime.registry import Registry
from rlvla3.runtime.signals import install_stop_signals

_TICK_S = 0.2
_STOPPED_BY_SIGNAL = "stopped by signal"
_BUSY = ("starting", "running", "stopping")


class Launcher:
    """Starts, supervises and stops the role processes of one node of a run.

    Args:
        cfg: the validated run config.
        run_dir: where the resolved config, logs, checkpoints and reports go.
        seat: this launcher's node (``rlvla3.launch.cluster.find_seat``).
        echo: where progress lines go.
    """

    def __init__(
        self, cfg: Config, run_dir: Path, seat: Seat, echo: Callable[[str], None] = print
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.seat = seat
        self.echo = echo
        self.stop_requested = threading.Event()
        self.kill_requested = threading.Event()
        self.registry: Registry | None = None
        self.roles: RoleSupervisor | None = None  # this node's processes, once Redis is there
        self.address = ""
        self._next_beat = 0.0
        self._check_roles()

    def _check_roles(self) -> None:
        """A run needs roles, and a node other than the head needs some of its own."""
        if sum(rc.count for rc in self.cfg.roles.values()) == 0:
            raise ConfigError(
                "roles: no role processes to start in this config (a run "
                "needs roles: see launch/cartpole.yaml)"
            )
        mine = set(self._my_nodes())
        placed = {n for role in self.cfg.roles for n in self.cfg.placement(role)}
        if not self.seat.is_head and not placed & mine:
            raise ConfigError(f"roles: no role processes to start on node {self.seat.label!r}")

    def _my_nodes(self) -> list[str]:
        if self.seat.node is None:
            return [n.name for n in self.cfg.all_nodes()]
        return [self.seat.node.name]

    # --- public ----------------------------------------------------------------------------------
    def run(self) -> int:
        """Run this node to the end. Returns 0 on a clean stop, 1 if a role failed for good,
        the run's Redis (or, on other nodes, the head) was lost or the head ended the run with
        an error, 130 if stopped by a signal (Ctrl-C)."""
        install_stop_signals(self._on_signal)
        if self.seat.is_head:
            return self._run_as_head()
        return self._run_as_member()

    # --- joining -------------------------------------------------------------------------------
    def _run_as_head(self) -> int:
        self.address = own_address(self.seat, None)
        secret = (
            (run_secret.from_env() or run_secret.new_secret()) if self.seat.multi_host else None
        )
        self._prepare_run_dir(secret)
        launch_id = uuid.uuid4().hex
        with head_store(self.cfg, self.seat, self.address, secret, self.run_dir / "redis") as store:
            if self.cfg.run.redis_url is None:
                self.echo(
                    f"started the run's redis-server at {store.url}"
                    + (" (AUTH with the run secret)" if secret else "")
                )
            write_run_info(self.run_dir, self.cfg, self.seat, store, launch_id, os.getpid())
            self.registry = store.registry(self.cfg.run.name)
            self.registry.clear_run()
            self.registry.save_config(dump_config(self.cfg))
            self.registry.mark_launch(launch_id)
            return self._run_roles(store, secret)

    def _run_as_member(self) -> int:
        try:
            joined = find_head_store(
                self.cfg, self.seat, self.run_dir, self.stop_requested, self.echo
            )
        except InterruptedError:
            return 130
        except JoinError as err:
            self.echo(str(err))
            return 1
        self.address = own_address(self.seat, urlparse(joined.store.url).hostname)
        self._claim_run_dir(joined)
        self._prepare_run_dir(joined.secret)
        self.registry = joined.store.registry(self.cfg.run.name)
        return self._run_roles(joined.store, joined.secret)

    def _claim_run_dir(self, joined: Joined) -> None:
        """A member's run dir: the head's own when shared (its ``run.json`` names this launch);
        else this node's, where an earlier run's files are moved aside first, as the head
        does, so that roles and the monitor never read an old run's Redis address."""
        info = read_run_info(self.run_dir)
        if info is not None and info.get("launch_id") == joined.launch_id:
            return
        if info is not None:
            self.echo(f"node {self.seat.label}: {move_aside(self.run_dir)}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_run_info(
            self.run_dir, self.cfg, self.seat, joined.store, joined.launch_id, os.getpid()
        )
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))

    def _prepare_run_dir(self, secret: str | None) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if secret is not None and _stored_secret(self.run_dir) != secret:
            run_secret.write(self.run_dir, secret)
        if self.seat.is_head:
            # the config as given (the Redis URL goes to run.json), launchable again
            (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        if self.seat.node is not None:
            write_node_info(self.run_dir, self.seat, self.address)

    # --- the run -------------------------------------------------------------------------------
    def _run_roles(self, store: RunStore, secret: str | None) -> int:
        started = time.monotonic()
        interface = netaddr.interface_of(self.address) if self.seat.multi_host else None
        ctx = SpawnContext(
            config_path=self.run_dir / "config.yaml",
            run_dir=self.run_dir,
            address=self.address,
            secret=secret,
            nccl_interface=interface,
            nccl_host_ids=self.cfg.run.nccl_shared_gpu,
        )
        if self.cfg.run.nccl_shared_gpu and "NCCL_HOSTID" in os.environ:
            self.echo(
                "run.nccl_shared_gpu: NCCL_HOSTID is set in this environment, so every role "
                "inherits the same host id and links on a shared GPU stay on gloo"
            )
        reason, code, redis_lost = "launcher failed", 1, False
        self.roles = RoleSupervisor(
            self.cfg, self.run_dir, self.registry, self.echo, self.stop_requested
        )
        try:
            self._beat("running")
            self.roles.start(ctx, self._my_nodes())
            self.echo(
                f"{self._who()}started {len(self.roles.procs)} role processes (address "
                f"{self.address}); logs in {self.run_dir / 'logs'}"
            )
            if self.seat.is_head:
                reason, code = self._supervise(ctx, started, store), 0
            else:
                reason, code = self._follow(ctx, started)
        except REDIS_ERRORS as err:
            reason, redis_lost = f"lost the run's Redis at {store.url} ({err})", True
        finally:  # whatever ended the loop, the roles stop in order and the run is reported
            code = self._exit_code(reason, code, redis_lost)
            self._end(reason, code, redis_lost, time.monotonic() - started)
        return code

    def _exit_code(self, reason: str, code: int, redis_lost: bool) -> int:
        if self.roles.any_failed or redis_lost:
            return 1
        return 130 if reason == _STOPPED_BY_SIGNAL else code

    def _end(self, reason: str, code: int, redis_lost: bool, wall_s: float) -> None:
        if self.seat.is_head and self.seat.multi_host and not redis_lost:
            try_bookkeeping(lambda: self.registry.end_run(reason, code))
        try_bookkeeping(lambda: self._beat("stopping"))
        self._stop_all()
        if self.seat.is_head:
            self._finish_head(reason, wall_s, redis_lost)
        else:
            try_bookkeeping(lambda: self._beat("done" if code == 0 else "error"))
        self.echo(f"{self._who()}run {self.cfg.run.name} ended: {reason}; run dir {self.run_dir}")
        self.registry.close()

    def _finish_head(self, reason: str, wall_s: float, redis_lost: bool) -> None:
        if not redis_lost and self.seat.multi_host:
            self._wait_for_members()
        try_bookkeeping(lambda: self._beat("done"))  # every role has stopped: the report says so
        try:
            if not redis_lost:
                write_report(self.registry, self.cfg, self.run_dir, wall_s, reason)
                return
        except REDIS_ERRORS as err:  # e.g. Slurm's scancel stopped the redis-server too
            reason = f"{reason}; the run's Redis went away while reporting ({err})"
        _write_partial_report(self.run_dir, self.cfg, wall_s, reason)

    def _supervise(self, ctx: SpawnContext, started: float, store: RunStore) -> str:
        """The head's loop: restart crashed roles (and the run's redis-server), check the stop
        rules, print progress."""
        progress = ProgressTracker(self.cfg)
        next_progress = time.monotonic() + self.cfg.run.progress_interval_s
        redis_lost_since: float | None = None
        while not self.stop_requested.wait(_TICK_S):
            now = time.monotonic()
            try:
                self._keep_redis_up(store)
                failure = self.roles.tend(ctx, now)
                if failure:
                    return failure
                if self.roles.all_finished:
                    return "all roles finished"
                self._beat("running")
                reason = stop_condition(self.registry, self.cfg, now - started)
                if reason:
                    return self._evaluate(ctx, reason, store)
                if now >= next_progress:
                    self.echo(progress.line(self.registry, now - started, self.roles.restarts))
                    next_progress = now + self.cfg.run.progress_interval_s
                redis_lost_since = None
            except REDIS_ERRORS as err:  # roles ride it out as long: so does the head
                if redis_lost_since is None:
                    redis_lost_since = now
                    self.echo(f"the run's Redis is unreachable ({err}); riding it out")
                if now - redis_lost_since >= self.cfg.run.head_timeout_s:
                    raise
        return _STOPPED_BY_SIGNAL

    def _keep_redis_up(self, store: RunStore) -> None:
        """Restart the run's own redis-server if it died, from its append-only file, on the
        same address; roles ride out the gap (``run.head_timeout_s``) and carry on."""
        server = store.server
        if server is None or server.alive():
            return
        code = server.process.returncode if server.process is not None else None
        started = time.monotonic()
        try:
            server.restart()
        except RedisServerError as err:
            raise redis.exceptions.ConnectionError(
                f"could not restart redis-server: {err}"
            ) from err
        self.echo(
            f"the run's redis-server died (exit {code}); restarted from its append-only file "
            f"in {time.monotonic() - started:.2f}s"
        )
        self.registry.incr("redis_restarts")

    def _follow(self, ctx: SpawnContext, started: float) -> tuple[str, int]:
        """A member node's loop: restart crashed roles, follow the head's end of the run, stop
        when the head has been out of reach for ``run.head_timeout_s``."""
        last_contact = time.monotonic()
        next_progress = last_contact + self.cfg.run.progress_interval_s
        while not self.stop_requested.wait(_TICK_S):
            now = time.monotonic()
            failure = self.roles.tend(ctx, now)
            if failure:
                try_bookkeeping(self.registry.request_stop, f"{failure} on node {self.seat.label}")
                return failure, 1
            try:
                self._beat("running")
                end = self.registry.run_end()
                if end is not None:
                    return f"the head ended the run: {end[0]}", end[1]
                if self._head_alive():
                    last_contact = now
            except REDIS_ERRORS:
                pass  # a network outage: ride it out up to run.head_timeout_s
            lost_s = now - last_contact
            if lost_s >= self.cfg.run.head_timeout_s:
                return (
                    f"lost the head node {self.seat.head.name!r} for {lost_s:.0f}s "
                    "(run.head_timeout_s)",
                    1,
                )
            if now >= next_progress:
                alive = self.roles.running
                head = "reachable" if lost_s < 2 * _TICK_S + 1 else f"unreachable for {lost_s:.0f}s"
                self.echo(
                    f"[{now - started:5.0f}s] node {self.seat.label}: {alive}/"
                    f"{len(self.roles.procs)} roles running, restarts={self.roles.restarts}, "
                    f"head {self.seat.head.name} {head}"
                )
                next_progress = now + self.cfg.run.progress_interval_s
        return _STOPPED_BY_SIGNAL, 130

    def _head_alive(self) -> bool:
        return any(
            rec.node == self.seat.head.name and rec.alive and rec.status in _BUSY
            for rec in self.registry.launchers()
        )

    def _evaluate(self, ctx: SpawnContext, reason: str, store: RunStore) -> str:
        """Freeze training and wait for ``eval_episodes`` fresh episodes of the final weights."""
        wanted = self.cfg.run.stop.eval_episodes
        if not wanted or self.cfg.num_processes("env_worker") == 0:
            return reason
        version = self.registry.weight_version()
        self.registry.start_evaluation(version)
        self.echo(f"{reason}; evaluating weights v{version} on {wanted} fresh episodes")
        deadline = time.monotonic() + self.cfg.run.stop.eval_timeout_s
        while not self.stop_requested.wait(_TICK_S):
            self._keep_redis_up(store)
            failure = self.roles.tend(ctx, time.monotonic())
            if failure:
                return failure
            self._beat("running")
            done = len(evaluation_episodes(self.registry, version))
            if done >= wanted:
                return f"{reason}; evaluated on {done} episodes"
            if time.monotonic() > deadline:
                return f"{reason}; evaluation timed out after {done} episodes"
        return _STOPPED_BY_SIGNAL

    def _beat(self, status: str) -> None:
        """This node's launcher heartbeat in a multi-host run (at most once a second while the
        status stays the same)."""
        now = time.monotonic()
        if not self.seat.multi_host or (
            status in ("running", "stopping") and now < self._next_beat
        ):
            return
        self._next_beat = now + 1.0
        self.registry.launcher_heartbeat(
            self.seat.label,
            ttl_s=self.cfg.run.heartbeat_ttl_s,
            status=status,
            address=self.address,
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )

    def _who(self) -> str:
        return f"node {self.seat.label}: " if self.seat.multi_host else ""

    # --- stop ------------------------------------------------------------------------------------
    def _stop_all(self) -> None:
        """Stop producers before consumers (``STOP_ORDER``) so queued data is drained, not lost.

        In a multi-host run every node goes through the stages together: a node moves to the
        next role only once no instance of this one is still busy on any node, so a trainer on
        one host drains what env workers on another pushed until they stopped."""
        timeout_s = self.cfg.run.stop_timeout_s
        local = dict(stop_stages(self.roles.procs))
        for role in (r for r in STOP_ORDER if r in self.cfg.roles):
            stop_group(
                local.get(role, []),
                timeout_s,
                self.kill_requested,
                on_tick=lambda: try_bookkeeping(lambda: self._beat("stopping")),
            )
            if self.seat.multi_host:
                self._wait_remote(role, time.monotonic() + timeout_s)

    def _wait_remote(self, role: str, deadline: float) -> None:
        def busy() -> bool:
            return any(
                r.role == role and r.alive and r.status in _BUSY for r in self.registry.roles()
            )

        try:
            # another host's processes: only Redis tells when they have ended
            while busy() and time.monotonic() < deadline:
                self._beat("stopping")
                if self.kill_requested.wait(_TICK_S):
                    return
        except REDIS_ERRORS:
            pass

    def _wait_for_members(self) -> None:
        """The head keeps the run's Redis up until every other node's launcher is done."""
        deadline = time.monotonic() + self.cfg.run.stop_timeout_s

        def members_busy() -> list[str]:
            return [
                r.node
                for r in self.registry.launchers()
                if r.node != self.seat.label and r.alive and r.status in _BUSY
            ]

        try:
            while members_busy() and time.monotonic() < deadline:
                if self.kill_requested.wait(_TICK_S):
                    return
        except REDIS_ERRORS:
            pass

    def _on_signal(self, _signum: int, count: int) -> None:  # on the signal watcher thread
        if count > 1 or self.stop_requested.is_set():
            self.echo("second signal: killing all roles")
            self.kill_requested.set()
        else:
            self.echo("stopping all roles (Ctrl-C again to kill them)")
            self.stop_requested.set()


def _write_partial_report(run_dir: Path, cfg: Config, wall_s: float, reason: str) -> None:
    """``summary.json`` when the run's Redis is gone (counters and curves lived there)."""
    summary = {
        "run_id": cfg.run.name,
        "mode": cfg.run.mode,
        "wall_s": round(wall_s, 2),
        "stop_reason": reason,
        "solved": False,
        "complete": False,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _stored_secret(run_dir: Path) -> str | None:
    """The secret in the run dir, None when missing or unusable (it is then rewritten)."""
    try:
        return run_secret.read(run_dir)
    except run_secret.SecretError:
        return None


def move_aside(run_dir: Path) -> str:
    """Rename an earlier run's dir out of the way (nothing is deleted); says where to."""
    moved = run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(moved)
    return f"moved the earlier run in {run_dir} to {moved}"
