"""The actor-critic MLP's forward pass in numpy, for a rollout server on CPU.

At serving batch sizes an MLP's forward is a few tiny matrix products, and the cost is the
per-call overhead of each numpy operation, not the arithmetic: at batch 1 a 64x64 actor and
critic are 16 calls (a product, a bias add and an activation per layer). So small batches run
actor and critic fused into one chain (``FusedActorCritic``): layer 1's weights side by side,
deeper layers block-diagonal, biases folded into the products as a row multiplied by a constant
1 column; 6 calls instead of 16. The block-diagonal products multiply zeros too, which costs
more than the saved calls once a batch is large (``FusedActorCritic.fits``), so large batches
run actor and critic separately on zero-copy views of the parameters (``MLPViews``).

The fused weights are copies, so they must be rebuilt whenever a parameter changes:
``NumpyActorCritic.current`` compares every parameter's storage address and torch version
counter. In-place torch writes bump the counter; a write into a flat buffer the parameters are
views of (``transport.weights.FlatLayout.bind``) bumps it too, since they share the buffer's
counter, and ``WeightLink.recv_body`` bumps it after a collective wrote the buffer behind
torch's back.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

_RELU_ZERO = np.float32(0)


def _relu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    return np.maximum(x, _RELU_ZERO, out=out)


ACTIVATIONS: dict[type[nn.Module], Callable[..., np.ndarray]] = {nn.Tanh: np.tanh, nn.ReLU: _relu}
"""Activations with a numpy form (each can write in place, ``out=``)."""

_FUSED_MAX_PRODUCTS = 64 * 64 * 16
"""Largest batch x widest-hidden-layer squared that runs fused: below it numpy's per-call
overhead dominates (fusing halves the calls); above it the block-diagonal's wasted products do
(measured on a 2-core CPU: 64-wide layers gain up to batch 16, 256-wide ones only at batch 1)."""


def _view(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()  # shares the parameter's memory


def _linears(seq: nn.Sequential) -> list[nn.Linear]:
    return [m for m in seq if isinstance(m, nn.Linear)]


def numpy_able(policy: nn.Module, *seqs: nn.Sequential) -> bool:
    """Whether ``seqs`` (Linear and activation layers) can run in numpy: float32 on the CPU,
    and every activation one that numpy has (not GELU: numpy has no erf)."""
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in policy.parameters()):
        return False
    return all(isinstance(m, nn.Linear) or type(m) in ACTIVATIONS for s in seqs for m in s)


def _max_fused_batch(actor: nn.Sequential) -> int:
    """The largest batch that runs fused (``_FUSED_MAX_PRODUCTS``)."""
    widest = max((m.out_features for m in _linears(actor)[:-1]), default=1)
    return _FUSED_MAX_PRODUCTS // (widest * widest)


class MLPViews:
    """An ``nn.Sequential`` of Linear and activation layers, run on numpy views of its weights."""

    def __init__(self, seq: nn.Sequential) -> None:
        self.steps: list[tuple[np.ndarray, np.ndarray] | Callable[..., np.ndarray]] = []
        for layer in seq:
            if isinstance(layer, nn.Linear):
                self.steps.append((_view(layer.weight).T, _view(layer.bias)))
            else:
                self.steps.append(ACTIVATIONS[type(layer)])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        for step in self.steps:
            x = x @ step[0] + step[1] if type(step) is tuple else step(x)
        return x


class FusedActorCritic:
    """Actor and critic of the same depth and activations as one chain of products on copies
    of their weights: each layer's input has a trailing column of ones and the weight matrix a
    trailing bias row, so a layer is one product and one in-place activation.

    Not re-entrant: the hidden-layer buffers are reused per batch size.
    """

    def __init__(self, actor: nn.Sequential, critic: nn.Sequential) -> None:
        self.activations = [ACTIVATIONS[type(m)] for m in actor if not isinstance(m, nn.Linear)]
        self.weights: list[np.ndarray] = []
        for depth, (a, c) in enumerate(zip(_linears(actor), _linears(critic), strict=True)):
            a_in = a.in_features
            c_rows = slice(0, a_in) if depth == 0 else slice(a_in, a_in + c.in_features)
            rows = (a_in if depth == 0 else a_in + c.in_features) + 1
            w = np.zeros((rows, a.out_features + c.out_features), np.float32)
            w[:a_in, : a.out_features] = _view(a.weight).T
            w[c_rows, a.out_features :] = _view(c.weight).T
            w[-1, : a.out_features] = _view(a.bias)
            w[-1, a.out_features :] = _view(c.bias)
            self.weights.append(w)
        self.actor_width = _linears(actor)[-1].out_features
        self.max_batch = _max_fused_batch(actor)
        self._buffers: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}

    @staticmethod
    def of(actor: nn.Sequential, critic: nn.Sequential) -> FusedActorCritic | None:
        """The fused pair, or None where actor and critic differ in depth or activations, or
        where layers are too wide for even batch 1 to gain (no copies of large weights)."""
        kinds = [[type(m) for m in seq] for seq in (actor, critic)]
        if kinds[0] != kinds[1] or kinds[0][-1] is not nn.Linear or _max_fused_batch(actor) < 1:
            return None
        return FusedActorCritic(actor, critic)

    def fits(self, batch: int) -> bool:
        """Whether a batch this large is cheaper fused (see ``_FUSED_MAX_PRODUCTS``)."""
        return batch <= self.max_batch

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(actor output [B, A], critic value [B])`` for states ``x`` [B, obs_dim]."""
        buffers = self._buffers.get(len(x))
        if buffers is None:
            # per layer: its input [B, in + 1], the last column all ones, and the view of it
            # the previous layer writes (the slicing, once per batch size rather than per call)
            inputs = [np.ones((len(x), w.shape[0]), np.float32) for w in self.weights]
            buffers = inputs, [h[:, :-1] for h in inputs]
            self._buffers[len(x)] = buffers
        inputs, writable = buffers
        writable[0][...] = x
        for w, act, h, out in zip(
            self.weights[:-1], self.activations, inputs[:-1], writable[1:], strict=True
        ):
            np.matmul(h, w, out=out)
            act(out, out=out)
        out = inputs[-1] @ self.weights[-1]  # fresh: the caller may keep views of it
        return out[:, : self.actor_width], out[:, self.actor_width]


class NumpyActorCritic:
    """An MLP actor-critic's forward in numpy: fused for small batches, on views of the
    parameters for large ones; valid while no parameter moved or changed (``current``)."""

    def __init__(
        self,
        policy: nn.Module,
        actor: nn.Sequential,
        critic: nn.Sequential,
        extra: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``extra``: other tensors of ``policy`` the caller reads in numpy, as ``views``."""
        # Where each parameter lives, not the Parameter objects: rebinding to a flat buffer
        # puts new ones there.
        self.slots = [
            (m._parameters, name)
            for m in policy.modules()
            for name, p in m._parameters.items()
            if p is not None
        ]
        params = self._params()
        self.pointers = [p.data_ptr() for p in params]
        self.versions = [p._version for p in params]
        self.actor, self.critic = MLPViews(actor), MLPViews(critic)
        self.fused = FusedActorCritic.of(actor, critic)
        self.views = {name: _view(t) for name, t in (extra or {}).items()}

    def _params(self) -> list[torch.Tensor]:
        return [params[name] for params, name in self.slots]

    def current(self) -> bool:
        """False once a parameter was replaced or moved (e.g. bound to a flat buffer) or its
        values changed in place: rebuild."""
        params = self._params()
        return [p._version for p in params] == self.versions and [
            p.data_ptr() for p in params
        ] == self.pointers

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(actor output [B, A], critic value [B])`` for float32 states ``x`` [B, obs_dim]."""
        if self.fused is not None and self.fused.fits(len(x)):
            return self.fused(x)
        return self.actor(x), self.critic(x)[:, 0]


def sample_one_discrete(
    logits: list[float], deterministic: bool, rng: np.random.Generator
) -> tuple[int, float]:
    """(action, its log-probability) for one state's logits, in Python floats: for a single
    state every numpy call costs more than the arithmetic it does. Greedy: the first argmax;
    else an inverse-CDF draw from the softmax (the distribution the batched Gumbel-max draws
    from)."""
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    action = logits.index(top)
    if not deterministic:
        threshold = rng.random() * total
        for i, weight in enumerate(weights):
            threshold -= weight
            if threshold < 0:
                action = i
                break
    return action, logits[action] - top - math.log(total)
