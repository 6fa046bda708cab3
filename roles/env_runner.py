"""The threads of an env worker: each steps one group of envs (``env.envs_per_request``).

An ``EnvRunner`` asks a rollout server for its group's actions (one request per step), steps the
envs, records each env's transitions in its ``EnvSlot`` and cuts them into ``TrajectoryChunk``
messages of ``env.chunk_len`` steps (shorter at an episode end) for the trainers. Groups never
wait for each other, except in ``sync`` mode's lock-step (the worker's barrier). Vector env groups
use ``roles.vector_runner.VectorRunner``, which keeps the same records as arrays.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from rlvla3.algo.grpo import GroupRounds
from rlvla3.config.role_settings import EnvWorkerSettings
from rlvla3.config.run_config import Config
from rlvla3.runtime.chunk_ledger import pushed_field
from rlvla3.runtime.rate_meter import RateMeter
from sim.env_group import EnvGroup, SeparateEnvs, Stepped, VectorEnvs
from sim.envs import make_env
from sim.straggler import StragglerConfig
from transport import sockets
from transport.messages import (
    ActionBatchReply,
    ActionReply,
    ObsBatchRequest,
    ObsRequest,
    TrajectoryChunk,
)


class EnvHost(Protocol):
    """What runners use of their env worker (``roles.env_worker.EnvWorker``): its config and
    peers, its counters and logs, and the pauses it decides (lock-step, back-pressure)."""

    cfg: Config
    settings: EnvWorkerSettings
    index: int
    incarnation: str
    log: logging.Logger
    stop_event: threading.Event
    serves_training: bool
    trains: bool
    servers: list[str]
    trainers: list[str]
    barrier: threading.Barrier | None
    latest_version: int
    step_rate: RateMeter
    group_rounds: GroupRounds | None  # GRPO: which group each new episode joins

    def count(self, name: str, amount: int = 1) -> None: ...
    def drop(self, counter: str, reason: str) -> None: ...
    def count_bad_frame(self, err: Exception) -> None: ...
    def ledger_high(self, field: str, value: int) -> None: ...
    def record_episode(
        self,
        ret: float,
        length: int,
        success: bool | None,
        versions: tuple[int, int],
        greedy: bool,
    ) -> None: ...
    def wait_for_credit(self) -> bool: ...
    def wait_for_version_after(self, version: int) -> bool: ...


RESET_TRIES = 10


def _finite(obs: dict[str, np.ndarray], reward: float) -> bool:
    """True when the reward and every float observation are finite."""
    if not math.isfinite(reward):
        return False
    return all(np.isfinite(v).all() for v in obs.values() if v.dtype.kind == "f")


@dataclass(frozen=True, slots=True)
class Act:
    """One env's answer from a rollout server (from an ``ActionReply`` or a row of an
    ``ActionBatchReply``)."""

    action: np.ndarray
    env_action: np.ndarray
    log_prob: float
    value: float
    version: int
    greedy: bool


def _acts(reply: ActionReply | ActionBatchReply) -> list[Act]:
    if isinstance(reply, ActionReply):
        return [
            Act(
                reply.action,
                reply.env_step_action,
                reply.log_prob,
                reply.value,
                reply.policy_version,
                reply.greedy,
            )
        ]
    env_actions = reply.env_step_actions
    log_probs, values = reply.log_probs.tolist(), reply.values.tolist()
    return [
        Act(
            reply.actions[i],
            env_actions[i],
            log_probs[i],
            values[i],
            reply.policy_version,
            reply.greedy,
        )
        for i in range(len(log_probs))
    ]


class EnvSlot:
    """One env of a runner: its current chunk and episode, its chunk numbering and (GRPO) its
    episode's group."""

    def __init__(self, runner: EnvRunner, position: int, env_index: int) -> None:
        worker = runner.worker
        self.position = position  # its index in the runner's env group
        self.env_index = env_index  # its index in the worker
        self.chunk_id = 0
        self.producer = f"{worker.index}/{env_index}#{worker.incarnation}"
        # GRPO: each episode starts as a place in a group (its seed is the group's), and its
        # chunks carry the group (rlvla3/algo/grpo.py).
        self.grouped = worker.cfg.algo.kind == "grpo" and worker.trains
        self.group = ""
        self.steps: list[dict[str, Any]] = []
        self.obs: dict[str, np.ndarray] = {}
        self.episode_return, self.episode_len = 0.0, 0
        self.versions = (0, 0)  # oldest and newest weight version of its current episode
        self.greedy = False  # every action of its current episode so far was greedy

    def start_episode(self, act: Act) -> None:
        """Its episode's bookkeeping starts from ``act``, the reply to its first observation."""
        self.versions = (act.version, act.version)
        self.greedy = act.greedy

    def next_group_seed(self, worker: EnvHost) -> int:
        """Enter this env's next episode's group; return its reset seed, the same for every
        episode of the group."""
        self.group, seed = worker.group_rounds.start_episode(self.env_index)
        return seed


class EnvRunner:
    """One thread stepping a group of ``env.envs_per_request`` envs (one, by default): request,
    step, record, push, independent of the worker's other groups."""

    def __init__(self, worker: EnvHost, env_indices: list[int]) -> None:
        self.worker = worker
        self.cfg = worker.cfg
        self.env_index = env_indices[0]
        self.slots = [EnvSlot(self, pos, i) for pos, i in enumerate(env_indices)]
        self.error: BaseException | None = None
        name = f"env-{env_indices[0]}" if len(env_indices) == 1 else f"envs-{env_indices[0]}+"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.request_id = 0
        self.answered = False  # any reply yet: before the first, waiting is expected
        self.sim_since = 0.0  # wall time its envs entered their simulators' step or reset; 0: out
        self.key = (
            f"{worker.index}/{env_indices[0]}"
            if len(env_indices) == 1
            else f"{worker.index}/{env_indices[0]}+{len(env_indices)}"
        )

    def _run(self) -> None:
        w = self.worker
        self.group = self._make_group()
        self.dealer = sockets.dealer(hwm=100, on_bad_frame=w.count_bad_frame)
        self.chunks = sockets.push(hwm=w.settings.chunk_queue_hwm)
        self.chunks.raw.setsockopt(sockets.zmq.LINGER, 10_000)  # deliver pushed chunks at exit
        self.chunks.connect(w.trainers)
        try:
            self._loop()
        except (InterruptedError, threading.BrokenBarrierError):
            pass
        except BaseException as err:  # reported by the worker's main loop, which fails the role
            w.log.exception("env %d failed", self.env_index)
            self.error = err
        finally:
            self.group.close()
            self.dealer.close()
            self.chunks.raw.close()

    def _make_group(self) -> EnvGroup:
        w, env = self.worker, self.cfg.env
        base = self.cfg.run.seed + 10_000 * w.index
        if env.vectorized and w.serves_training:
            return VectorEnvs(env.id, len(self.slots), seed=base + self.env_index, **env.kwargs)
        sims = []
        for slot in self.slots:
            seed = base + slot.env_index
            sims.append(make_env(env.id, seed=seed, straggler=self._straggler(seed), **env.kwargs))
        return SeparateEnvs(sims)

    def _straggler(self, seed: int) -> StragglerConfig | None:
        s = self.cfg.env.straggler
        if s.distribution == "none":
            return None
        return StragglerConfig(
            distribution=s.distribution, mean_ms=s.mean_ms, sigma=s.sigma, seed=seed
        )

    def _reset(self, slot: EnvSlot, seed: int | None = None) -> dict[str, np.ndarray]:
        """Reset ``slot``'s env (``seed``: its next episode's), again (unseeded) while it returns a
        non-finite observation (a broken state); an env that keeps doing so fails its worker."""
        for _ in range(RESET_TRIES):
            # (a group's envs meet the same broken start state and all move on to the next)
            if slot.grouped:
                seed = slot.next_group_seed(self.worker)
            self.sim_since = time.time()
            obs = self.group.reset(slot.position, seed=seed)
            self.sim_since = 0.0
            if _finite(obs, 0.0):
                return obs
            self.worker.drop(
                "sim_faults",
                f"env {slot.env_index}: reset returned a non-finite observation; resetting again",
            )
            seed = None
        raise RuntimeError(
            f"env {slot.env_index} ({self.cfg.env.id}): {RESET_TRIES} resets in a "
            "row returned non-finite observations"
        )

    def _loop(self) -> None:
        w = self.worker
        chunk_len = self.cfg.env.chunk_len
        slots = self.slots
        for slot in slots:
            slot.obs = self._reset(slot)
        acts = self._request([slot.obs for slot in slots])
        for slot, act in zip(slots, acts, strict=True):
            slot.start_episode(act)
        round_steps = 0
        while not w.stop_event.is_set():
            stepped_at = time.perf_counter()
            self.sim_since = time.time()
            results = self.group.step([act.env_action for act in acts])
            self.sim_since = 0.0
            w.count("env_step_us", round((time.perf_counter() - stepped_at) * 1e6))
            steps = sum(not res.restarted for res in results)
            w.count("env_steps", steps)
            w.step_rate.add(steps)
            round_steps += 1
            ended = [
                (False, False) if res.restarted else self._record(slot, act, res)
                for slot, act, res in zip(slots, acts, results, strict=True)
            ]
            if w.barrier is not None:
                w.barrier.wait()  # lock-step: every env of the worker finished this step
            self._end_episodes(slots, acts, results, ended)
            acts = self._request([slot.obs for slot in slots])
            for slot, act in zip(slots, acts, strict=True):
                if slot.episode_len == 0:
                    slot.start_episode(act)
                round_over = w.barrier is not None and round_steps >= chunk_len
                if len(slot.steps) >= chunk_len or round_over:
                    self._push(slot, act.value)
            if w.wait_for_credit():
                # Paused by back-pressure: the actions asked for before the pause came from
                # weights that have aged since; act on fresh ones, or the next chunks start stale.
                acts = self._request([slot.obs for slot in slots])
                for slot, act in zip(slots, acts, strict=True):
                    if slot.episode_len == 0:
                        slot.start_episode(act)
            if w.barrier is not None and round_steps >= chunk_len:
                round_steps = 0
                acts = self._next_round([slot.obs for slot in slots], acts[0].version)
                for slot, act in zip(slots, acts, strict=True):
                    if slot.episode_len == 0:  # its episode starts with the new round's version
                        slot.start_episode(act)

    def _record(self, slot: EnvSlot, act: Act, res: Stepped) -> tuple[bool, bool]:
        """Record one env's step; returns (episode ended, by a simulator fault)."""
        w = self.worker
        reward, terminated, truncated = res.reward, res.terminated, res.truncated
        fault = not _finite(res.obs, reward)
        if fault:  # a simulator blow-up (NaN/inf): cut the episode here, as a truncation
            w.drop(
                "sim_faults",
                f"env {slot.env_index}: the simulator returned a "
                "non-finite observation or reward; episode cut there, env reset",
            )
            reward = reward if math.isfinite(reward) else 0.0
            terminated, truncated = False, True
        slot.steps.append(
            {
                "obs": slot.obs,
                "action": act.action,
                "reward": reward,
                "terminated": terminated,
                "truncated": truncated,
                "log_prob": act.log_prob,
                "value": act.value,
                "version": act.version,
            }
        )
        slot.episode_return += reward
        slot.episode_len += 1
        slot.versions = (min(slot.versions[0], act.version), max(slot.versions[1], act.version))
        slot.greedy = slot.greedy and act.greedy
        return terminated or truncated, fault

    def _end_episodes(
        self,
        slots: list[EnvSlot],
        acts: list[Act],
        results: list[Stepped],
        ended: list[tuple[bool, bool]],
    ) -> None:
        """Push and record the episodes that ended this step and start the next ones; the rest
        move on to their next observation. Truncated episodes bootstrap from the value of their
        last observation, asked for in one request."""
        w = self.worker
        truncated = [
            i
            for i, (done, fault) in enumerate(ended)
            if done and not fault and not slots[i].steps[-1]["terminated"]
        ]
        values = {}
        if truncated:
            asked = self._request([results[i].obs for i in truncated])
            values = {i: a.value for i, a in zip(truncated, asked, strict=True)}
        for i, (slot, act, res) in enumerate(zip(slots, acts, results, strict=True)):
            done, fault = ended[i]
            if not done:
                slot.obs = res.obs
                continue
            if slot.steps[-1]["terminated"]:
                bootstrap = 0.0
            else:  # after a fault, the last finite observation's value stands in
                bootstrap = act.value if fault else values[i]
            self._push(slot, bootstrap)
            w.record_episode(
                slot.episode_return,
                slot.episode_len,
                res.info.get("success"),
                slot.versions,
                slot.greedy,
            )
            slot.episode_return, slot.episode_len = 0.0, 0
            if res.reset_obs is not None and not slot.grouped and _finite(res.reset_obs, 0.0):
                slot.obs = res.reset_obs  # a vector env reset it already
            else:
                slot.obs = self._reset(slot)

    def _next_round(self, obs: list[dict[str, np.ndarray]], version: int) -> list[Act]:
        """Sync mode: wait for the next weight version, then act on ``obs`` with it."""
        w = self.worker
        if not w.wait_for_version_after(version):
            raise InterruptedError
        acts = self._request(obs)
        while acts[0].version < w.latest_version:  # the server swaps in between batches
            if w.stop_event.wait(0.002):
                raise InterruptedError
            acts = self._request(obs)
        return acts

    def _request(self, obs: list[dict[str, np.ndarray]]) -> list[Act]:
        """Ask any live server for actions for ``obs`` (one message for the lot); re-send on
        timeout until answered or stopped."""
        if len(obs) == 1:
            return _acts(self._ask(obs[0], rows=None))
        batch = {key: np.stack([o[key] for o in obs]) for key in obs[0]}
        return _acts(self._ask(batch, rows=len(obs)))

    def _ask(self, obs: dict[str, np.ndarray], rows: int | None) -> ActionReply | ActionBatchReply:
        """Ask for actions for one env's observation (``rows`` None: an ``ObsRequest``) or a
        group's ``rows`` stacked ones (an ``ObsBatchRequest``); the reply that answers it."""
        w = self.worker
        asked = time.perf_counter()
        try:
            return self._request_until_answered(obs, rows, w.settings.request_timeout_s)
        finally:  # the action round trip as the envs see it (monitor / async benchmark)
            n = 1 if rows is None else rows
            w.count("action_requests", n)
            w.count("action_wait_us", round((time.perf_counter() - asked) * 1e6) * n)

    def _request_until_answered(
        self, obs: dict[str, np.ndarray], rows: int | None, timeout: float
    ) -> ActionReply | ActionBatchReply:
        w = self.worker
        while True:
            self.dealer.sync_peers(w.servers)
            self.request_id += 1
            if rows is None:
                request: ObsRequest | ObsBatchRequest = ObsRequest(
                    env_key=self.key, request_id=self.request_id, obs=obs
                )
            else:
                request = ObsBatchRequest(env_key=self.key, request_id=self.request_id, obs=obs)
            self.dealer.send(request)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if w.stop_event.is_set():
                    raise InterruptedError
                reply = self.dealer.recv(timeout_s=0.2)
                if getattr(reply, "request_id", None) != self.request_id:
                    continue  # a late reply to an earlier request, or nothing yet
                if (rows is None and isinstance(reply, ActionReply)) or (
                    isinstance(reply, ActionBatchReply) and len(reply.log_probs) == rows
                ):
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

    def _push(self, slot: EnvSlot, bootstrap_value: float) -> None:
        if not self.worker.trains:
            slot.steps = []
            return
        if not slot.steps:
            return
        steps, slot.steps = slot.steps, []
        keys = steps[0]["obs"].keys()
        chunk = TrajectoryChunk(
            worker_index=self.worker.index,
            env_index=slot.env_index,
            chunk_id=slot.chunk_id,
            obs={k: np.stack([s["obs"][k] for s in steps]) for k in keys},
            actions=np.stack([s["action"] for s in steps]),
            rewards=np.array([s["reward"] for s in steps], np.float32),
            terminated=np.array([s["terminated"] for s in steps], bool),
            truncated=np.array([s["truncated"] for s in steps], bool),
            log_probs=np.array([s["log_prob"] for s in steps], np.float32),
            values=np.array([s["value"] for s in steps], np.float32),
            policy_versions=np.array([s["version"] for s in steps], np.int64),
            bootstrap_value=float(bootstrap_value),
            producer=slot.producer,
            group=slot.group,
        )
        self.send_chunk(slot, chunk)

    def send_chunk(self, slot: EnvSlot, chunk: TrajectoryChunk) -> None:
        """Push ``slot``'s next chunk to a trainer (waiting while they are all busy), then count
        it and advance the slot's chunk numbering; a chunk not sent by the stop is not counted."""
        self.chunks.sync_peers(self.worker.trainers)
        while not self.chunks.send(chunk, timeout_s=0.5):  # back-pressure from a busy trainer
            if self.worker.stop_event.is_set():
                return  # never sent: not counted as produced, its number not used
            self.chunks.sync_peers(self.worker.trainers)
        self.worker.count("chunks_produced")
        self.worker.ledger_high(pushed_field(slot.producer), slot.chunk_id)
        slot.chunk_id += 1
