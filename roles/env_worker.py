"""Env worker role: N simulators in groups, one thread per group (``roles/env_runner.py``),
asking rollout servers for actions.

In ``async`` and ``async_rollout`` modes every env sends its own observation request the moment
its step ends and steps as soon as its own action returns: no env waits for another, so a slow
simulator step (a straggler) costs only its own time. In ``sync`` mode the envs of a worker step in
lock-step (a barrier after every step), and after ``chunk_len`` steps each env pauses until the
trainer has published the next weight version (one round per version).

Each env cuts its steps into ``TrajectoryChunk`` messages of ``chunk_len`` steps (shorter at an
episode end) and pushes them to the trainer, each numbered per env and process start, so the
chunk accounting stays exact when a worker dies (``rlvla3/runtime/chunk_ledger.py``). Requests go round-robin to every live rollout server;
an unanswered request is re-sent after ``request_timeout_s``, so losing a server loses no env.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from rlvla3.algo.grpo import GroupRounds
from rlvla3.config.role_settings import EnvWorkerSettings
from rlvla3.runtime.rate_meter import RateMeter
from rlvla3.runtime.role import Role, main
from roles.env_runner import EnvRunner
from roles.vector_runner import VectorRunner

_PEER_SCAN_PERIOD_S = 1.0


class EnvWorker(Role[EnvWorkerSettings]):
    """Runs ``env.num_envs_per_worker`` envs, one ``EnvRunner`` thread each."""

    name = "env_worker"
    server_role = "rollout_server"
    """The role whose servers act for these envs."""
    serves_training = True
    """False for evaluation's worker: no chunks, no lock-step, no back-pressure."""

    def setup(self) -> None:
        self.incarnation = uuid.uuid4().hex[:8]  # this process start, in every chunk's producer
        self.servers = self.wait_for_endpoints(self.server_role, "requests")
        # Without an RL trainer (e.g. evaluating an SFT policy) envs only act and record episodes.
        self.trains = (
            self.serves_training
            and "trainer" in self.cfg.roles
            and self.cfg.roles["trainer"].count > 0
        )
        self.trainers = self.wait_for_endpoints("trainer", "chunks") if self.trains else []
        self.step_rate = RateMeter()
        grpo = self.trains and self.cfg.algo.kind == "grpo"
        self.group_rounds = (
            GroupRounds(self.cfg.algo.group_size, self.cfg.run.seed, self.index, self.incarnation)
            if grpo
            else None
        )
        num_envs = self.cfg.env.num_envs_per_worker
        sync = self.cfg.run.mode == "sync" and self.serves_training
        groups = -(-num_envs // self.cfg.env.envs_per_request)
        self.barrier = threading.Barrier(groups) if sync else None
        self.version_seen = threading.Condition()
        self.latest_version = self.registry.weight_version()
        self.may_produce = threading.Event()  # cleared while too many chunks are in flight
        self.may_produce.set()
        # Finished episodes wait here for the main loop to write them to Redis in one call:
        # an env thread never waits on Redis between two steps.
        self.episode_lock = threading.Lock()
        self.finished_episodes: list[dict[str, Any]] = []
        per = self.cfg.env.envs_per_request if self.serves_training else 1
        self.runners = [
            self.runner(list(range(first, min(first + per, num_envs))))
            for first in range(0, num_envs, per)
        ]
        for runner in self.runners:
            runner.thread.start()
        self.next_scan = time.monotonic() + _PEER_SCAN_PERIOD_S
        limit = self.trains and not sync and self.settings.max_chunks_queued
        self.gauge("max_chunks_queued", self.settings.max_chunks_queued if limit else 0)
        self.gauge("envs", num_envs)

    def step(self) -> None:
        sync = self.barrier is not None
        if self.stop_event.wait(0.01 if sync else 0.2):
            return
        if sync:
            self._watch_version()
        if self.trains:
            self._watch_trainer_backlog(limit=not sync and self.settings.max_chunks_queued > 0)
        if time.monotonic() >= self.next_scan:  # peers restart on new ports: follow them
            self.servers = self.registry.endpoints(self.server_role, "requests") or self.servers
            if self.trains:
                self.trainers = self.registry.endpoints("trainer", "chunks") or self.trainers
            self.next_scan = time.monotonic() + _PEER_SCAN_PERIOD_S
        self.gauge("steps_per_s", self.step_rate.rate())
        self._write_episodes()
        for runner in self.runners:
            if runner.error is not None:
                raise RuntimeError(f"env {runner.env_index} failed") from runner.error

    def runner(self, env_indices: list[int]) -> EnvRunner:
        """The thread that runs the envs ``env_indices`` (one group): a vector env's group keeps
        its steps as arrays."""
        if self.cfg.env.vectorized:
            return VectorRunner(self, env_indices)
        return EnvRunner(self, env_indices)

    def _watch_version(self) -> None:
        version = self.registry.weight_version()
        if version > self.latest_version:
            with self.version_seen:
                self.latest_version = version
                self.version_seen.notify_all()

    def _watch_trainer_backlog(self, limit: bool) -> None:
        """Publish how many chunks wait for the trainers; with ``limit`` (back-pressure), let
        envs produce only while few do."""
        # The trainer's received count can be flushed before a worker's produced count (each
        # role flushes every 0.5 s), so the difference can dip below zero for a moment.
        queued = max(0, self.registry.chunk_backlog())
        self.gauge("chunks_queued", queued)
        if not limit:
            return
        if queued > self.settings.max_chunks_queued:
            if self.may_produce.is_set():
                self.may_produce.clear()
                self.count("backpressure_pauses")
        else:
            self.may_produce.set()

    def wait_for_credit(self) -> bool:
        """Block while too many chunks wait for the trainer (see ``max_chunks_queued``); return
        whether it did."""
        if self.may_produce.is_set():
            return False
        while not self.may_produce.wait(0.1):
            if self.stop_event.is_set():
                raise InterruptedError
        return True

    def wait_for_version_after(self, version: int) -> bool:
        """Sync mode: block until a weight version newer than ``version`` is published."""
        with self.version_seen:
            while self.latest_version <= version:
                if self.stop_event.is_set():
                    return False
                self.version_seen.wait(0.1)
        return True

    def stuck_work(self) -> tuple[float, str] | None:
        """The env longest inside its simulator (step or reset), if one is: a simulator that
        hangs stalls the worker (envs waiting for actions are not stuck: their server is)."""
        inside = [(r.sim_since, r.env_index) for r in self.runners if r.sim_since]
        if not inside:
            return None
        since, env_index = min(inside)
        return since, f"env {env_index} inside its simulator ({self.cfg.env.id})"

    def shutdown(self) -> None:
        self.stop_event.set()
        if self.barrier is not None:
            self.barrier.abort()
        for runner in self.runners:
            runner.thread.join(timeout=30)
        try:
            self._write_episodes()  # the last ones too: a stop loses no finished episode
        except Exception as err:  # Redis already gone: say what was lost, stop cleanly
            self.log.warning(
                "%d finished episodes not recorded: %s", len(self.finished_episodes), err
            )

    def record_episode(
        self,
        ret: float,
        length: int,
        success: bool | None,
        versions: tuple[int, int],
        greedy: bool,
    ) -> None:
        """Count a finished episode and queue it for the run's learning curve.

        ``versions``: the oldest and newest weight version that chose its actions; ``greedy``:
        every one of them was the policy's mode. The end-of-run evaluation counts only episodes
        acted on entirely, and greedily, by the evaluated version. Called from env threads; the
        main loop writes the queue to Redis (``_write_episodes``).
        """
        point: dict[str, Any] = {
            "return": ret,
            "length": length,
            "worker": self.index,
            "t": time.time(),
            "min_version": versions[0],
            "max_version": versions[1],
            "greedy": greedy,
        }
        if success is not None:
            point["success"] = success
        with self.episode_lock:
            self.finished_episodes.append(point)
        self.count("episodes")

    def _write_episodes(self) -> None:
        """Append the queued episodes to the run's ``episodes`` series, stamped with the
        run-wide env step count (read once per write; it lags by a counter flush anyway)."""
        with self.episode_lock:
            points, self.finished_episodes = self.finished_episodes, []
        if not points:
            return
        try:
            env_steps = self.registry.counters().get("env_steps", 0)
            for point in points:
                point["env_steps"] = env_steps
            self.registry.append("episodes", points)
        except Exception:
            with self.episode_lock:  # back in the queue, oldest first, for the next write
                self.finished_episodes[:0] = points
            raise


if __name__ == "__main__":
    main(EnvWorker)
