"""Mixed precision for SFT: bf16 autocast on GPU, FP8 via Transformer Engine where the GPU can.

FP8 needs Transformer Engine's own linear layers: ``enable_fp8`` swaps every ``nn.Linear`` whose
sizes FP8 GEMMs accept for ``transformer_engine.pytorch.Linear`` (same weights) and returns the
autocast context to train under, using the block-wise scaling recipe. On CPU, or without TE or
an FP8-capable GPU (compute capability 8.9+), training runs in float32/bf16 unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Context = Callable[[], contextlib.AbstractContextManager[Any]]


def fp8_available(device: torch.device) -> bool:
    """True when Transformer Engine imports and ``device`` is a GPU with FP8 tensor cores."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def enable_fp8(model: nn.Module) -> Context:
    """Swap linears for TE linears in place; return the FP8 autocast context factory."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    _swap_linears(model, te)
    fp8_recipe = (
        recipe.Float8BlockScaling()
        if hasattr(recipe, "Float8BlockScaling")
        else recipe.DelayedScaling()
    )
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)


def _swap_linears(module: nn.Module, te: Any) -> None:
    for name, child in module.named_children():
        if (
            isinstance(child, nn.Linear)
            and child.in_features % 16 == 0
            and child.out_features % 16 == 0
        ):
            new = te.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                            params_dtype=child.weight.dtype, device=child.weight.device)  # fmt: skip
            with torch.no_grad():
                new.weight.copy_(child.weight)
                if child.bias is not None:
                    new.bias.copy_(child.bias)
            setattr(module, name, new)
        else:
            _swap_linears(child, te)


def autocast_context(device: torch.device) -> Context:
    """bf16 autocast on GPU; nothing on CPU (float32 is faster there)."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext
