"""The env runner of a vector env group (``env.vectorized``): the group's steps kept as arrays.

``EnvRunner`` keeps one Python record per env and step, which is what bounds a group of cheap
envs: for 64 CartPoles per request the per-env bookkeeping cost several times the simulator
step and the action round trip together. This runner keeps the group's recent steps in ring
buffers of shape ``[ring, envs, ...]`` instead, filled one row per group step with whole-array
writes; Python touches a single env only where that env's chunk or episode ends.

What it records is what ``EnvRunner`` records for the same steps: chunks of ``env.chunk_len``
transitions per env, cut at episode ends, numbered per env, with the bootstrap value of the
observation that follows; a simulator fault (non-finite observation or reward) cuts the episode
as a truncation and resets that env (where the vector env can reset one env:
``VectorEnvs.reset_rows``); a native vector env's reset step (``VectorStep.restarted``) is no
transition.
"""

from __future__ import annotations

import time

import numpy as np

from roles.env_runner import RESET_TRIES, EnvRunner, EnvSlot
from sim.env_group import VectorEnvs, VectorStep
from transport.messages import ActionBatchReply, TrajectoryChunk


class _Ring:
    """The group's last ``length`` steps: per step, the observation acted on, the action, its
    log-prob, value and weight version, and the reward and episode end that followed."""

    def __init__(self, length: int, envs: int, obs_dim: int) -> None:
        self.length = length
        self.obs = np.zeros((length, envs, obs_dim), np.float32)
        self.actions: np.ndarray | None = None  # shaped by the first reply
        self.rewards = np.zeros((length, envs), np.float32)
        self.terminated = np.zeros((length, envs), bool)
        self.truncated = np.zeros((length, envs), bool)
        self.log_probs = np.zeros((length, envs), np.float32)
        self.values = np.zeros((length, envs), np.float32)
        self.versions = np.zeros(length, np.int64)
        self.recorded = np.zeros((length, envs), bool)  # False: a reset step, no transition

    def write(
        self,
        t: int,
        obs: np.ndarray,
        reply: ActionBatchReply,
        step: VectorStep,
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
    ) -> None:
        row = t % self.length
        if self.actions is None:
            shape = (self.length, *np.shape(reply.actions))
            self.actions = np.zeros(shape, np.asarray(reply.actions).dtype)
        self.obs[row] = obs
        self.actions[row] = reply.actions
        self.rewards[row] = rewards
        self.terminated[row] = terminated
        self.truncated[row] = truncated
        self.log_probs[row] = reply.log_probs
        self.values[row] = reply.values
        self.versions[row] = reply.policy_version
        self.recorded[row] = ~step.restarted

    def rows(self, env: int, start: int, end: int) -> np.ndarray:
        """Ring rows of env ``env``'s transitions in steps ``start`` to ``end`` (exclusive)."""
        rows = np.arange(start, end) % self.length
        return rows[self.recorded[rows, env]]


class VectorRunner(EnvRunner):
    """One thread stepping a ``VectorEnvs`` group, its bookkeeping in arrays."""

    def _loop(self) -> None:
        w, group = self.worker, self.group
        assert isinstance(group, VectorEnvs)
        n, chunk_len = len(self.slots), self.cfg.env.chunk_len
        # (a chunk spans at most chunk_len steps plus the reset step a native vector env adds)
        ring = _Ring(2 * chunk_len + 2, n, group.observation_space["state"].shape[0])
        self.ring = ring
        self.sim_since = time.time()
        obs = group.reset_all()
        self.sim_since = 0.0
        obs = self._finite_starts(obs, np.ones(n, bool), np.zeros(n, bool))
        reply = self._ask_group(obs)
        self.returns = np.zeros(n)
        self.lengths = np.zeros(n, np.int64)
        self.chunk_start = np.zeros(n, np.int64)  # the step each env's current chunk began at
        self.chunk_steps = np.zeros(n, np.int64)  # transitions in each env's current chunk
        self.first_version = np.full(n, reply.policy_version, np.int64)
        self.last_version = np.full(n, reply.policy_version, np.int64)
        self.all_greedy = np.full(n, reply.greedy)  # every action of the episode so far
        t, round_steps = 0, 0
        while not w.stop_event.is_set():
            stepped_at = time.perf_counter()
            self.sim_since = time.time()
            step = group.step_arrays(reply.env_step_actions)
            self.sim_since = 0.0
            w.count("env_step_us", round((time.perf_counter() - stepped_at) * 1e6))
            recorded = ~step.restarted
            steps = int(recorded.sum())
            w.count("env_steps", steps)
            w.step_rate.add(steps)
            rewards, terminated, truncated, faults = self._faults(step, recorded)
            if w.trains:
                ring.write(t, obs, reply, step, rewards, terminated, truncated)
            self.returns += rewards
            self.lengths += recorded
            self.chunk_steps += recorded
            # (the oldest and newest version of an episode: replies from several servers can
            # come back at older versions)
            self.first_version[recorded] = np.minimum(
                self.first_version[recorded], reply.policy_version
            )
            self.last_version[recorded] = np.maximum(
                self.last_version[recorded], reply.policy_version
            )
            self.all_greedy[recorded] &= reply.greedy
            t += 1
            round_steps += 1
            if w.barrier is not None:
                w.barrier.wait()  # lock-step: every group of the worker finished this step
            done = terminated | truncated
            if done.any():
                self._end_group_episodes(t, step, reply, done, terminated, faults)
            obs = self._finite_starts(step.next_obs, done | step.restarted, faults)
            reply = self._ask_group(obs)
            self._start_episodes(reply)
            round_over = w.barrier is not None and round_steps >= chunk_len
            full = np.flatnonzero(self.chunk_steps >= chunk_len) if not round_over else range(n)
            for i in full:
                self._push_rows(t, i, float(reply.values[i]))
            if w.wait_for_credit():
                # Paused by back-pressure: act on fresh weights, as ``EnvRunner`` does.
                reply = self._ask_group(obs)
                self._start_episodes(reply)
            if round_over:
                round_steps = 0
                reply = self._next_group_round(obs, reply.policy_version)
                self._start_episodes(reply)

    def _faults(
        self, step: VectorStep, recorded: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rewards and episode ends with simulator faults (a non-finite observation or reward)
        cut as truncations (reward 0 where it was not finite), and which rows faulted."""
        rewards, terminated, truncated = step.rewards, step.terminated, step.truncated
        finite_rewards = np.isfinite(rewards)
        finite_obs = np.isfinite(step.last_obs).all(axis=1)
        faults = recorded & ~(finite_rewards & finite_obs)
        if not faults.any():
            return rewards, terminated, truncated, faults
        for i in np.flatnonzero(faults):
            self.worker.drop(
                "sim_faults",
                f"env {self.slots[i].env_index}: the simulator returned a "
                "non-finite observation or reward; episode cut there",
            )
        rewards = np.where(finite_rewards, rewards, 0.0)
        return rewards, terminated & ~faults, truncated | faults, faults

    def _finite_starts(
        self, obs: np.ndarray, starting: np.ndarray, faults: np.ndarray
    ) -> np.ndarray:
        """``obs`` once every env that starts an episode (rows ``starting``) has a finite
        observation to start from, and every env a fault cut (rows ``faults``) was reset.

        Gymnasium's sync and async vector envs reset those envs alone, again (up to
        ``RESET_TRIES`` times) while a reset gives a non-finite observation. A native vector
        env cannot reset one env: a fault-cut env goes on from where it was, and one that would
        start from a non-finite observation fails the worker, which its supervisor restarts.
        """
        redo = faults.copy()
        for attempt in range(RESET_TRIES + 1):
            broken = starting & ~np.isfinite(obs).all(axis=1)
            if not (redo | broken).any():
                return obs
            if attempt == RESET_TRIES:
                break
            self.sim_since = time.time()
            fresh = self.group.reset_rows(redo | broken)
            self.sim_since = 0.0
            if fresh is None:
                if not broken.any():
                    return obs
                envs = [self.slots[i].env_index for i in np.flatnonzero(broken)]
                raise RuntimeError(
                    f"envs {envs}: the vector env gave non-finite observations to start an "
                    "episode from, and cannot reset one env"
                )
            for i in np.flatnonzero(broken & ~redo):  # (a fault-cut env was counted already)
                self.worker.drop(
                    "sim_faults",
                    f"env {self.slots[i].env_index}: non-finite observation to start an episode "
                    "from; resetting again",
                )
            obs, redo = fresh, np.zeros_like(faults)
        envs = [self.slots[i].env_index for i in np.flatnonzero(broken)]
        raise RuntimeError(
            f"envs {envs} ({self.cfg.env.id}): {RESET_TRIES} resets in a row returned "
            "non-finite observations"
        )

    def _end_group_episodes(
        self,
        t: int,
        step: VectorStep,
        reply: ActionBatchReply,
        done: np.ndarray,
        terminated: np.ndarray,
        faults: np.ndarray,
    ) -> None:
        """Push and record the episodes that ended at step ``t - 1``. A truncated episode
        bootstraps from its last observation's value (asked for in one request); after a fault,
        the value of the last finite observation stands in."""
        ended = np.flatnonzero(done)
        bootstrap = np.where(faults, reply.values, 0.0)
        ask = ended[~terminated[ended] & ~faults[ended]]
        if len(ask):
            asked = self._ask_group(step.last_obs[ask])
            bootstrap[ask] = asked.values
        for i in ended:
            self._push_rows(t, i, float(bootstrap[i]))
            success = None if step.success is None else bool(step.success[i])
            versions = (int(self.first_version[i]), int(self.last_version[i]))
            self.worker.record_episode(
                float(self.returns[i]),
                int(self.lengths[i]),
                success,
                versions,
                bool(self.all_greedy[i]),
            )
        self.returns[ended] = 0.0
        self.lengths[ended] = 0

    def _start_episodes(self, reply: ActionBatchReply) -> None:
        """Envs that have not stepped in their episode yet start it with this reply's version."""
        fresh = self.lengths == 0
        self.first_version[fresh] = reply.policy_version
        self.last_version[fresh] = reply.policy_version
        self.all_greedy[fresh] = reply.greedy

    def _push_rows(self, t: int, i: int, bootstrap_value: float) -> None:
        """Push env ``i``'s current chunk (its transitions since its chunk began, up to step
        ``t``) and start its next one."""
        start = int(self.chunk_start[i])
        self.chunk_start[i], self.chunk_steps[i] = t, 0
        if not self.worker.trains:
            return
        ring = self.ring
        rows = ring.rows(i, start, t)
        if not len(rows):
            return
        assert ring.actions is not None
        slot: EnvSlot = self.slots[i]
        chunk = TrajectoryChunk(
            worker_index=self.worker.index,
            env_index=slot.env_index,
            chunk_id=slot.chunk_id,
            obs={"state": ring.obs[rows, i]},
            actions=ring.actions[rows, i],
            rewards=ring.rewards[rows, i],
            terminated=ring.terminated[rows, i],
            truncated=ring.truncated[rows, i],
            log_probs=ring.log_probs[rows, i],
            values=ring.values[rows, i],
            policy_versions=ring.versions[rows],
            bootstrap_value=bootstrap_value,
            producer=slot.producer,
            group=slot.group,
        )
        self.send_chunk(slot, chunk)

    def _ask_group(self, obs: np.ndarray) -> ActionBatchReply:
        reply = self._ask({"state": obs}, rows=len(obs))
        assert isinstance(reply, ActionBatchReply)
        return reply

    def _next_group_round(self, obs: np.ndarray, version: int) -> ActionBatchReply:
        """Sync mode: wait for the next weight version, then act on ``obs`` with it."""
        w = self.worker
        if not w.wait_for_version_after(version):
            raise InterruptedError
        reply = self._ask_group(obs)
        while reply.policy_version < w.latest_version:  # the server swaps in between batches
            if w.stop_event.wait(0.002):
                raise InterruptedError
            reply = self._ask_group(obs)
        return reply
