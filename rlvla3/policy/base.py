"""The one interface every policy implements, shared by rollout servers, RL and SFT trainers.

Observations are dicts of batched tensors, the same keys the env workers put on the wire:

- classic control: ``{"state": float32[B, obs_dim]}``
- VLA tasks: ``{"image": uint8[B, H, W, 3], "instruction": int32[B, L] (byte tokens, 0 = pad),
  "proprio": float32[B, P]}``
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

ObsBatch = dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class ActOutput:
    """What a policy returns when it acts.

    Attributes:
        action: int64[B] for discrete heads, int64[B, D] for binned action tokens,
            float32[B, D] for Gaussian heads.
        log_prob: float32[B], log-probability of ``action`` under the policy (summed over dims).
        value: float32[B], the critic's estimate for the observation.
    """

    action: torch.Tensor
    log_prob: torch.Tensor
    value: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalOutput:
    """What a policy returns when it re-scores actions during training.

    Attributes:
        log_prob: float32[B], log-probability of the given actions.
        entropy: float32[B], entropy of the action distribution.
        value: float32[B], the critic's estimate.
        aux_loss: float32[B] or None, a per-sample loss the policy adds to RL's (weighted
            already; a token VLA's plan supervised by privileged labels, ``plan.rl_coef``).
    """

    log_prob: torch.Tensor
    entropy: torch.Tensor
    value: torch.Tensor
    aux_loss: torch.Tensor | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class NumpyActOutput:
    """``act`` followed by ``to_env_action``, as numpy arrays (a serving fast path's result).

    Attributes:
        action, log_prob, value: as in ``ActOutput``.
        env_action: what the env steps with; ``action`` itself (the same object) when the
            policy steps with its actions unchanged, so servers can send it once.
    """

    action: np.ndarray
    env_action: np.ndarray
    log_prob: np.ndarray
    value: np.ndarray


@dataclass(frozen=True, slots=True)
class ActionSpec:
    """What one of the policy's own actions (``act``'s ``action``, a chunk's ``actions[t]``) is.

    Attributes:
        shape: per-call shape, e.g. ``()`` for a discrete index, ``(7,)`` for 7 bins or floats,
            ``(K, 7)`` for an action chunk of K steps.
        num_choices: integer actions in ``[0, num_choices)``; None: finite floats.
        env_steps: env steps one action covers: 1, or K for an action chunk, whose env action
            is ``[K, ...]`` (the env worker steps ``env_action[k]`` in order).
    """

    shape: tuple[int, ...]
    num_choices: int | None = None
    env_steps: int = 1


class ActorCritic(nn.Module, abc.ABC):
    """A policy with a value head. Subclasses implement ``act``, ``evaluate``, ``action_spec``."""

    @abc.abstractmethod
    def action_spec(self) -> ActionSpec:
        """The form of this policy's actions (the trainer checks received chunks against it)."""

    @abc.abstractmethod
    def act(self, obs: ObsBatch, deterministic: bool = False) -> ActOutput:
        """Sample (or take the mode of) an action for each observation in the batch."""

    @abc.abstractmethod
    def evaluate(self, obs: ObsBatch, action: torch.Tensor) -> EvalOutput:
        """Log-probability, entropy and value for given observations and actions."""

    lora_trained: tuple[str, ...] | None = None
    """With LoRA (``rlvla3/policy/lora.py`` sets it): the state-dict keys that train, its
    adapters and heads; None: every parameter trains."""

    def value_parameters(self) -> list[nn.Parameter]:
        """The parameters only the value estimate uses (they get ``algo.value_lr``); none
        unless overridden."""
        return []

    def head_parameter_prefixes(self) -> tuple[str, ...]:
        """Parameter-name prefixes of the action and value heads (``"value_head"`` covers
        ``value_head.*``). With LoRA they train in full beside the adapters and get no adapter
        of their own: a head is small and specific to the task. None unless overridden."""
        return ()

    def trained_state_names(self) -> list[str] | None:
        """The state-dict keys that training changes when that is not the whole state (with
        LoRA: adapters and heads). The weight sync ships only these and checkpoints hold only
        these; every role loads the frozen rest itself. None: the whole state."""
        return None if self.lora_trained is None else list(self.lora_trained)

    def act_numpy(
        self, obs: dict[str, np.ndarray], deterministic: bool, rng: np.random.Generator
    ) -> NumpyActOutput | None:
        """Optional serving fast path: ``act`` + ``to_env_action`` in numpy, for policies small
        enough that torch's per-op overhead dominates. Same distribution as ``act``; None when
        the policy has no such path (the caller then uses ``act``)."""
        return None

    def to_env_action(self, action: torch.Tensor) -> torch.Tensor:
        """What the env steps with, given an action from ``act`` (identity unless overridden)."""
        return action

    def from_env_action(self, env_action: torch.Tensor) -> torch.Tensor:
        """The policy's own action for an env action, e.g. a demonstration's (inverse of
        ``to_env_action`` up to discretisation; identity unless overridden)."""
        return env_action

    def demo_action(self, obs: ObsBatch, env_action: torch.Tensor) -> torch.Tensor:
        """The policy's own action for demonstration frames: ``from_env_action`` of their env
        actions, with whatever else a policy's action holds taken from the frames' observations
        (a token VLA's plan)."""
        return self.from_env_action(env_action)

    def demo_evaluate(self, obs: ObsBatch, action: torch.Tensor) -> EvalOutput:
        """``evaluate`` as behaviour cloning scores ``demo_action``'s actions (the same unless a
        policy leaves part of its action out of RL's log-prob, as a token VLA's greedy plan)."""
        return self.evaluate(obs, action)
