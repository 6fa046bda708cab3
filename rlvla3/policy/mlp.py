"""A small actor-critic MLP for classic-control envs (CartPole, Pendulum, ...).

Observations are ``{"state": float32[B, obs_dim]}``. A ``Discrete`` action space gets a
categorical head (actions int64[B]); a ``Box`` action space gets a diagonal Gaussian head with a
state-independent log-std (actions float32[B, D], log-probs summed over dims). Actor and critic are
separate MLPs, initialised orthogonally as in cleanrl's ``ppo.py``.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

from rlvla3.policy.base import (
    ActionSpec,
    ActorCritic,
    ActOutput,
    EvalOutput,
    NumpyActOutput,
    ObsBatch,
)
from rlvla3.policy.mlp_numpy import NumpyActorCritic, numpy_able, sample_one_discrete

_ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}


def _layer(in_dim: int, out_dim: int, gain: float) -> nn.Linear:
    """A linear layer with orthogonal weights (given gain) and zero bias."""
    layer = nn.Linear(in_dim, out_dim)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def _mlp(
    in_dim: int, hidden_sizes: tuple[int, ...], out_dim: int, activation: str, out_gain: float
) -> nn.Sequential:
    """MLP ``in_dim -> hidden_sizes... -> out_dim``; hidden layers use gain sqrt(2)."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {list(_ACTIVATIONS)}")
    layers: list[nn.Module] = []
    dim = in_dim
    for size in hidden_sizes:
        layers += [_layer(dim, size, math.sqrt(2.0)), _ACTIVATIONS[activation]()]
        dim = size
    layers.append(_layer(dim, out_dim, out_gain))
    return nn.Sequential(*layers)


class MLPPolicy(ActorCritic):
    """Separate actor and critic MLPs over ``obs["state"]``.

    Args:
        obs_dim: size of the flat state vector.
        action_space: ``gymnasium.spaces.Discrete`` (categorical head) or 1-D ``Box`` (Gaussian
            head; sampled actions are unbounded, ``to_env_action`` clips them to the box).
        hidden_sizes: widths of the hidden layers, shared by actor and critic.
        activation: ``"tanh"``, ``"relu"`` or ``"gelu"``.
    """

    def __init__(
        self,
        obs_dim: int,
        action_space: gym.spaces.Space,
        hidden_sizes: tuple[int, ...] = (64, 64),
        activation: str = "tanh",
    ) -> None:
        super().__init__()
        self.obs_dim = obs_dim
        if isinstance(action_space, gym.spaces.Discrete):
            self.discrete = True
            self.action_dim = int(action_space.n)
        elif isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
            self.discrete = False
            self.action_dim = int(action_space.shape[0])
            self.log_std = nn.Parameter(torch.zeros(self.action_dim))
            # Not persistent: bounds are config, not weights, and stay out of the state dict.
            low = torch.as_tensor(action_space.low, dtype=torch.float32)
            high = torch.as_tensor(action_space.high, dtype=torch.float32)
            self.register_buffer("action_low", low, persistent=False)
            self.register_buffer("action_high", high, persistent=False)
        else:
            raise TypeError(f"MLPPolicy supports Discrete or 1-D Box actions, got {action_space}")
        self.actor = _mlp(obs_dim, tuple(hidden_sizes), self.action_dim, activation, 0.01)
        self.critic = _mlp(obs_dim, tuple(hidden_sizes), 1, activation, 1.0)
        self._numpy: NumpyActorCritic | None = None  # built on first ``act_numpy``

    def action_spec(self) -> ActionSpec:
        """An index in ``[0, n)`` (Discrete), else ``float32[action_dim]``."""
        if self.discrete:
            return ActionSpec((), num_choices=self.action_dim)
        return ActionSpec((self.action_dim,))

    def _dist(self, state: torch.Tensor) -> Categorical | Normal:
        """The action distribution for float32[B, obs_dim] states."""
        out = self.actor(state)
        if self.discrete:
            return Categorical(logits=out, validate_args=False)
        return Normal(out, self.log_std.exp().expand_as(out), validate_args=False)

    def _log_prob_entropy(
        self, dist: Categorical | Normal, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32[B] log-prob of ``action`` and float32[B] entropy (summed over action dims)."""
        if self.discrete:
            return dist.log_prob(action.long()), dist.entropy()
        return dist.log_prob(action).sum(-1), dist.entropy().sum(-1)

    def _value(self, state: torch.Tensor) -> torch.Tensor:
        """float32[B] critic value."""
        return self.critic(state).squeeze(-1)

    def act(self, obs: ObsBatch, deterministic: bool = False) -> ActOutput:
        """Sample (or take the mode of) an action for each state.

        Args:
            obs: ``{"state": float32[B, obs_dim]}``.
            deterministic: take the argmax (discrete) or the mean (Gaussian) instead of sampling.

        Returns:
            ``ActOutput`` with action int64[B] (discrete) or float32[B, D] (Box), log_prob
            float32[B] and value float32[B].
        """
        state = obs["state"].float()
        if self.discrete:
            # Serving hot path: a handful of tensor ops instead of a torch.distributions object
            # (constructing, sampling and scoring a Categorical costs ~4x more at small batches).
            log_p = torch.log_softmax(self.actor(state), dim=-1)
            if deterministic:
                action = log_p.argmax(-1)
            else:  # Gumbel-max: argmax(log p + Gumbel noise) is an exact sample of Categorical(p)
                action = (log_p - torch.empty_like(log_p).exponential_().log()).argmax(-1)
            log_prob = log_p.gather(-1, action[:, None]).squeeze(-1)
            return ActOutput(action=action, log_prob=log_prob, value=self._value(state))
        dist = self._dist(state)
        action = dist.mean if deterministic else dist.sample()
        log_prob, _ = self._log_prob_entropy(dist, action)
        return ActOutput(action=action, log_prob=log_prob, value=self._value(state))

    def value_parameters(self) -> list[nn.Parameter]:
        """The critic network's parameters (actor and critic share nothing)."""
        return list(self.critic.parameters())

    def head_parameter_prefixes(self) -> tuple[str, ...]:
        """The actor's output layer (and log-std) and the whole critic (nothing else uses it)."""
        return (f"actor.{len(self.actor) - 1}", "log_std", "critic")

    def evaluate(self, obs: ObsBatch, action: torch.Tensor) -> EvalOutput:
        """Log-prob, entropy and value for given states and actions.

        Args:
            obs: ``{"state": float32[B, obs_dim]}``.
            action: int64[B] (discrete) or float32[B, D] (Box).

        Returns:
            ``EvalOutput`` with log_prob, entropy and value, each float32[B].
        """
        state = obs["state"].float()
        dist = self._dist(state)
        log_prob, entropy = self._log_prob_entropy(dist, action)
        return EvalOutput(log_prob=log_prob, entropy=entropy, value=self._value(state))

    def act_numpy(
        self, obs: dict[str, np.ndarray], deterministic: bool, rng: np.random.Generator
    ) -> NumpyActOutput | None:
        """``act`` + ``to_env_action`` in numpy, for a rollout server on CPU.

        At serving batch sizes the MLP is a few tiny matrix products, and torch's per-op and
        per-module overhead is most of the time: on the CI machine ``act`` took 263 µs for one
        CartPole state and this path ~90 µs, which shortens every env's action round trip (see
        ``rlvla3/policy/mlp_numpy.py`` for the forward). Rebuilt whenever a parameter moves or
        changes in place, so weight updates are seen at once. None on GPU or for GELU (numpy
        has no erf); the caller then uses ``act``. Not re-entrant (one serving thread).
        """
        if self._numpy is None or not self._numpy.current():
            if not numpy_able(self, self.actor, self.critic):
                return None
            extra = (
                {}
                if self.discrete
                else {"log_std": self.log_std, "low": self.action_low, "high": self.action_high}
            )
            self._numpy = NumpyActorCritic(self, self.actor, self.critic, extra)
        out, value = self._numpy(np.asarray(obs["state"], dtype=np.float32))
        if self.discrete and len(out) == 1:
            action, log_prob = sample_one_discrete(out[0].tolist(), deterministic, rng)
            actions = np.array([action])
            return NumpyActOutput(
                action=actions,
                env_action=actions,
                log_prob=np.array([log_prob], np.float32),
                value=value,
            )
        if self.discrete:
            # At small batches the head's cost is its count of numpy calls: the log-normaliser in
            # one (logaddexp.reduce is stable without shifting the logits), Gumbel-max as in
            # ``act``, indexing rather than take_along_axis (3x faster at these sizes).
            log_norm = np.logaddexp.reduce(out, axis=-1)
            if deterministic:
                action = out.argmax(-1)
            else:
                action = (out + rng.gumbel(size=out.shape)).argmax(-1)
            log_prob = out[np.arange(len(action)), action] - log_norm
            return NumpyActOutput(action=action, env_action=action, log_prob=log_prob, value=value)
        log_std = self._numpy.views["log_std"]
        if deterministic:
            action = out
        else:
            action = out + np.exp(log_std) * rng.standard_normal(out.shape, dtype=np.float32)
        z = (action - out) * np.exp(-log_std)
        log_prob = (-0.5 * z * z - log_std - _HALF_LOG_2PI).sum(-1, dtype=np.float32)
        env_action = np.clip(action, self._numpy.views["low"], self._numpy.views["high"])
        return NumpyActOutput(action=action, env_action=env_action, log_prob=log_prob, value=value)

    def to_env_action(self, action: torch.Tensor) -> torch.Tensor:
        """The action the env steps with: Gaussian samples clipped to the Box bounds.

        The unclipped ``action`` is what training scores with ``evaluate``.
        """
        if self.discrete:
            return action
        return torch.clamp(action, self.action_low, self.action_high)


_HALF_LOG_2PI = np.float32(0.5 * math.log(2 * math.pi))
