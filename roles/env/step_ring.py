"""A vector env group's recent steps as arrays, one row per group step (``VectorRunner``)."""

from __future__ import annotations

import numpy as np

from roles.env.chunk_sink import Transitions
from sim.env_group import VectorStep
from transport.messages import ActionBatchReply


class StepRing:
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
        """Keep group step ``t``: ``obs`` acted on by ``reply``, with what ``step`` gave (its
        rewards and episode ends after fault handling)."""
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

    def transitions(self, env: int, rows: np.ndarray) -> Transitions:
        """Env ``env``'s transitions in ring ``rows``."""
        assert self.actions is not None
        return Transitions(
            obs={"state": self.obs[rows, env]},
            actions=self.actions[rows, env],
            rewards=self.rewards[rows, env],
            terminated=self.terminated[rows, env],
            truncated=self.truncated[rows, env],
            log_probs=self.log_probs[rows, env],
            values=self.values[rows, env],
            policy_versions=self.versions[rows],
        )
