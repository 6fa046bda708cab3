"""Env worker role: N simulators, one thread each, asking rollout servers for actions.

In ``async`` and ``async_rollout`` modes every env sends its own observation request the moment
its step ends and steps as soon as its own action returns: no env waits for another, so a slow
simulator step (a straggler) costs only its own time. In ``sync`` mode the envs of a worker step in
lock-step (a barrier after every step), and after ``chunk_len`` steps each env pauses until the
trainer has published the next weight version (one round per version).

Each env cuts its steps into ``TrajectoryChunk`` messages of ``chunk_len`` steps (shorter at an
episode end) and pushes them to the trainer, each numbered per env and process start, so the
chunk accounting stays exact when a worker dies (``rlvla3/chunk_ledger.py``). Requests go round-robin to every live rollout server;
an unanswered request is re-sent after ``request_timeout_s``, so losing a server loses no env.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from typing import Any

import numpy as np

from rlvla3.chunk_ledger import pushed_field
from rlvla3.role import RateMeter, Role, main
from sim.adapter import SimAdapter
from sim.envs import make_env
from sim.straggler import StragglerConfig
from transport import sockets
from transport.messages import ActionReply, ObsRequest, TrajectoryChunk

_PEER_SCAN_PERIOD_S = 1.0


class EnvWorker(Role):
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
        num_envs = self.cfg.env.num_envs_per_worker
        sync = self.cfg.run.mode == "sync" and self.serves_training
        self.barrier = threading.Barrier(num_envs) if sync else None
        self.version_seen = threading.Condition()
        self.latest_version = self.registry.weight_version()
        self.may_produce = threading.Event()  # cleared while too many chunks are in flight
        self.may_produce.set()
        # Finished episodes wait here for the main loop to write them to Redis in one call:
        # an env thread never waits on Redis between two steps.
        self.episode_lock = threading.Lock()
        self.finished_episodes: list[dict[str, Any]] = []
        self.runners = [self.runner(i) for i in range(num_envs)]
        for runner in self.runners:
            runner.thread.start()
        self.next_scan = time.monotonic() + _PEER_SCAN_PERIOD_S
        self.gauge("max_chunks_queued", self.settings.max_chunks_queued if self.trains else 0)
        self.gauge("envs", num_envs)

    def step(self) -> None:
        sync = self.barrier is not None
        if self.stop_event.wait(0.01 if sync else 0.2):
            return
        if sync:
            self._watch_version()
        if self.settings.max_chunks_queued and self.trains and not sync:
            self._watch_trainer_backlog()
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

    def runner(self, env_index: int) -> EnvRunner:
        """The thread that runs env ``env_index``."""
        return EnvRunner(self, env_index)

    def _watch_version(self) -> None:
        version = self.registry.weight_version()
        if version > self.latest_version:
            with self.version_seen:
                self.latest_version = version
                self.version_seen.notify_all()

    def _watch_trainer_backlog(self) -> None:
        """Back-pressure: let envs produce only while few chunks wait for the trainer."""
        queued = self.registry.chunk_backlog()
        if queued > self.settings.max_chunks_queued:
            if self.may_produce.is_set():
                self.may_produce.clear()
                self.count("backpressure_pauses")
        else:
            self.may_produce.set()
        self.gauge("chunks_queued", queued)

    def wait_for_credit(self) -> None:
        """Block while too many chunks wait for the trainer (see ``max_chunks_queued``)."""
        while not self.may_produce.wait(0.1):
            if self.stop_event.is_set():
                raise InterruptedError

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
        self, ret: float, length: int, success: bool | None, versions: tuple[int, int]
    ) -> None:
        """Count a finished episode and queue it for the run's learning curve.

        ``versions``: the oldest and newest weight version that chose its actions; the end-of-run
        evaluation counts only episodes acted on entirely by the evaluated version. Called from
        env threads; the main loop writes the queue to Redis (``_write_episodes``).
        """
        point: dict[str, Any] = {
            "return": ret,
            "length": length,
            "worker": self.index,
            "t": time.time(),
            "min_version": versions[0],
            "max_version": versions[1],
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


_RESET_TRIES = 10


def _finite(obs: dict[str, np.ndarray], reward: float) -> bool:
    """True when the reward and every float observation are finite."""
    if not math.isfinite(reward):
        return False
    return all(np.isfinite(v).all() for v in obs.values() if v.dtype.kind == "f")


class EnvRunner:
    """One env and its thread: request, step, record, push — independent of the other envs."""

    def __init__(self, worker: EnvWorker, env_index: int) -> None:
        self.worker = worker
        self.env_index = env_index
        self.cfg = worker.cfg
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"env-{env_index}", daemon=True)
        self.request_id = 0
        self.answered = False  # any reply yet: before the first, waiting is expected
        self.chunk_id = 0
        self.sim_since = 0.0  # wall time this env entered its simulator's step or reset; 0: out
        self.producer = f"{worker.index}/{env_index}#{worker.incarnation}"
        # GRPO: the envs of a group start each of their episodes from the same seed, and their
        # chunks carry the episode's group (rlvla3/algo/grpo.py).
        self.grouped = self.cfg.algo.kind == "grpo" and worker.trains
        self.group_index = env_index // self.cfg.algo.group_size
        self.episode = -1
        self.group = ""
        self.steps: list[dict[str, Any]] = []

    def _run(self) -> None:
        w = self.worker
        seed = self.cfg.run.seed + 10_000 * w.index + self.env_index
        straggler = self._straggler(seed)
        env = make_env(self.cfg.env.id, seed=seed, straggler=straggler, **self.cfg.env.kwargs)
        self.dealer = sockets.dealer(hwm=100, on_bad_frame=w.count_bad_frame)
        self.chunks = sockets.push(hwm=w.settings.chunk_queue_hwm)
        self.chunks.raw.setsockopt(sockets.zmq.LINGER, 10_000)  # deliver pushed chunks at exit
        self.chunks.connect(w.trainers)
        try:
            self._loop(env)
        except (InterruptedError, threading.BrokenBarrierError):
            pass
        except BaseException as err:  # reported by the worker's main loop, which fails the role
            w.log.exception("env %d failed", self.env_index)
            self.error = err
        finally:
            env.close()
            self.dealer.close()
            self.chunks.raw.close()

    def _reset(self, env: SimAdapter, seed: int | None = None) -> dict[str, np.ndarray]:
        """``env.reset(seed=seed)``, again (unseeded) while it returns a non-finite observation
        (a broken state); an env that keeps doing so fails its worker, naming it."""
        for _ in range(_RESET_TRIES):
            # (a group's envs meet the same broken start state and all move on to the next)
            if self.grouped:
                seed = self._next_group_seed()
            self.sim_since = time.time()
            obs, _ = env.reset(seed=seed)
            self.sim_since = 0.0
            if _finite(obs, 0.0):
                return obs
            seed = None
            self.worker.drop(
                "sim_faults",
                f"env {self.env_index}: reset returned a non-finite observation; resetting again",
            )
        raise RuntimeError(
            f"env {self.env_index} ({self.cfg.env.id}): {_RESET_TRIES} resets in a "
            "row returned non-finite observations"
        )

    def _next_group_seed(self) -> int:
        """Enter this env's next episode's group; return its reset seed, the same for every env
        of the group."""
        self.episode += 1
        w = self.worker
        self.group = f"{w.index}/{self.group_index}#{w.incarnation}:{self.episode}"
        key = [self.cfg.run.seed, w.index, self.group_index, self.episode]
        return int(np.random.SeedSequence(key).generate_state(1)[0])

    def _straggler(self, seed: int) -> StragglerConfig | None:
        s = self.cfg.env.straggler
        if s.distribution == "none":
            return None
        return StragglerConfig(
            distribution=s.distribution, mean_ms=s.mean_ms, sigma=s.sigma, seed=seed
        )

    def _loop(self, env: SimAdapter) -> None:
        w = self.worker
        chunk_len = self.cfg.env.chunk_len
        obs = self._reset(env)
        reply = self._request(obs)
        round_steps, episode_return, episode_len = 0, 0.0, 0
        versions = (reply.policy_version, reply.policy_version)
        while not w.stop_event.is_set():
            stepped = time.perf_counter()
            self.sim_since = time.time()
            next_obs, reward, terminated, truncated, info = env.step(reply.env_step_action)
            self.sim_since = 0.0
            w.count("env_step_us", round((time.perf_counter() - stepped) * 1e6))
            fault = not _finite(next_obs, reward)
            if fault:  # a simulator blow-up (NaN/inf): cut the episode here, as a truncation
                w.drop(
                    "sim_faults",
                    f"env {self.env_index}: the simulator returned a "
                    "non-finite observation or reward; episode cut there, env reset",
                )
                reward = reward if math.isfinite(reward) else 0.0
                terminated, truncated = False, True
            self.steps.append(
                {
                    "obs": obs,
                    "action": reply.action,
                    "reward": reward,
                    "terminated": terminated,
                    "truncated": truncated,
                    "log_prob": reply.log_prob,
                    "value": reply.value,
                    "version": reply.policy_version,
                }
            )
            w.count("env_steps")
            w.step_rate.add()
            round_steps += 1
            episode_return += reward
            episode_len += 1
            versions = (
                min(versions[0], reply.policy_version),
                max(versions[1], reply.policy_version),
            )
            if w.barrier is not None:
                w.barrier.wait()  # lock-step: every env of the worker finished this step
            if terminated or truncated:
                if terminated:
                    bootstrap = 0.0
                else:  # after a fault, the last finite observation's value stands in
                    bootstrap = reply.value if fault else self._request(next_obs).value
                self._push(bootstrap)
                w.record_episode(episode_return, episode_len, info.get("success"), versions)
                episode_return, episode_len = 0.0, 0
                obs = self._reset(env)
            else:
                obs = next_obs
            reply = self._request(obs)
            if episode_len == 0:
                versions = (reply.policy_version, reply.policy_version)
            if len(self.steps) >= chunk_len or (w.barrier is not None and round_steps >= chunk_len):
                self._push(reply.value)
            if w.barrier is not None and round_steps >= chunk_len:
                round_steps = 0
                reply = self._next_round(obs, reply.policy_version)

    def _next_round(self, obs: dict[str, np.ndarray], version: int) -> ActionReply:
        """Sync mode: wait for the next weight version, then act on ``obs`` with it."""
        w = self.worker
        if not w.wait_for_version_after(version):
            raise InterruptedError
        reply = self._request(obs)
        while reply.policy_version < w.latest_version:  # the server swaps in between batches
            if w.stop_event.wait(0.002):
                raise InterruptedError
            reply = self._request(obs)
        return reply

    def _request(self, obs: dict[str, np.ndarray]) -> ActionReply:
        """Ask any live server for an action; re-send on timeout until answered or stopped."""
        w = self.worker
        timeout = w.settings.request_timeout_s
        asked = time.perf_counter()
        try:
            return self._request_until_answered(obs, timeout)
        finally:  # the action round trip as the env sees it (monitor / async benchmark)
            w.count("action_requests")
            w.count("action_wait_us", round((time.perf_counter() - asked) * 1e6))

    def _request_until_answered(self, obs: dict[str, np.ndarray], timeout: float) -> ActionReply:
        w = self.worker
        while True:
            self.dealer.sync_peers(w.servers)
            self.request_id += 1
            key = f"{w.index}/{self.env_index}"
            self.dealer.send(ObsRequest(env_key=key, request_id=self.request_id, obs=obs))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if w.stop_event.is_set():
                    raise InterruptedError
                reply = self.dealer.recv(timeout_s=0.2)
                if isinstance(reply, ActionReply) and reply.request_id == self.request_id:
                    self.answered = True
                    return reply
            w.count("request_timeouts")
            if self.answered:
                w.log.warning("env %d: no reply in %.1fs; re-sending", self.env_index, timeout)
            else:  # servers answer once a trainer has published weights (SFT: after its data)
                w.log.info(
                    "env %d: no action yet (servers wait for the first weights); asking again",
                    self.env_index,
                )

    def _push(self, bootstrap_value: float) -> None:
        if not self.worker.trains:
            self.steps = []
            return
        if not self.steps:
            return
        steps, self.steps = self.steps, []
        keys = steps[0]["obs"].keys()
        chunk = TrajectoryChunk(
            worker_index=self.worker.index,
            env_index=self.env_index,
            chunk_id=self.chunk_id,
            obs={k: np.stack([s["obs"][k] for s in steps]) for k in keys},
            actions=np.stack([s["action"] for s in steps]),
            rewards=np.array([s["reward"] for s in steps], np.float32),
            terminated=np.array([s["terminated"] for s in steps], bool),
            truncated=np.array([s["truncated"] for s in steps], bool),
            log_probs=np.array([s["log_prob"] for s in steps], np.float32),
            values=np.array([s["value"] for s in steps], np.float32),
            policy_versions=np.array([s["version"] for s in steps], np.int64),
            bootstrap_value=float(bootstrap_value),
            producer=self.producer,
            group=self.group,
        )
        self.chunks.sync_peers(self.worker.trainers)
        while not self.chunks.send(chunk, timeout_s=0.5):  # back-pressure from a busy trainer
            if self.worker.stop_event.is_set():
                return  # never sent: not counted as produced, its number not used
            self.chunks.sync_peers(self.worker.trainers)
        self.worker.count("chunks_produced")
        self.worker.ledger_high(pushed_field(self.producer), self.chunk_id)
        self.chunk_id += 1
        self.worker.wait_for_credit()


if __name__ == "__main__":
    main(EnvWorker)
