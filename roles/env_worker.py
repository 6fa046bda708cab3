"""Env worker role: N simulators in groups, one runner thread per group (``roles/env/``),
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

import functools
import time
import uuid

from rlvla3.algo.grpo import GroupRounds
from rlvla3.config.role_settings import EnvWorkerSettings
from rlvla3.runtime.rate_meter import RateMeter
from rlvla3.runtime.role import Role
from rlvla3.runtime.role_main import main
from roles.env.chunk_sink import DELIVERY_S, ChunkSink, ChunkStream
from roles.env.env_runner import EnvRunner
from roles.env.env_slot import EnvSlot
from roles.env.episode_queue import EpisodeQueue
from roles.env.pacing import EpisodeBudget, Pacing
from roles.env.peers import Peers
from roles.env.policy_client import PolicyClient
from roles.env.resend_buffer import AckFollower, ResendBuffer
from roles.env.runner_thread import Runner, RunnerParts, RunnerThread, make_env_group
from roles.env.sim_meter import SimMeter
from roles.env.vector_runner import VectorRunner
from transport import sockets

_PEER_SCAN_PERIOD_S = 1.0


class EnvWorker(Role[EnvWorkerSettings]):
    """Runs ``env.num_envs_per_worker`` envs in groups, one ``RunnerThread`` each."""

    name = "env_worker"
    server_role = "rollout_server"
    """The role whose servers act for these envs."""
    serves_training = True
    """False for evaluation's worker: no chunks, no lock-step, no back-pressure."""

    def setup(self) -> None:
        self.incarnation = uuid.uuid4().hex[:8]  # this process start, in every chunk's producer
        servers = self.wait_for_endpoints(self.server_role, "requests")
        # Without an RL trainer (e.g. evaluating an SFT policy) envs only act and record episodes.
        self.trains = self.serves_training and self.cfg.num_processes("trainer") > 0
        trainers = self.wait_for_endpoints("trainer", "chunks") if self.trains else []
        self.peers = Peers(servers, trainers)
        self.acks = AckFollower(self.registry, on_trainer_restart=self._find_trainers)
        self.chunk_delivery = sockets.DeliveryContext()
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
        version = self.registry.weight_version()
        self.pacing = Pacing(self.stop_event, groups, lock_step=sync, version=version)
        self.episodes = EpisodeQueue(self.index, self)
        self.budget = None
        if not self.trains and self.serves_training and self.settings.episodes_per_version:
            self.budget = EpisodeBudget(self.pacing, self.settings.episodes_per_version, version)
            self.episodes.on_record = self.budget.episode_ended
        per = self.cfg.env.envs_per_request if self.serves_training else 1
        self.runners = [
            RunnerThread(self.runner(list(range(first, min(first + per, num_envs)))), self.log)
            for first in range(0, num_envs, per)
        ]
        for runner in self.runners:
            runner.thread.start()
        self.next_scan = time.monotonic() + _PEER_SCAN_PERIOD_S
        limit = self.trains and not sync and self.settings.max_chunks_queued
        self.gauge("max_chunks_queued", self.settings.max_chunks_queued if limit else 0)
        self.gauge("envs", num_envs)

    def step(self) -> None:
        sync = self.pacing.lock_step
        if self.stop_event.wait(0.01 if sync else 0.2):
            return
        if sync:
            self.pacing.see_version(self.registry.weight_version())
        if self.trains:
            self._watch_trainer_backlog(limit=not sync and self.settings.max_chunks_queued > 0)
            self.acks.poll()
        elif self.budget is not None:
            evaluating = self.registry.evaluation_version() is not None
            self.budget.see(self.registry.weight_version(), evaluating)
        if time.monotonic() >= self.next_scan:  # peers restart on new ports: follow them
            peers = self.peers
            peers.servers = self.registry.endpoints(self.server_role, "requests") or peers.servers
            if self.trains:
                self._find_trainers()
            self.next_scan = time.monotonic() + _PEER_SCAN_PERIOD_S
        self.gauge("steps_per_s", self.step_rate.rate())
        self.episodes.write(self.registry)
        for runner in self.runners:
            if runner.error is not None:
                raise RuntimeError(f"env {runner.env_index} failed") from runner.error

    def _last_acks(self) -> None:
        """Read the settled marks and trainer starts once more at the stop: a trainer that
        restarted since the last read still gets what it should have resent
        (``ChunkSink.resend_at_exit``)."""
        if not self.trains:
            return
        try:
            self.acks.poll()
        except Exception as err:  # Redis already gone: the resend goes by the last read
            self.log.warning("settled marks not read at the stop: %s", err)

    def _find_trainers(self) -> None:
        self.peers.trainers = self.registry.endpoints("trainer", "chunks") or self.peers.trainers

    def runner(self, env_indices: list[int]) -> Runner:
        """The loop that runs the envs ``env_indices`` (one group): a vector env's group keeps
        its steps as arrays."""
        parts = self.runner_parts(env_indices)
        chunk_len = self.cfg.env.chunk_len
        if self.cfg.env.vectorized:
            streams = [self.chunk_stream(i) for i in env_indices]
            return VectorRunner(parts, streams, chunk_len)
        slots = [
            EnvSlot(position, self.chunk_stream(i), self.group_rounds)
            for position, i in enumerate(env_indices)
        ]
        return EnvRunner(parts, slots, chunk_len)

    def chunk_stream(self, env_index: int) -> ChunkStream:
        """Env ``env_index``'s chunks, numbered from 0 in this process start."""
        return ChunkStream(env_index, self.producer(env_index))

    def producer(self, env_index: int) -> str:
        """The chunk ledger's name for env ``env_index`` in this process start."""
        return f"{self.index}/{env_index}#{self.incarnation}"

    def runner_parts(self, env_indices: list[int]) -> RunnerParts:
        """The simulators, sockets and meter of the group of envs ``env_indices``."""
        first = env_indices[0]
        key = f"{self.index}/{first}"
        if len(env_indices) > 1:
            key += f"+{len(env_indices)}"
        vector = self.cfg.env.vectorized and self.serves_training
        client = PolicyClient(
            env_key=key,
            env_index=first,
            peers=self.peers,
            timeout_s=self.settings.request_timeout_s,
            rows=len(env_indices),
            counters=self,
            stop_event=self.stop_event,
            log=self.log,
        )
        resend = ResendBuffer(self.settings.resend_buffer_chunks * len(env_indices))
        if self.trains:
            self.acks.follow(resend, [self.producer(i) for i in env_indices])
        sink = ChunkSink(
            delivery=self.chunk_delivery,
            worker_index=self.index,
            trains=self.trains,
            peers=self.peers,
            queue_hwm=self.settings.chunk_queue_hwm,
            resend=resend,
            tag_key=self.chunk_key if self.trains else b"",
            counters=self,
            stop_event=self.stop_event,
        )
        return RunnerParts(
            env_indices=env_indices,
            make_envs=functools.partial(make_env_group, self.cfg, self.index, env_indices, vector),
            client=client,
            sink=sink,
            meter=SimMeter(self, self.step_rate),
            pacing=self.pacing,
            episodes=self.episodes,
            counters=self,
            stop_event=self.stop_event,
            env_id=self.cfg.env.id,
        )

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
            if self.pacing.pause():
                self.count("backpressure_pauses")
        else:
            self.pacing.resume()

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
        self.pacing.abort()
        self._last_acks()  # a restarted trainer's address, before the runners close
        for runner in self.runners:
            runner.thread.join(timeout=30)
        try:
            self.episodes.write(self.registry)  # the last ones too: a stop loses no episode
        except Exception as err:  # Redis already gone: say what was lost, stop cleanly
            self.log.warning("%d finished episodes not recorded: %s", len(self.episodes), err)
        self._deliver_at_exit()

    def _deliver_at_exit(self) -> None:
        """Chunks counted as pushed leave this process before it exits (``os._exit`` skips
        ZeroMQ's teardown): a resend that came due too late for the runners, and what their
        closed sockets still queue. Bounded by ``DELIVERY_S`` and half of
        ``run.stop_timeout_s`` (the launcher kills a role that takes longer to stop); nothing
        waits when no trainer is live to take them."""
        if not self.trains:
            return  # its sinks send nothing
        if not self._trainer_live():
            self.log.info("no trainer is live: chunks still queued for one are not waited for")
            return
        deadline = time.monotonic() + min(DELIVERY_S, 0.5 * self.cfg.run.stop_timeout_s)
        self._last_acks()  # a trainer restart seen during the joins still gets its resend
        for runner in self.runners:
            if not runner.thread.is_alive():  # (a stuck one still owns its sink)
                runner.runner.parts.sink.resend_at_exit(deadline)
        if not self.chunk_delivery.finish(timeout_s=max(0.0, deadline - time.monotonic())):
            self.log.warning("chunks still queued towards the trainers at exit: not delivered")

    def _trainer_live(self) -> bool:
        """A trainer is listed live to take chunks (Redis gone: assume one is)."""
        try:
            return bool(self.registry.endpoints("trainer", "chunks"))
        except Exception:
            return True


if __name__ == "__main__":
    main(EnvWorker)
