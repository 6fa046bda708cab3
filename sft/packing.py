"""Sequence packing for SFT: variable-length samples into fixed token budgets, no padding.

``pack`` assigns samples to bins of ``budget`` tokens by best-fit decreasing (longest sample first,
into the fullest bin that still has room); ``collate_packed`` concatenates one bin's samples into a
``PackedBatch`` whose ``cu_seqlens`` drive ``rlvla3.policy.attention.attention`` (per-document
attention: no token sees another sample). A sample is never split across bins.

Typical use::

    bins = pack([len(s) for s in samples], budget=4096)
    for b in bins:
        batch = collate_packed(samples, b, budget=4096)
        hidden = policy.trunk(batch.tokens, batch.cu_seqlens, batch.max_seqlen)

Labels or loss masks that run alongside the tokens are packed by calling ``collate_packed`` on
them with the same bin; the boundaries come out identical.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedBatch:
    """One bin of samples laid end to end.

    Attributes:
        tokens: [T, ...] the samples' tokens or features concatenated along dim 0 (dtype of the
            samples, e.g. float[T, d] features or int64[T] token ids); T = ``num_real_tokens``.
        cu_seqlens: int32[num_docs + 1], document boundaries ``0, len0, len0 + len1, ..., T``.
        position_ids: int64[T], position within its own document (restarts at 0 per document).
        max_seqlen: length of the longest document, in tokens.
        num_real_tokens: T, the tokens actually present (no padding is ever added).
        budget: the token budget the bin was packed for; ``num_real_tokens <= budget``.
        sample_indices: indices of the packed samples in the original sample list, in order.
    """

    tokens: Tensor
    cu_seqlens: Tensor
    position_ids: Tensor
    max_seqlen: int
    num_real_tokens: int
    budget: int
    sample_indices: tuple[int, ...]

    @property
    def num_docs(self) -> int:
        """Number of samples (documents) in the bin."""
        return len(self.sample_indices)

    @property
    def efficiency(self) -> float:
        """Fill ratio of this bin: ``num_real_tokens / budget``."""
        return self.num_real_tokens / self.budget


def _check(lengths: Sequence[int], budget: int) -> list[int]:
    """Validate lengths/budget; return lengths as Python ints."""
    if int(budget) != budget or budget < 1:
        raise ValueError(f"budget must be a positive integer, got {budget!r}")
    out = [int(n) for n in lengths]
    for i, n in enumerate(out):
        if n != lengths[i] or n < 1:
            raise ValueError(f"sample {i} has invalid length {lengths[i]!r} (need an integer >= 1)")
        if n > budget:
            raise ValueError(
                f"sample {i} has length {n} > budget {budget}; it cannot be packed "
                "without splitting it (raise the budget or truncate the sample)"
            )
    return out


def pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Best-fit-decreasing packing of samples into bins of ``budget`` tokens.

    Samples are placed longest first (ties by index) into the bin with the least free room that
    still fits them, else into a new bin. O(n log n) search (+ list inserts).

    Args:
        lengths: token count of each sample, integers >= 1.
        budget: tokens per bin.

    Returns:
        Sample indices per bin; every index appears exactly once; each bin's lengths sum to at
        most ``budget``.

    Raises:
        ValueError: a length exceeds ``budget`` (naming the sample index and its length), or a
            length / the budget is not a positive integer.
    """
    sizes = _check(lengths, budget)
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, bin id), sorted; full bins are dropped
    for i in order:
        pos = bisect.bisect_left(free, (sizes[i], -1))  # first bin with free >= size
        if pos == len(free):
            bins.append([i])
            room, b = budget - sizes[i], len(bins) - 1
        else:
            room, b = free.pop(pos)
            bins[b].append(i)
            room -= sizes[i]
        if room > 0:
            bisect.insort(free, (room, b))
    return bins


def collate_packed(samples: Sequence[Tensor], bin: Sequence[int], *, budget: int) -> PackedBatch:
    """Concatenate the samples of one bin into a ``PackedBatch``.

    Args:
        samples: the full sample list; ``samples[i]`` is a tensor [len_i, ...] (trailing dims and
            dtype equal across samples).
        bin: indices into ``samples`` (one element of ``pack``'s result), non-empty.
        budget: the bin's token budget.

    Raises:
        ValueError: empty bin, an empty sample, or the bin's samples exceed ``budget``.
    """
    if not bin:
        raise ValueError("cannot collate an empty bin")
    parts = [samples[i] for i in bin]
    lengths = [int(p.shape[0]) for p in parts]
    for i, n in zip(bin, lengths, strict=True):
        if n < 1:
            raise ValueError(f"sample {i} is empty")
    total = sum(lengths)
    if total > budget:
        raise ValueError(f"bin holds {total} tokens > budget {budget}")
    device = parts[0].device
    len_t = torch.tensor(lengths, dtype=torch.int64, device=device)
    cu_seqlens = torch.zeros(len(parts) + 1, dtype=torch.int32, device=device)
    cu_seqlens[1:] = len_t.cumsum(0)
    # output_size: without it repeat_interleave reads len_t back from a GPU (a sync per batch)
    starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.int64), len_t, output_size=total)
    position_ids = torch.arange(total, dtype=torch.int64, device=device) - starts
    return PackedBatch(
        tokens=torch.cat(parts, dim=0),
        cu_seqlens=cu_seqlens,
        position_ids=position_ids,
        max_seqlen=max(lengths),
        num_real_tokens=total,
        budget=int(budget),
        sample_indices=tuple(int(i) for i in bin),
    )


def collate_padded(samples: Sequence[Tensor], bin: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The padded alternative: samples [len_i, ...] -> (zero-padded [B, max_len, ...],
    key padding mask bool[B, max_len], True = real token). For comparisons and benchmarks."""
    parts = [samples[i] for i in bin]
    padded = torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)
    lengths = torch.tensor([p.shape[0] for p in parts], device=padded.device)
    mask = torch.arange(padded.shape[1], device=padded.device)[None, :] < lengths[:, None]
    return padded, mask


def document_ids(cu_seqlens: Tensor) -> Tensor:
    """int64[T]: the document index of every packed token, from int32[num_docs + 1] boundaries."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    docs = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(docs, lengths)


def per_document_mean(values: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Mean of per-token ``values`` float[T] within each document -> float[num_docs].

    ``per_document_mean(token_loss, cu).mean()`` is the mean of per-sample losses (every sample
    weighs the same), whereas ``token_loss.mean()`` weighs samples by their length.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(values.dtype)
    sums = values.new_zeros(lengths.numel()).index_add(0, document_ids(cu_seqlens), values)
    return sums / lengths
