"""Mixed precision for SFT: bf16 autocast on GPU, FP8 where the GPU can.

FP8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper) and one of two backends,
chosen by ``fp8_backend``:

- ``transformer_engine`` (preferred when it imports): ``enable_fp8`` swaps every ``nn.Linear``
  whose sizes FP8 GEMMs accept for a ``transformer_engine.pytorch.Linear`` (same weights, new
  parameters: build the optimizer afterwards) and trains under ``te.autocast`` inside bf16
  autocast, with the block-wise scaling recipe (``Float8BlockScaling``: 1x128 blocks for
  activations and gradients, 128x128 for weights) where TE says the GPU supports it, else
  per-tensor current scaling. The swapped linears keep ``nn.Linear``'s interface: any leading
  dimensions, token counts that are not a multiple of 16 (TE's FP8 GEMMs need one; the rows are
  zero-padded), and the same state-dict keys (TE's FP8 metadata is left out of checkpoints).
- ``torch_scaled_mm`` (no extra install): every such linear becomes a ``Float8Linear``, which runs
  its three GEMMs (forward, input gradient, weight gradient) through ``torch._scaled_mm`` with
  dynamic per-tensor scaling: inputs and weights in e4m3, gradients in e5m2 (more range, less
  precision, as gradients need), bf16 / fp32 outputs. Parameters stay ``weight`` / ``bias`` in
  float32, so checkpoints and the weight broadcast's flat layout do not change.

On CPU, or on a GPU without FP8, training runs in float32 / bf16 unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Context = Callable[[], contextlib.AbstractContextManager[Any]]

_log = logging.getLogger(__name__)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FP8_ALIGN = 16  # FP8 GEMMs need every matrix dimension divisible by 16


def fp8_backends(device: torch.device) -> list[str]:
    """The FP8 backends usable on ``device``, best first (empty: no FP8 there)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return []
    if torch.cuda.get_device_capability(device) < (8, 9):
        return []
    found = []
    try:
        import transformer_engine.pytorch  # noqa: F401

        found.append("transformer_engine")
    except ImportError:
        pass
    if hasattr(torch, "_scaled_mm"):
        found.append("torch_scaled_mm")
    return found


def fp8_backend(device: torch.device) -> str | None:
    """The best FP8 backend on ``device``: ``"transformer_engine"``, ``"torch_scaled_mm"`` or
    None."""
    backends = fp8_backends(device)
    return backends[0] if backends else None


def enable_fp8(model: nn.Module, backend: str | None = None) -> Context:
    """Swap the model's FP8-sized linears in place; return the context to train under.

    ``backend`` defaults to ``fp8_backend`` of the model's device. Call it before building the
    optimizer: Transformer Engine's linears hold new parameters (``torch_scaled_mm`` keeps them).
    """
    if backend is None:
        backend = fp8_backend(next(model.parameters()).device)
    if backend == "transformer_engine":
        import transformer_engine.pytorch as te

        _swap_linears(model, lambda old: _te_linear(te, old))
        return _te_context(te, te_recipe(te))
    if backend == "torch_scaled_mm":
        _swap_linears(model, Float8Linear.from_linear)
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    raise ValueError(f"no FP8 backend {backend!r}: expected transformer_engine or torch_scaled_mm")


def _fp8_sized(linear: nn.Linear) -> bool:
    return linear.in_features % _FP8_ALIGN == 0 and linear.out_features % _FP8_ALIGN == 0


def _swap_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and not isinstance(child, Float8Linear):
            if _fp8_sized(child):
                setattr(module, name, make(child))
        else:
            _swap_linears(child, make)


def te_recipe(te: Any) -> Any:
    """The FP8 recipe for Transformer Engine module ``te`` (``transformer_engine.pytorch``).

    ``Float8BlockScaling`` where TE reports the GPU supports it (Hopper and later, CUDA >= 12.9);
    else ``Float8CurrentScaling`` (per-tensor, computed on the fly); TE releases older than both
    get ``DelayedScaling``. The choice and TE's reason are logged.
    """
    from transformer_engine.common import recipe

    reason = "this Transformer Engine has no block-wise recipe"
    if hasattr(recipe, "Float8BlockScaling") and hasattr(te, "is_fp8_block_scaling_available"):
        available, reason = te.is_fp8_block_scaling_available(return_reason=True)
        if available:
            _log.info("FP8 recipe: Float8BlockScaling (Transformer Engine)")
            return recipe.Float8BlockScaling()
    fallback = getattr(recipe, "Float8CurrentScaling", None) or recipe.DelayedScaling
    _log.info("FP8 recipe: %s, not block-wise scaling: %s", fallback.__name__, reason)
    return fallback()


def _te_context(te: Any, fp8_recipe: Any) -> Context:
    """bf16 autocast around TE's FP8 autocast (``te.autocast``; ``te.fp8_autocast`` before TE 2.9).

    bf16 autocast covers what TE does not run in FP8 (attention, norms, the small linears)."""

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        if hasattr(te, "autocast"):
            fp8 = te.autocast(enabled=True, recipe=fp8_recipe)
        else:
            fp8 = te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)
        with torch.autocast("cuda", dtype=torch.bfloat16), fp8:
            yield

    return context


def _te_linear(te: Any, old: nn.Linear) -> nn.Module:
    new = _te_linear_class(te)(
        old.in_features,
        old.out_features,
        bias=old.bias is not None,
        params_dtype=old.weight.dtype,
        device=old.weight.device,
    )
    with torch.no_grad():
        new.weight.copy_(old.weight)
        if old.bias is not None:
            new.bias.copy_(old.bias)
    return new


@functools.cache
def _te_linear_class(te: Any) -> type[nn.Module]:
    """A ``te.Linear`` with ``nn.Linear``'s interface (made once per TE module, which is optional
    and so cannot be subclassed at import)."""

    class PaddedTELinear(te.Linear):  # type: ignore[misc,name-defined]
        """``te.Linear`` that takes any ``[..., in_features]`` input and any token count.

        TE's FP8 GEMMs need the token count divisible by 8 (and 16 is what the GEMMs like); a
        packed batch has whatever count its documents add up to, so zero rows are appended and
        their outputs dropped (zero inputs add nothing to the weight gradient). TE's extra state
        (FP8 scaling metadata) is left out of the state dict, so checkpoints keep ``nn.Linear``'s
        keys and load into the same policy without TE (the RL trainer, the rollout servers).
        """

        get_extra_state = nn.Module.get_extra_state
        set_extra_state = nn.Module.set_extra_state

        def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
            rows = x.reshape(-1, self.in_features)
            pad = -rows.shape[0] % _FP8_ALIGN
            out = super().forward(F.pad(rows, (0, 0, 0, pad)) if pad else rows)
            if pad:
                out = out[: rows.shape[0]]
            return out.reshape(*x.shape[:-1], self.out_features)

    return PaddedTELinear


def quantize(x: Tensor, dtype: torch.dtype, pad_rows: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Per-tensor dynamic scaling of a matrix: ``(x8, x8_t, scale)``, ``x ≈ x8.float() * scale``.

    The scale maps ``x``'s largest magnitude onto the format's largest finite value, so nothing
    overflows and the full range of the 8 bits is used. ``x8`` is row-major; ``x8_t`` is its
    transpose, also row-major (the GEMMs of the backward pass need both layouts, and writing
    both while casting is cheaper than transposing 1-byte elements afterwards). ``pad_rows``
    zero rows are appended first (FP8 GEMMs need dimensions divisible by 16).
    """
    amax = torch.linalg.vector_norm(x.detach(), ord=float("inf")).float()  # one pass: max |x|
    scale = amax.clamp(min=1e-12) / torch.finfo(dtype).max
    cast = _compiled_cast() if x.is_cuda else _cast_both
    # detach: no gradient flows through the cast, and a view (a reshape, a slice) would make
    # the compiled cast guard on its base's strides and recompile until it gave up (seen on GPU)
    x8, x8_t = cast(x.detach(), scale, dtype, pad_rows)
    return x8, x8_t, scale


def _cast_both(
    x: Tensor, scale: Tensor, dtype: torch.dtype, pad_rows: int
) -> tuple[Tensor, Tensor]:
    fmax = torch.finfo(dtype).max
    # always pad (by 0 too): a branch on pad_rows would double the compiled variants
    x = F.pad(x, (0, 0, 0, pad_rows))
    x8 = (x.float() / scale).clamp(-fmax, fmax).to(dtype)
    return x8, x8.t().contiguous()


@functools.cache
def _compiled_cast() -> Callable[..., tuple[Tensor, Tensor]]:
    """``_cast_both`` fused into one kernel on CUDA (read once, write both layouts). Eager, the
    scaling took more GPU time than the FP8 GEMMs it feeds (H100 profile, bench/packing.py)."""
    return torch.compile(_cast_both, dynamic=True)


class _Float8MatMul(torch.autograd.Function):
    """``x @ weight.T`` with FP8 operands in all three GEMMs (see module docstring).

    ``_scaled_mm(a, b)`` takes ``a`` row-major and ``b`` column-major; a row-major transpose
    ``t`` read as ``t.t()`` is the column-major original.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, out_dtype: torch.dtype) -> Tensor:
        rows = x.shape[0]
        pad = -rows % _FP8_ALIGN
        x8, x8_t, sx = quantize(x, E4M3, pad)
        w8, w8_t, sw = quantize(weight, E4M3)
        ctx.save_for_backward(x8_t, sx, w8_t, sw)
        ctx.rows, ctx.pad, ctx.weight_dtype = rows, pad, weight.dtype
        out = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=out_dtype)
        return out[:rows] if pad else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x8_t, sx, w8_t, sw = ctx.saved_tensors
        g8, g8_t, sg = quantize(grad, E5M2, ctx.pad)
        # dX[M, K] = dY[M, N] @ W[N, K];  dW[N, K] = dY.T[N, M] @ X[M, K]
        grad_x = torch._scaled_mm(g8, w8_t.t(), scale_a=sg, scale_b=sw, out_dtype=grad.dtype)
        grad_w = torch._scaled_mm(
            g8_t, x8_t.t(), scale_a=sg, scale_b=sx, out_dtype=ctx.weight_dtype
        )
        return grad_x[: ctx.rows], grad_w, None


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose matrix products run in FP8 through ``torch._scaled_mm``.

    Same parameters and state dict as ``nn.Linear``. Under autocast the output is the autocast
    dtype, else the input's. Token counts that are not a multiple of 16 are zero-padded for the
    GEMMs (pad rows add nothing to the weight gradient).
    """

    @staticmethod
    def from_linear(old: nn.Linear) -> Float8Linear:
        """A Float8Linear sharing ``old``'s parameters (the optimizer's references stay valid)."""
        new = Float8Linear.__new__(Float8Linear)
        nn.Module.__init__(new)
        new.in_features, new.out_features = old.in_features, old.out_features
        new.weight = old.weight
        new.bias = old.bias
        return new

    def forward(self, x: Tensor) -> Tensor:
        if not _fp8_sized(self):
            return super().forward(x)
        if torch.is_autocast_enabled(x.device.type):
            out_dtype = torch.get_autocast_dtype(x.device.type)
        else:
            out_dtype = x.dtype
        rows = x.reshape(-1, self.in_features)  # cast straight from its dtype to FP8
        with torch.autocast(x.device.type, enabled=False):
            out = _Float8MatMul.apply(rows, self.weight, out_dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def autocast_context(device: torch.device) -> Context:
    """bf16 autocast on GPU; nothing on CPU (float32 is faster there)."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext
