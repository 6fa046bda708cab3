"""The runner of a vector env group (``env.vectorized``): the group's steps kept as arrays.

``EnvRunner`` keeps one Python record per env and step, which is what bounds a group of cheap
envs: for 64 CartPoles per request the per-env bookkeeping cost several times the simulator
step and the action round trip together. This runner keeps the group's recent steps in a
``StepRing`` of shape ``[ring, envs, ...]`` instead, filled one row per group step with
whole-array writes; Python touches a single env only where that env's chunk or episode ends.

What it records is what ``EnvRunner`` records for the same steps: chunks of ``env.chunk_len``
transitions per env, cut at episode ends, numbered per env, with the bootstrap value of the
observation that follows; a simulator fault (a non-finite or absurdly large observation or
reward: ``rlvla3/algo/number_limits.py``) cuts the episode as a truncation and resets that
env (where the vector env can reset one env: ``VectorEnvs.reset_rows``); a native vector
env's reset step (``VectorStep.restarted``) is no transition.
"""

from __future__ import annotations

import numpy as np

from rlvla3.algo.number_limits import MAX_MAGNITUDE, usable_rows
from roles.env.chunk_sink import ChunkStream
from roles.env.env_slot import RESET_TRIES
from roles.env.episode_queue import FinishedEpisode
from roles.env.runner_thread import RunnerParts
from roles.env.step_ring import StepRing
from sim.env_group import EnvGroup, VectorEnvs, VectorStep
from transport.messages import ActionBatchReply


class VectorRunner:
    """Steps a ``VectorEnvs`` group, its bookkeeping in arrays, one entry per env."""

    def __init__(self, parts: RunnerParts, streams: list[ChunkStream], chunk_len: int) -> None:
        self.parts = parts
        self.streams = streams
        self.chunk_len = chunk_len
        """``env.chunk_len``: most transitions per chunk; in sync mode, steps per round."""
        n = len(streams)
        self.returns = np.zeros(n)
        self.lengths = np.zeros(n, np.int64)
        self.chunk_start = np.zeros(n, np.int64)  # the step each env's current chunk began at
        self.chunk_steps = np.zeros(n, np.int64)  # transitions in each env's current chunk
        self.first_version = np.zeros(n, np.int64)  # of each env's episode
        self.last_version = np.zeros(n, np.int64)
        self.all_greedy = np.zeros(n, bool)  # every action of the episode so far

    def run(self, envs: EnvGroup) -> None:
        assert isinstance(envs, VectorEnvs)
        self.envs, n = envs, len(self.streams)
        # (a chunk spans at most chunk_len steps plus the reset step a native vector env adds)
        obs_dim = envs.observation_space["state"].shape[0]
        self.ring = StepRing(2 * self.chunk_len + 2, n, obs_dim)
        with self.parts.meter.inside():
            obs = envs.reset_all()
        self.obs = self._finite_starts(obs, np.ones(n, bool), np.zeros(n, bool))
        reply = self._act()
        t, round_steps = 0, 0
        while not self.parts.stop_event.is_set():
            self._step(t, reply)
            t += 1
            round_steps += 1
            reply = self._act()
            round_over = self.parts.pacing.round_over(round_steps, self.chunk_len)
            full = range(n) if round_over else np.flatnonzero(self.chunk_steps >= self.chunk_len)
            for i in full:
                self._push_rows(t, i, float(reply.values[i]))
            fresh = self.parts.pacing.hold(reply, round_over, self._act, _version)
            reply = reply if fresh is None else fresh
            if round_over:
                round_steps = 0

    def _step(self, t: int, reply: ActionBatchReply) -> None:
        """Group step ``t`` on ``reply``'s actions: record it, end the episodes it ended, and
        leave the observations to act on next in ``self.obs``."""
        step = self.parts.meter.step(self.envs.step_arrays, reply.env_step_actions)
        recorded = ~step.restarted
        self.parts.meter.transitions(int(recorded.sum()))
        rewards, terminated, truncated, faults = self._faults(step, recorded)
        if self.parts.sink.trains:
            self.ring.write(t, self.obs, reply, step, rewards, terminated, truncated)
        self.returns += rewards
        self.lengths += recorded
        self.chunk_steps += recorded
        # (the oldest and newest version of an episode: replies from several servers can
        # come back at older versions)
        version = reply.policy_version
        self.first_version[recorded] = np.minimum(self.first_version[recorded], version)
        self.last_version[recorded] = np.maximum(self.last_version[recorded], version)
        self.all_greedy[recorded] &= reply.greedy
        self.parts.pacing.after_step()  # lock-step: every group of the worker finished this step
        done = terminated | truncated
        if done.any():
            self._end_episodes(t + 1, step, reply, done, terminated, faults)
        self.obs = self._finite_starts(step.next_obs, done | step.restarted, faults)

    def _act(self) -> ActionBatchReply:
        """The reply to every env's current observation; envs that have not stepped in their
        episode yet start it with its weight version."""
        reply = self.parts.client.act_on_states(self.obs)
        fresh = self.lengths == 0
        self.first_version[fresh] = reply.policy_version
        self.last_version[fresh] = reply.policy_version
        self.all_greedy[fresh] = reply.greedy
        return reply

    def _faults(
        self, step: VectorStep, recorded: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rewards and episode ends with simulator faults (a non-finite or absurd observation or reward)
        cut as truncations (reward 0 where it was not finite), and which rows faulted."""
        rewards, terminated, truncated = step.rewards, step.terminated, step.truncated
        finite_rewards = np.abs(rewards) <= np.float64(MAX_MAGNITUDE)  # (NaN fails it too)
        finite_obs = usable_rows(step.last_obs, len(step.last_obs))
        faults = recorded & ~(finite_rewards & finite_obs)
        if not faults.any():
            return rewards, terminated, truncated, faults
        for i in np.flatnonzero(faults):
            self.parts.counters.drop(
                "sim_faults",
                f"env {self.streams[i].env_index}: the simulator returned a "
                "non-finite (or absurdly large) observation or reward; episode cut there",
            )
        rewards = np.where(finite_rewards, rewards, 0.0)
        return rewards, terminated & ~faults, truncated | faults, faults

    def _finite_starts(
        self, obs: np.ndarray, starting: np.ndarray, faults: np.ndarray
    ) -> np.ndarray:
        """``obs`` once every env that starts an episode (rows ``starting``) has a finite
        observation to start from, and every env a fault cut (rows ``faults``) was reset.

        Gymnasium's sync and async vector envs reset those envs alone, again (up to
        ``RESET_TRIES`` times) while a reset gives an unusable observation. A native vector
        env cannot reset one env: a fault-cut env goes on from where it was, and one that would
        start from an unusable observation fails the worker, which its supervisor restarts.
        """
        redo = faults.copy()
        for attempt in range(RESET_TRIES + 1):
            broken = starting & ~usable_rows(obs, len(obs))
            if not (redo | broken).any():
                return obs
            if attempt == RESET_TRIES:
                break
            with self.parts.meter.inside():
                fresh = self.envs.reset_rows(redo | broken)
            if fresh is None:
                if not broken.any():
                    return obs
                raise RuntimeError(
                    f"envs {self._env_indices(broken)}: the vector env gave non-finite "
                    "observations to start an episode from, and cannot reset one env"
                )
            for i in np.flatnonzero(broken & ~redo):  # (a fault-cut env was counted already)
                self.parts.counters.drop(
                    "sim_faults",
                    f"env {self.streams[i].env_index}: non-finite (or absurdly large) "
                    "observation to start an episode from; resetting again",
                )
            obs, redo = fresh, np.zeros_like(faults)
        raise RuntimeError(
            f"envs {self._env_indices(broken)} ({self.parts.env_id}): {RESET_TRIES} resets in "
            "a row returned non-finite or absurdly large observations"
        )

    def _env_indices(self, rows: np.ndarray) -> list[int]:
        return [self.streams[i].env_index for i in np.flatnonzero(rows)]

    def _end_episodes(
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
            bootstrap[ask] = self.parts.client.act_on_states(step.last_obs[ask]).values
        for i in ended:
            self._push_rows(t, i, float(bootstrap[i]))
            self.parts.episodes.record(
                FinishedEpisode(
                    episode_return=float(self.returns[i]),
                    length=int(self.lengths[i]),
                    success=None if step.success is None else bool(step.success[i]),
                    versions=(int(self.first_version[i]), int(self.last_version[i])),
                    greedy=bool(self.all_greedy[i]),
                )
            )
        self.returns[ended] = 0.0
        self.lengths[ended] = 0

    def _push_rows(self, t: int, i: int, bootstrap_value: float) -> None:
        """Push env ``i``'s current chunk (its transitions since its chunk began, up to step
        ``t``) and start its next one."""
        start = int(self.chunk_start[i])
        self.chunk_start[i], self.chunk_steps[i] = t, 0
        if not self.parts.sink.trains:
            return
        rows = self.ring.rows(i, start, t)
        if len(rows):
            steps = self.ring.transitions(i, rows)
            self.parts.sink.push(self.streams[i], steps, bootstrap_value)


def _version(reply: ActionBatchReply) -> int:
    return reply.policy_version
