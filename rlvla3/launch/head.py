"""The head node's part in a run: it starts the run's Redis (and restarts it when it dies),
checks the stop rules, freezes training for the end-of-run evaluation, decides the end, waits
for the other nodes and writes ``summary.json``. A one-host launcher is always the head."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from rlvla3.config.run_config import dump_config
from rlvla3.launch.cluster import needs_secret, own_address
from rlvla3.launch.node_run import (
    BUSY,
    NodeLink,
    NodeRun,
    NodeSetup,
    redis_lost,
    wait_while,
)
from rlvla3.launch.progress import ProgressTracker
from rlvla3.launch.redis_server import RedisServerError
from rlvla3.launch.rendezvous import head_store, write_run_info
from rlvla3.launch.run_dir import prepare_run_dir, write_config
from rlvla3.launch.run_summary import unmeasured_summary, write_report
from rlvla3.launch.stop_reason import ROLES_FINISHED, StopKind, StopReason
from rlvla3.launch.stop_rules import evaluation_episodes, stop_condition
from rlvla3.launch.supervisor import REDIS_ERRORS, try_bookkeeping
from rlvla3.runtime import run_secret
from rlvla3.runtime.registry import Registry


@dataclass(frozen=True, slots=True)
class EndEvaluation:
    """Training frozen: the final weights play ``wanted`` fresh episodes before the run ends."""

    reason: StopReason
    """What ended the run."""
    version: int
    """The weight version evaluated."""
    wanted: int
    """Episodes to wait for (``run.stop.eval_episodes``)."""
    deadline: float
    """When to give up waiting, ``time.monotonic()`` seconds (``run.stop.eval_timeout_s``)."""

    def outcome(self, registry: Registry, now: float) -> StopReason | None:
        """The run's end once enough episodes are in or time is up, else None."""
        done = len(evaluation_episodes(registry, self.version))
        if done >= self.wanted:
            return self.reason.noted(f"evaluated on {done} episodes")
        if now > self.deadline:
            return self.reason.noted(f"evaluation timed out after {done} episodes")
        return None


class HeadPolicy:
    """The head's side of a node's launcher (a ``NodePolicy``)."""

    def __init__(self, setup: NodeSetup) -> None:
        self.setup = setup
        self._progress = ProgressTracker(setup.cfg)
        self._evaluation: EndEvaluation | None = None
        self._redis_lost_since: float | None = None

    @contextlib.contextmanager
    def join(self) -> Iterator[NodeLink]:
        """Start the run: its Redis (unless ``run.redis_url`` names one), ``run.json``, a
        clean slate of bookkeeping and the launch mark the other nodes wait for."""
        cfg, seat, run_dir = self.setup.cfg, self.setup.seat, self.setup.run_dir
        address = own_address(seat, None)
        secure = needs_secret(seat, address)
        secret = (run_secret.from_env() or run_secret.new_secret()) if secure else None
        prepare_run_dir(run_dir, seat, address, secret)
        shown = write_config(run_dir, cfg)
        launch_id = uuid.uuid4().hex
        with head_store(cfg, seat, address, secret, run_dir / "redis") as store:
            if cfg.run.redis_url is None:
                self.setup.echo(
                    f"started the run's redis-server at {store.url}"
                    + (" (TLS, the run user's ACL)" if store.password else "")
                )
            write_run_info(run_dir, cfg, seat, store, launch_id, os.getpid())
            registry = store.registry(cfg.run.name)
            # a shared Redis may hold a live run of this name: never wipe it (the run's own
            # Redis holds at most a dead launch's keys)
            registry.clear_run(refuse_live=cfg.run.redis_url is not None)
            registry.save_config(dump_config(shown))
            registry.mark_launch(launch_id)
            if self.setup.hooks is not None:
                self.setup.hooks.started(registry)
            yield NodeLink(store, secret, address, registry)

    def before_tend(self, run: NodeRun) -> None:
        """Restart the run's own redis-server if it died, from its append-only file, on the
        same address; roles ride out the gap (``run.head_timeout_s``) and carry on."""
        server = run.link.store.server
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
        self.setup.echo(
            f"the run's redis-server died (exit {code}); restarted from its append-only file "
            f"in {time.monotonic() - started:.2f}s"
        )
        run.link.registry.incr("redis_restarts")

    def role_failed(self, run: NodeRun, reason: StopReason) -> StopReason:
        return reason

    def check(self, run: NodeRun, now: float) -> StopReason | None:
        """The stop rules, then the end-of-run evaluation they may start."""
        reason = self._check(run, now)
        self._redis_lost_since = None  # Redis answered this tick
        return reason

    def _check(self, run: NodeRun, now: float) -> StopReason | None:
        if self._evaluation is not None:
            return self._evaluation.outcome(run.link.registry, now)
        if self.setup.hooks is not None:
            reason = self.setup.hooks.check(run.link.registry)
            if reason is not None:
                return reason
        if run.roles.all_finished:
            return ROLES_FINISHED
        reason = stop_condition(run.link.registry, self.setup.cfg, now - run.started)
        return None if reason is None else self._end_or_evaluate(run, reason)

    def _end_or_evaluate(self, run: NodeRun, reason: StopReason) -> StopReason | None:
        """``reason`` when no evaluation is due; else None, training frozen and the final
        weights' evaluation on ``eval_episodes`` fresh episodes begun."""
        cfg = self.setup.cfg
        wanted = cfg.run.stop.eval_episodes
        if not wanted or cfg.num_processes("env_worker") == 0:
            return reason
        version = run.link.registry.weight_version()
        run.link.registry.start_evaluation(version)
        self.setup.echo(f"{reason}; evaluating weights v{version} on {wanted} fresh episodes")
        deadline = time.monotonic() + cfg.run.stop.eval_timeout_s
        self._evaluation = EndEvaluation(reason, version, wanted, deadline)
        return None

    def unreachable(self, run: NodeRun, now: float, err: Exception) -> StopReason | None:
        """Roles ride out a Redis outage for ``run.head_timeout_s``: so does the head."""
        if self._redis_lost_since is None:
            self._redis_lost_since = now
            self.setup.echo(f"the run's Redis is unreachable ({err}); riding it out")
        if now - self._redis_lost_since >= self.setup.cfg.run.head_timeout_s:
            return redis_lost(run.link.store, err)
        return None

    def progress_line(self, run: NodeRun, now: float) -> str | None:
        if self._evaluation is not None:
            return None  # the evaluation said what it waits for
        if self.setup.hooks is not None:
            return self.setup.hooks.progress_line(run.link.registry, now - run.started)
        return self._progress.line(run.link.registry, now - run.started, run.roles.restarts)

    def announce_end(self, run: NodeRun, reason: StopReason, exit_code: int) -> None:
        """Tell the other nodes, which stop their roles and exit with ``exit_code``."""
        if self.setup.seat.multi_host and reason.kind is not StopKind.REDIS_LOST:
            try_bookkeeping(lambda: run.link.registry.end_run(reason.text, exit_code))

    def finish(self, run: NodeRun, reason: StopReason, exit_code: int, wall_s: float) -> None:
        """Keep the run's Redis up until the other nodes are done, then write the report."""
        reachable = reason.kind is not StopKind.REDIS_LOST
        if reachable and self.setup.seat.multi_host:
            self._wait_for_members(run)
        try_bookkeeping(lambda: run.heartbeat.beat("done"))  # every role has stopped: say so
        try:
            if reachable:
                write_report(run.link.registry, self.setup.cfg, self.setup.run_dir, wall_s, reason)
                return
        except REDIS_ERRORS as err:  # e.g. Slurm's scancel stopped the redis-server too
            reason = reason.noted(f"the run's Redis went away while reporting ({err})")
        unmeasured_summary(self.setup.cfg, wall_s, reason).write(self.setup.run_dir)

    def _wait_for_members(self, run: NodeRun) -> None:
        def members_busy() -> bool:
            return any(
                r.node != self.setup.seat.label and r.alive and r.status in BUSY
                for r in run.link.registry.launchers()
            )

        deadline = time.monotonic() + self.setup.cfg.run.stop_timeout_s
        wait_while(members_busy, deadline, self.setup.kill_requested)
