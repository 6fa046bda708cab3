"""FP8 through ``torch._scaled_mm`` (``sft.precision.Float8Linear``), checked on CPU.

The CPU build runs ``_scaled_mm`` too, so the arithmetic (scaling, operand layouts, padding,
the three GEMMs of forward and backward) is tested here; GPU speed is for bench/packing.py.
Tolerances: e4m3 keeps 3 mantissa bits (relative step 1/8), so a product over K=256 terms
lands within a few percent of float32 in relative norm; e5m2 gradients keep 2 bits.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlvla3.policy.vla import Transformer
from sft.precision import E4M3, E5M2, Float8Linear, enable_fp8, fp8_backend, quantize


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_round_trip_uses_the_range_and_stays_close(dtype):
    x = torch.randn(64, 48) * 1000.0  # far outside fp8's unscaled range
    x8, x8_t, scale = quantize(x, dtype, pad_rows=3)
    assert x8.dtype == x8_t.dtype == dtype and x8.is_contiguous() and x8_t.is_contiguous()
    assert x8.shape == (67, 48) and torch.equal(x8_t.t().float(), x8.float())
    assert not x8[64:].float().any()  # pad rows are zero
    assert float(x8.float().abs().max()) == torch.finfo(dtype).max  # amax maps onto the max
    assert rel_err(x8[:64].float() * scale, x) < (0.04 if dtype == E4M3 else 0.08)


def test_float8_linear_matches_linear_forward_and_backward():
    torch.manual_seed(0)
    ref = nn.Linear(256, 128)
    fp8 = Float8Linear.from_linear(nn.Linear(256, 128))
    fp8.load_state_dict(ref.state_dict())
    x = torch.randn(3, 37, 256)  # 111 rows: not a multiple of 16, so the GEMMs pad
    x_ref, x_fp8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_fp8 = ref(x_ref), fp8(x_fp8)
    assert y_fp8.shape == y_ref.shape == (3, 37, 128)
    assert rel_err(y_fp8, y_ref) < 0.06
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    y_fp8.backward(g)
    assert rel_err(x_fp8.grad, x_ref.grad) < 0.12
    assert rel_err(fp8.weight.grad, ref.weight.grad) < 0.12
    assert fp8.weight.grad.dtype == torch.float32
    torch.testing.assert_close(fp8.bias.grad, ref.bias.grad)  # the bias add is not in FP8


def test_enable_fp8_swaps_linears_but_keeps_parameters_and_state_dict():
    model = Transformer(d_model=64, num_layers=2, num_heads=4)
    params_before = list(model.parameters())
    keys_before = list(model.state_dict())
    enable_fp8(model, "torch_scaled_mm")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, Float8Linear) for m in linears)
    assert list(model.state_dict()) == keys_before  # checkpoints and weight layout unchanged
    assert all(a is b for a, b in zip(model.parameters(), params_before, strict=True))
    x = torch.randn(2, 10, 64)
    out = model(x, key_padding_mask=torch.ones(2, 10, dtype=torch.bool))
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_no_fp8_on_cpu_and_unknown_backend_is_named():
    assert fp8_backend(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="no FP8 backend 'fp4'"):
        enable_fp8(nn.Linear(16, 16), "fp4")
