"""FP8 through ``torch._scaled_mm`` (``sft.precision.Float8Linear``), checked on CPU.

The CPU build runs ``_scaled_mm`` too, so the arithmetic (scaling, operand layouts, padding,
the three GEMMs of forward and backward) is tested here; GPU speed is for bench/packing.py.
Tolerances: e4m3 keeps 3 mantissa bits (relative step 1/8), so a product over K=256 terms
lands within a few percent of float32 in relative norm; e5m2 gradients keep 2 bits.
"""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
from torch import nn

from rlvla3.policy.transformer import Transformer
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


class _FakeTE:
    """A stand-in for ``transformer_engine`` with the API surface we call (read off TE 2.20's
    source: ``te.Linear``'s constructor and FP8 shape check, ``get_extra_state``, ``te.autocast``,
    ``te.is_fp8_block_scaling_available``, the recipe classes), arithmetic in float32 on CPU."""

    def __init__(self, block_scaling: bool) -> None:
        self.entered: list[object] = []
        fake = self

        class Linear(nn.Module):
            def __init__(
                self, in_features, out_features, bias=True, params_dtype=None, device="cuda"
            ):
                super().__init__()
                self.in_features, self.out_features = in_features, out_features
                self.weight = nn.Parameter(
                    torch.empty(out_features, in_features, device=device, dtype=params_dtype)
                )
                self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

            def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
                # TE: "FP8 execution requires the product of all dimensions except the last to
                # be divisible by 8 and its last dimension to be divisible by 16"
                assert inp.shape[:-1].numel() % 8 == 0 and inp.shape[-1] % 16 == 0, inp.shape
                return nn.functional.linear(inp, self.weight, self.bias)

            def get_extra_state(self):
                return torch.zeros(4, dtype=torch.uint8)  # TE pickles its FP8 metadata here

            def set_extra_state(self, state):
                pass

        class Recipe:
            def __init__(self, name):
                self.name = name

        class Autocast:
            def __init__(self, enabled=True, calibrating=False, recipe=None):
                self.recipe = recipe

            def __enter__(self):
                fake.entered.append(self.recipe.name)

            def __exit__(self, *exc):
                return False

        self.pytorch = types.ModuleType("transformer_engine.pytorch")
        self.pytorch.Linear = Linear
        self.pytorch.autocast = Autocast
        self.pytorch.is_fp8_block_scaling_available = lambda return_reason=False: (
            (block_scaling, "" if block_scaling else "needs compute capability 9.0")
        )
        self.recipe = types.ModuleType("transformer_engine.common.recipe")
        self.recipe.Float8BlockScaling = lambda: Recipe("Float8BlockScaling")
        self.recipe.Float8CurrentScaling = lambda: Recipe("Float8CurrentScaling")
        self.recipe.DelayedScaling = lambda: Recipe("DelayedScaling")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        root, common = types.ModuleType("transformer_engine"), types.ModuleType("te.common")
        root.pytorch, root.common, common.recipe = self.pytorch, common, self.recipe
        for name, module in [
            ("transformer_engine", root),
            ("transformer_engine.pytorch", self.pytorch),
            ("transformer_engine.common", common),
            ("transformer_engine.common.recipe", self.recipe),
        ]:
            monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("block_scaling", [True, False])
def test_transformer_engine_backend_keeps_the_linear_interface(monkeypatch, block_scaling):
    """The TE path on CPU against a fake TE: 10 tokens (no multiple of 8) reach TE's GEMMs padded,
    results equal the float32 model's, state-dict keys stay nn.Linear's, and the recipe is
    block-wise where TE offers it."""
    fake = _FakeTE(block_scaling)
    fake.install(monkeypatch)
    torch.manual_seed(0)
    model = Transformer(d_model=64, num_layers=2, num_heads=4)
    reference = Transformer(d_model=64, num_layers=2, num_heads=4)
    reference.load_state_dict(model.state_dict())
    keys_before = list(model.state_dict())
    context = enable_fp8(model, "transformer_engine")
    swapped = [m for m in model.modules() if isinstance(m, fake.pytorch.Linear)]
    assert swapped and not any(
        type(m) is nn.Linear and m.in_features % 16 == 0 and m.out_features % 16 == 0
        for m in model.modules()
    )
    assert list(model.state_dict()) == keys_before  # no _extra_state: checkpoints load anywhere
    x = torch.randn(1, 10, 64)
    mask = torch.ones(1, 10, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 autocast for "cuda" is disabled on a CPU build
        with context():
            out = model(x, key_padding_mask=mask)
    assert fake.entered == ["Float8BlockScaling" if block_scaling else "Float8CurrentScaling"]
    torch.testing.assert_close(out, reference(x, key_padding_mask=mask))
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    reference.load_state_dict(model.state_dict())  # strict: same keys both ways
