"""Best-fit-decreasing packing, packed batch collation, and packed vs per-sample losses."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvla3.policy.transformer import Transformer
from sft.packing import collate_packed, document_ids, pack, per_document_mean


def first_fit(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit packing in the given order (no sorting): the baseline ``pack`` is compared to.
    Same arguments, result format and errors as ``pack``."""
    pack(lengths, budget)  # the same validation, so the same errors
    bins: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(int(x) for x in lengths):
        for b, r in enumerate(room):
            if r >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


def padding_efficiency(bins: list[list[int]], lengths: list[int], budget: int) -> float:
    """Real tokens / (number of bins x budget): 1.0 means no token slot is wasted."""
    if not bins:
        return 0.0
    return sum(int(lengths[i]) for b in bins for i in b) / (len(bins) * budget)


@st.composite
def _problems(draw):
    budget = draw(st.integers(1, 600))
    lengths = draw(st.lists(st.integers(1, budget), max_size=80))
    return lengths, budget


@settings(max_examples=150, deadline=None, derandomize=True)
@given(problem=_problems())
@pytest.mark.parametrize("algo", [pack, first_fit])
def test_never_splits_never_overflows(algo, problem):
    lengths, budget = problem
    bins = algo(lengths, budget)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))  # every sample exactly once, whole
    assert all(b and sum(lengths[i] for i in b) <= budget for b in bins)
    # Any-fit bound: at most one bin is at most half full, so bins < 2 * total / budget + 1.
    total = sum(lengths)
    assert len(bins) >= -(-total // budget)
    assert len(bins) <= 1 or len(bins) < 2 * total / budget + 1


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), budget=st.sampled_from([1024, 2048, 4096]))
def test_best_fit_decreasing_at_least_as_efficient_as_first_fit(seed, budget):
    rng = random.Random(seed)
    lengths = [rng.randint(32, 512) for _ in range(rng.randint(10, 300))]
    bfd = padding_efficiency(pack(lengths, budget), lengths, budget)
    ff = padding_efficiency(first_fit(lengths, budget), lengths, budget)
    assert bfd >= ff


def test_best_fit_decreasing_beats_first_fit_on_a_known_case():
    lengths, budget = [3, 3, 7, 7], 10  # first fit: [3,3] [7] [7]; BFD: [7,3] [7,3]
    assert len(first_fit(lengths, budget)) == 3
    assert len(pack(lengths, budget)) == 2
    assert padding_efficiency(pack(lengths, budget), lengths, budget) == 1.0


def test_oversized_and_invalid_samples_raise():
    with pytest.raises(ValueError, match=r"sample 2 has length 700 > budget 512"):
        pack([10, 20, 700, 5], 512)
    with pytest.raises(ValueError, match=r"sample 1"):
        first_fit([10, 0], 512)
    with pytest.raises(ValueError, match="budget"):
        pack([1], 0)
    assert pack([], 8) == []


def test_collate_packed_boundaries_and_positions():
    samples = [torch.full((n, 3), float(i)) for i, n in enumerate([4, 1, 6, 2])]
    batch = collate_packed(samples, [2, 0, 3], budget=16)
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 6, 10, 12]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1]
    assert batch.tokens.shape == (12, 3)
    assert batch.tokens[:, 0].tolist() == [2.0] * 6 + [0.0] * 4 + [3.0] * 2
    assert (batch.max_seqlen, batch.num_real_tokens, batch.budget) == (6, 12, 16)
    assert batch.sample_indices == (2, 0, 3) and batch.num_docs == 3
    assert batch.efficiency == 12 / 16
    assert document_ids(batch.cu_seqlens).tolist() == [0] * 6 + [1] * 4 + [2] * 2
    with pytest.raises(ValueError, match="budget"):
        collate_packed(samples, [0, 2], budget=9)


def test_collate_every_bin_of_a_packing():
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(40)]
    samples = [torch.randn(n, 2) for n in lengths]
    bins = pack(lengths, 64)
    batches = [collate_packed(samples, b, budget=64) for b in bins]
    assert sum(b.num_real_tokens for b in batches) == sum(lengths)
    for batch in batches:
        ends = batch.cu_seqlens[1:].tolist()
        starts = batch.cu_seqlens[:-1].tolist()
        for s, e, i in zip(starts, ends, batch.sample_indices, strict=True):
            assert torch.equal(batch.tokens[s:e], samples[i])


def test_packed_loss_equals_per_sample_losses():
    torch.manual_seed(0)
    d = 16
    model = Transformer(d_model=d, num_layers=2, num_heads=2)
    lengths = [7, 19, 3, 12]
    inputs = [torch.randn(n, d) for n in lengths]
    targets = [torch.randn(n, d) for n in lengths]

    def token_loss(out, tgt):  # float[T]
        return ((out - tgt) ** 2).mean(-1)

    per_sample = torch.stack(
        [token_loss(model(x[None])[0], t).mean() for x, t in zip(inputs, targets, strict=True)]
    )
    ref_grads = torch.autograd.grad(per_sample.mean(), list(model.parameters()))

    batch = collate_packed(inputs, range(len(lengths)), budget=64)
    tgt = collate_packed(targets, range(len(lengths)), budget=64).tokens
    out = model(batch.tokens, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
    losses = token_loss(out, tgt)
    per_doc = per_document_mean(losses, batch.cu_seqlens)
    torch.testing.assert_close(per_doc, per_sample, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        losses.mean(),
        (per_sample * torch.tensor(lengths)).sum() / sum(lengths),
        atol=1e-6,
        rtol=1e-5,
    )
    grads = torch.autograd.grad(per_doc.mean(), list(model.parameters()))
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-4)
