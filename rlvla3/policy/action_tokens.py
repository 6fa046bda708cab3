"""Actions as tokens: which vocabulary ids are action tokens, and bins <-> env actions.

A continuous action space ``Box(low, high, (D,))`` is cut into ``bins`` uniform bins per
dimension (OpenVLA's discretisation); the policy's action is int64[B, D] bin indices and the env
steps with the bin centres. A discrete space ``Discrete(n)`` is one dimension of ``n`` choices:
the policy's action is int64[B, 1], the env's the int64[B] index. An action chunk of K steps
adds a step axis before the dimensions: int64[B, K, D] bins, float32[B, K, D] centres or
int64[B, K] indices. With ``policy.token_vla.plan`` the action starts with P plan bins that the
env never sees: int64[B, P + D], of which the env steps with the last D.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gymnasium import spaces
from torch import Tensor

from rlvla3.config.token_vla import TokenVLAConfig
from rlvla3.config.typed_load import ConfigError
from rlvla3.policy.vla import bins_to_continuous, continuous_to_bins

_FIELD = "policy.token_vla"


@dataclass(frozen=True, slots=True)
class ActionBins:
    """How the policy's bin indices map to env actions.

    Attributes:
        dims: action dimensions D (tokens decoded per step).
        bins: choices per dimension (action tokens).
        low, high: float64[D] bin edges of a continuous space; None for a discrete one.
        steps: env steps per action (``action_steps``): above 1, an action chunk.
        plan: plan values P before the action dimensions (``policy.token_vla.plan``; steps 1).
        plan_edges: ``(low, high)`` of every plan value's bins.
    """

    dims: int
    bins: int
    low: np.ndarray | None = None
    high: np.ndarray | None = None
    steps: int = 1
    plan: int = 0
    plan_edges: tuple[float, float] = (-1.0, 1.0)

    @property
    def action_shape(self) -> tuple[int, ...]:
        """One action's shape: ``(P + D,)``, or ``(K, D)`` for an action chunk of K steps."""
        return (self.plan + self.dims,) if self.steps == 1 else (self.steps, self.dims)

    @property
    def tokens(self) -> int:
        """Tokens one call decodes: the plan's, then K x D action tokens."""
        return self.plan + self.steps * self.dims

    @property
    def discrete(self) -> bool:
        """Whether the env takes one discrete index (``Discrete(n)``)."""
        return self.low is None

    def to_env(self, action: Tensor) -> Tensor:
        """Bin indices int64[..., D] -> bin centres float32[..., D], or the index int64[...]
        (a plan's bins dropped first)."""
        action = action[..., self.plan :]
        if self.discrete:
            return action[..., 0]
        low, high = self._edges(action.device)
        return bins_to_continuous(action, low=low, high=high, num_bins=self.bins)

    def plan_bins(self, values: Tensor) -> Tensor:
        """Plan values float[..., P] -> their bins int64[..., P]."""
        low, high = self.plan_edges
        return continuous_to_bins(values, low=low, high=high, num_bins=self.bins)

    def from_env(self, env_action: Tensor) -> Tensor:
        """Env actions (float[..., D], or int[...] indices) -> bin indices int64[..., D] (without
        a plan's: ``plan_bins``)."""
        if self.discrete:
            return env_action.long().reshape(-1, *self.action_shape)
        low, high = self._edges(env_action.device)
        return continuous_to_bins(env_action, low=low, high=high, num_bins=self.bins)

    def _edges(self, device: torch.device) -> tuple[Tensor, Tensor]:
        # float64 edges: the bin arithmetic of rlvla3.policy.vla broadcasts over dimensions
        return (
            torch.as_tensor(self.low, dtype=torch.float64, device=device),
            torch.as_tensor(self.high, dtype=torch.float64, device=device),
        )


def action_bins(space: spaces.Space, config: TokenVLAConfig) -> ActionBins:
    """The binning of ``space`` (edges from the space unless ``action_low``/``action_high`` set
    them). Raises one ``ConfigError`` naming the field when the space cannot be binned."""
    plan = config.plan
    planned = {"plan": plan.dims, "plan_edges": (plan.low, plan.high)} if plan else {}
    if isinstance(space, spaces.Discrete):
        if plan is not None:
            raise ConfigError(f"{_FIELD}.plan: plan tokens need a continuous action space")
        return ActionBins(dims=1, bins=int(space.n), steps=config.action_steps)
    if not isinstance(space, spaces.Box) or len(space.shape) != 1:
        raise ConfigError(
            f"{_FIELD}: the env's action space {space} cannot be action tokens "
            "(a Discrete(n) or a one-dimensional Box)"
        )
    dims = int(space.shape[0])
    low = _edge(config.action_low, space.low, dims, "action_low")
    high = _edge(config.action_high, space.high, dims, "action_high")
    if not (low < high).all():
        raise ConfigError(f"{_FIELD}.action_low: must be below action_high in every dimension")
    return ActionBins(
        dims=dims, bins=config.bins, low=low, high=high, steps=config.action_steps, **planned
    )


def _edge(configured: Sequence[float] | None, from_space: np.ndarray, dims: int, name: str):
    if configured is None:
        values = np.asarray(from_space, np.float64)
        if not np.isfinite(values).all():
            raise ConfigError(
                f"{_FIELD}.{name}: the env's action space is unbounded there; set the bin edges"
            )
        return values
    if len(configured) not in (1, dims):
        raise ConfigError(
            f"{_FIELD}.{name}: one value or {dims} (the action dims), got {configured}"
        )
    return np.broadcast_to(np.asarray(configured, np.float64), (dims,)).copy()


def action_token_ids(vocab_size: int, bins: int, special_ids: Iterable[int]) -> list[int]:
    """The ``bins`` highest vocabulary ids that are no special token (image, pad, eos...),
    ascending: bin ``k`` is the ``k``-th of them. ``vocab_size`` counts the output embedding's
    rows: a model with rows to spare beyond its tokenizer's tokens (padded to a round number)
    gets those, which no text uses; otherwise the last ids are its rarest tokens (OpenVLA's
    choice). Some families put their image tokens there; feeding one of those back as an
    action would make the model look for an image."""
    special = set(special_ids)
    ids = [i for i in range(vocab_size - 1, -1, -1) if i not in special][:bins]
    if len(ids) < bins:
        raise ConfigError(
            f"{_FIELD}.bins: the model's vocabulary has {vocab_size} ids, of which {len(ids)} "
            f"are not special tokens; {bins} action tokens (bins, or the n of a Discrete(n) "
            "action space) do not fit"
        )
    return sorted(ids)
