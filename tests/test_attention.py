"""Packed (varlen) attention against unpacked per-sample SDPA: outputs, gradients, isolation.

Tolerance: float32, atol 1e-5 (rtol 1e-5) for outputs and for q/k/v gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvla3.policy import attention as attn_mod
from rlvla3.policy.attention import attention, backend_name

ATOL = RTOL = 1e-5
H, DH = 3, 8


def _cu(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu


def _samples(lengths: list[int], seed: int) -> list[list[torch.Tensor]]:
    """Per-sample leaves [(q, k, v)], each [len, H, Dh], float32, requires_grad."""
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(n, H, DH, generator=g).requires_grad_() for _ in range(3)] for n in lengths
    ]


def _packed_run(samples, causal: bool, weight: torch.Tensor):
    """Pack the samples, run packed attention, backprop a weighted sum. -> (out, grads)."""
    q, k, v = (torch.cat([s[j] for s in samples]) for j in range(3))
    lengths = [s[0].shape[0] for s in samples]
    out = attention(q, k, v, cu_seqlens=_cu(lengths), max_seqlen=max(lengths), causal=causal)
    (out * weight).sum().backward()
    return out.detach(), [x.grad for s in samples for x in s]


def _reference_run(samples, causal: bool, weight: torch.Tensor):
    """Unpacked: SDPA on each sample alone in [1, H, len, Dh]. -> (out, grads)."""
    outs = []
    for q, k, v in samples:
        o = F.scaled_dot_product_attention(
            *(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=causal
        )
        outs.append(o[0].transpose(0, 1))
    out = torch.cat(outs)
    (out * weight).sum().backward()
    return out.detach(), [x.grad for s in samples for x in s]


def _check_against_reference(lengths: list[int], causal: bool, seed: int) -> None:
    packed_in, ref_in = _samples(lengths, seed), _samples(lengths, seed)
    weight = torch.randn(sum(lengths), H, DH, generator=torch.Generator().manual_seed(seed + 1))
    out, grads = _packed_run(packed_in, causal, weight)
    ref_out, ref_grads = _reference_run(ref_in, causal, weight)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, atol=ATOL, rtol=RTOL)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(1, 48), min_size=1, max_size=6),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_matches_per_sample_sdpa(lengths, causal, seed):
    _check_against_reference(lengths, causal, seed)


@pytest.mark.parametrize("causal", [False, True])
def test_equal_lengths_fast_path_matches(causal):
    _check_against_reference([17, 17, 17, 17], causal, seed=3)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_matches_padded_with_key_padding_mask(causal):
    lengths = [5, 12, 1, 9]
    samples = _samples(lengths, seed=7)
    q, k, v = (torch.cat([s[j] for s in samples]).detach() for j in range(3))
    packed = attention(q, k, v, cu_seqlens=_cu(lengths), causal=causal)
    b, lmax = len(lengths), max(lengths)
    pad = [torch.zeros(b, H, lmax, DH) for _ in range(3)]
    mask = torch.zeros(b, lmax, dtype=torch.bool)
    for i, s in enumerate(samples):
        for j in range(3):
            pad[j][i, :, : lengths[i]] = s[j].detach().transpose(0, 1)
        mask[i, : lengths[i]] = True
    padded = attention(*pad, key_padding_mask=mask, causal=causal)
    real = padded.transpose(1, 2)[mask]  # [total, H, Dh], real query rows only
    torch.testing.assert_close(packed, real, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("causal", [False, True])
def test_no_cross_document_leakage(causal):
    lengths = [6, 9, 4]
    cu = _cu(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), H, DH, generator=g) for _ in range(3))
    base = attention(q, k, v, cu_seqlens=cu, causal=causal)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):  # perturb document 2 (index 1) only
        x[6:15] += 10.0 * torch.randn(9, H, DH, generator=g)
    moved = attention(q2, k2, v2, cu_seqlens=cu, causal=causal)
    assert torch.equal(base[:6], moved[:6])
    assert torch.equal(base[15:], moved[15:])
    assert not torch.allclose(base[6:15], moved[6:15])


def test_no_cross_document_gradient():
    lengths = [5, 7]
    qkv = [torch.randn(12, H, DH, requires_grad=True) for _ in range(3)]
    out = attention(*qkv, cu_seqlens=_cu(lengths))
    out[:5].sum().backward()  # document 0's output
    for x in qkv:
        assert torch.count_nonzero(x.grad[5:]) == 0
        assert torch.count_nonzero(x.grad[:5]) > 0


def test_empty_documents_are_skipped():
    q, k, v = (torch.randn(7, H, DH) for _ in range(3))
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    out = attention(q, k, v, cu_seqlens=cu)
    ref = attention(q, k, v, cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    assert torch.equal(out, ref)


def test_bad_inputs_raise():
    q = torch.randn(10, H, DH)
    with pytest.raises(ValueError, match="total_tokens"):
        attention(q, q, q, cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention(q, q, q, cu_seqlens=_cu([10]), key_padding_mask=torch.ones(1, 10, dtype=bool))
    with pytest.raises(ValueError):
        attention(q[None], q[None], q[None], cu_seqlens=_cu([10]))


def test_padded_form_without_mask_is_sdpa():
    q, k, v = (torch.randn(2, H, 11, DH) for _ in range(3))
    for causal in (False, True):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.equal(attention(q, k, v, causal=causal), ref)


def _fake_kernels(monkeypatch, *present: str) -> None:
    """Make exactly the varlen kernels named in ``present`` look importable."""
    loaders = {
        "flash_attn_varlen": "_flash_varlen_func",
        "flash_attn4_varlen": "_flash4_varlen_func",
        "torch_varlen_attn": "_torch_varlen_func",
    }
    for name, loader in loaders.items():
        fake = (lambda *a, **kw: None) if name in present else None
        monkeypatch.setattr(attn_mod, loader, lambda fake=fake: fake)
    monkeypatch.setattr(attn_mod, "_capability_major", lambda device: 9)  # a Hopper GPU


def test_backend_name(monkeypatch):
    assert backend_name("cpu") == "sdpa_per_segment"
    _fake_kernels(monkeypatch, "flash_attn_varlen", "flash_attn4_varlen", "torch_varlen_attn")
    assert backend_name("cuda") == "flash_attn_varlen"
    assert backend_name("cuda", torch.bfloat16) == "flash_attn_varlen"
    assert backend_name("cuda", torch.float32) == "sdpa_per_segment"
    assert backend_name("cpu", torch.bfloat16) == "sdpa_per_segment"
    _fake_kernels(monkeypatch, "flash_attn4_varlen", "torch_varlen_attn")
    assert backend_name("cuda") == "flash_attn4_varlen"
    _fake_kernels(monkeypatch, "torch_varlen_attn")
    assert backend_name("cuda") == "torch_varlen_attn"  # torch's own FlashAttention varlen
    assert backend_name("cuda", torch.float32) == "sdpa_per_segment"
    _fake_kernels(monkeypatch)
    assert backend_name("cuda") == "sdpa_per_segment"


def test_flash_attn4_serves_only_the_head_dims_and_gpus_it_was_checked_on(monkeypatch):
    _fake_kernels(monkeypatch, "flash_attn4_varlen", "torch_varlen_attn")
    assert backend_name("cuda", head_dim=64) == "flash_attn4_varlen"
    assert backend_name("cuda", head_dim=128) == "flash_attn4_varlen"
    assert backend_name("cuda", head_dim=16) == "torch_varlen_attn"  # the table-top VLA's
    monkeypatch.setattr(attn_mod, "_capability_major", lambda device: 8)  # an A100
    assert backend_name("cuda", head_dim=64) == "torch_varlen_attn"
    _fake_kernels(monkeypatch, "flash_attn4_varlen")
    assert backend_name("cuda", head_dim=16) == "sdpa_per_segment"


def test_a_preferred_kernel_goes_first_only_where_it_loads(monkeypatch):
    _fake_kernels(monkeypatch, "flash_attn4_varlen", "torch_varlen_attn")
    try:
        attn_mod.prefer_varlen_kernel("torch_varlen_attn")
        assert backend_name("cuda") == "torch_varlen_attn"
        attn_mod.prefer_varlen_kernel("flash_attn_varlen")  # not there: the default order
        assert backend_name("cuda") == "flash_attn4_varlen"
        with pytest.raises(ValueError, match="unknown varlen kernel 'flash3'"):
            attn_mod.prefer_varlen_kernel("flash3")
    finally:
        attn_mod.prefer_varlen_kernel(None)
    assert backend_name("cuda") == "flash_attn4_varlen"
    assert attn_mod.available_varlen_kernels() == ["flash_attn4_varlen", "torch_varlen_attn"]


def test_flash_attn4_adapter_passes_boundaries_by_name_and_keeps_the_output(monkeypatch):
    """flash-attn 4's varlen function takes ``cu_seqlens_q=``... by keyword and returns
    ``(out, lse)``; the adapter must hand back ``out`` alone."""
    calls: list[dict] = []

    def flash4(
        q,
        k,
        v,
        qv=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        causal=False,
    ):
        calls.append(
            dict(
                cu_q=cu_seqlens_q,
                cu_k=cu_seqlens_k,
                max_q=max_seqlen_q,
                max_k=max_seqlen_k,
                causal=causal,
                qv=qv,
            )
        )
        return q * 2, None

    monkeypatch.setattr(attn_mod, "_flash4_varlen_func", lambda: flash4)
    q = torch.randn(10, H, DH)
    cu = _cu([4, 6])
    out = attn_mod._flash4(q, q, q, cu, 6, causal=True)
    assert torch.equal(out, q * 2)
    (call,) = calls
    assert call["cu_q"] is cu and call["cu_k"] is cu and call["qv"] is None
    assert (call["max_q"], call["max_k"], call["causal"]) == (6, 6, True)


def test_torch_varlen_causal_flag_follows_its_signature(monkeypatch):
    """torch 2.10's varlen_attn took ``is_causal``; later ones take ``window_size=(-1, 0)``."""
    calls: list[dict] = []

    def new_style(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1)):
        calls.append({"window_size": window_size})
        return q

    def old_style(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
        calls.append({"is_causal": is_causal})
        return q

    x = torch.zeros(4, 1, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for fn in (new_style, old_style):
        monkeypatch.setattr(attn_mod, "_torch_varlen_func", lambda fn=fn: fn)
        attn_mod._torch_varlen(x, x, x, cu, 4, causal=True)
        attn_mod._torch_varlen(x, x, x, cu, 4, causal=False)
    assert calls == [
        {"window_size": (-1, 0)},
        {"window_size": (-1, -1)},
        {"is_causal": True},
        {"is_causal": False},
    ]


def _explicit_block_diagonal(q, k, v, lengths: list[int], causal: bool) -> torch.Tensor:
    """Attention written out by hand (no SDPA): softmax(q k^T / sqrt(Dh)) over one dense
    [total, total] score matrix where a query sees only its own document's keys (and, if causal,
    the ones before it). An independent reference for the packed path."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= torch.ones_like(allowed).tril()
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_matches_explicit_block_diagonal_softmax(causal):
    lengths = [5, 1, 12, 12, 3]
    g = torch.Generator().manual_seed(7)
    leaves = [torch.randn(sum(lengths), H, DH, generator=g, dtype=torch.float64) for _ in range(3)]
    packed = [x.clone().requires_grad_() for x in leaves]
    ref = [x.clone().requires_grad_() for x in leaves]
    out = attention(*packed, cu_seqlens=_cu(lengths), causal=causal)
    ref_out = _explicit_block_diagonal(*ref, lengths, causal)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * weight).sum().backward()
    (ref_out * weight).sum().backward()
    for a, b in zip(packed, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_empty_documents_with_wider_values_and_gradients(causal):
    """Zero-length documents anywhere, values wider than queries: same result and gradients as
    without the empty documents."""
    g = torch.Generator().manual_seed(8)
    leaves = [torch.randn(9, H, d, generator=g) for d in (DH, DH, 2 * DH)]
    with_empty = [x.clone().requires_grad_() for x in leaves]
    without = [x.clone().requires_grad_() for x in leaves]
    out = attention(*with_empty, cu_seqlens=_cu([0, 4, 0, 5, 0]), causal=causal)
    ref = attention(*without, cu_seqlens=_cu([4, 5]), causal=causal)
    assert out.shape == (9, H, 2 * DH)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for a, b in zip(with_empty, without, strict=True):
        torch.testing.assert_close(a.grad, b.grad)
