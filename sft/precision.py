"""Mixed precision for SFT: bf16 autocast on GPU, FP8 where the GPU can.

FP8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper) and one of two backends,
chosen by ``fp8_backend``:

- ``transformer_engine`` (preferred when it imports): ``enable_fp8`` swaps every ``nn.Linear``
  whose sizes FP8 GEMMs accept for ``transformer_engine.pytorch.Linear`` (same weights) and trains
  under ``te.fp8_autocast`` with the block-wise scaling recipe.
- ``torch_scaled_mm`` (no extra install): every such linear becomes a ``Float8Linear``, which runs
  its three GEMMs (forward, input gradient, weight gradient) through ``torch._scaled_mm`` with
  dynamic per-tensor scaling: inputs and weights in e4m3, gradients in e5m2 (more range, less
  precision, as gradients need), bf16 / fp32 outputs. Parameters stay ``weight`` / ``bias`` in
  float32, so checkpoints and the weight broadcast's flat layout do not change.

On CPU, or on a GPU without FP8, training runs in float32 / bf16 unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Context = Callable[[], contextlib.AbstractContextManager[Any]]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_FP8_ALIGN = 16  # FP8 GEMMs need every matrix dimension divisible by 16


def fp8_backend(device: torch.device) -> str | None:
    """``"transformer_engine"``, ``"torch_scaled_mm"`` or None (no FP8 on ``device``)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if torch.cuda.get_device_capability(device) < (8, 9):
        return None
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return "torch_scaled_mm" if hasattr(torch, "_scaled_mm") else None
    return "transformer_engine"


def fp8_available(device: torch.device) -> bool:
    """True when ``device`` is a GPU with FP8 tensor cores and an FP8 backend is present."""
    return fp8_backend(device) is not None


def enable_fp8(model: nn.Module, backend: str | None = None) -> Context:
    """Swap the model's FP8-sized linears in place; return the context to train under.

    ``backend`` defaults to ``fp8_backend`` of the model's device.
    """
    if backend is None:
        backend = fp8_backend(next(model.parameters()).device)
    if backend == "transformer_engine":
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe

        _swap_linears(model, lambda old: _te_linear(te, old))
        fp8_recipe = (
            recipe.Float8BlockScaling()
            if hasattr(recipe, "Float8BlockScaling")
            else recipe.DelayedScaling()
        )
        return lambda: te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)
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


def _te_linear(te: Any, old: nn.Linear) -> nn.Module:
    new = te.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                    params_dtype=old.weight.dtype, device=old.weight.device)  # fmt: skip
    with torch.no_grad():
        new.weight.copy_(old.weight)
        if old.bias is not None:
            new.bias.copy_(old.bias)
    return new


def quantize(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-tensor dynamic scaling: ``(x8, scale)`` with ``x ≈ x8.float() * scale``.

    The scale maps ``x``'s largest magnitude onto the format's largest finite value, so nothing
    overflows and the full range of the 8 bits is used.
    """
    fmax = torch.finfo(dtype).max
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = amax / fmax
    x8 = (x.float() / scale).clamp(-fmax, fmax).to(dtype).contiguous()
    return x8, scale


def _column_major(x: Tensor) -> Tensor:
    """Same matrix, stored column-major (``_scaled_mm`` wants its second operand that way)."""
    return x.t().contiguous().t()


class _Float8MatMul(torch.autograd.Function):
    """``x @ weight.T`` with FP8 operands in all three GEMMs (see module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, out_dtype: torch.dtype) -> Tensor:
        x8, sx = quantize(x, E4M3)
        w8, sw = quantize(weight, E4M3)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.weight_dtype = weight.dtype
        return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x8, sx, w8, sw = ctx.saved_tensors
        g8, sg = quantize(grad, E5M2)
        # dX[M, K] = dY[M, N] @ W[N, K];  dW[N, K] = dY.T[N, M] @ X[M, K]
        grad_x = torch._scaled_mm(g8, _column_major(w8), scale_a=sg, scale_b=sw,
                                  out_dtype=grad.dtype)  # fmt: skip
        grad_w = torch._scaled_mm(g8.t().contiguous(), _column_major(x8), scale_a=sg, scale_b=sx,
                                  out_dtype=ctx.weight_dtype)  # fmt: skip
        return grad_x, grad_w, None


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
            compute = out_dtype
        else:
            out_dtype = compute = x.dtype
        rows = x.reshape(-1, self.in_features).to(compute)
        pad = -rows.shape[0] % _FP8_ALIGN
        if pad:
            rows = F.pad(rows, (0, 0, 0, pad))
        with torch.autocast(x.device.type, enabled=False):
            out = _Float8MatMul.apply(rows, self.weight, out_dtype)
        if pad:
            out = out[: out.shape[0] - pad]
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def autocast_context(device: torch.device) -> Context:
    """bf16 autocast on GPU; nothing on CPU (float32 is faster there)."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext
