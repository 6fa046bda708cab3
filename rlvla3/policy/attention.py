"""The one attention function the whole project calls (policy, RL trainer, SFT trainer).

Two layouts:

- **padded** (``cu_seqlens is None``): ``q, k, v`` are ``[B, H, L, Dh]``; an optional
  ``key_padding_mask: bool[B, L]`` (True = real token, keep) hides pad keys. Runs
  ``F.scaled_dot_product_attention``.
- **packed / varlen** (``cu_seqlens`` given): ``q, k, v`` are ``[total_tokens, H, Dh]``, the
  tokens of ``num_docs`` documents laid end to end; ``cu_seqlens: int32[num_docs + 1]`` holds the
  document boundaries (``0, len0, len0 + len1, ..., total_tokens``). No token attends across
  documents. On CUDA in fp16/bf16 this is a FlashAttention varlen kernel: flash-attn 2's
  ``flash_attn_varlen_func`` when it imports, else flash-attn 4's (``flash_attn.cute``, the CuTe
  DSL kernels for Hopper and Blackwell, a pure-Python wheel), else PyTorch's own
  ``torch.nn.attention.varlen.varlen_attn`` (the FlashAttention-2 kernels built into CUDA builds of
  torch >= 2.10, so a GPU needs no extra install). Everywhere else it is SDPA per document segment
  (see ``_sdpa_per_segment``).

Why per-segment SDPA on CPU: measured with torch 2.13, training in packed form with per-segment SDPA
runs ~2.0x faster in real tokens/s than padding, while one dense block-diagonal mask over the whole
pack gave no speed-up (0.83x: it pays the full ``total_tokens**2`` attention) and FlexAttention has
no CPU backward. flash-attn 4 is the optional ``gpu`` extra (``pip install rlvla3[gpu]``), imported
lazily; flash-attn 2 is used when installed (it has no wheel).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

_HALF_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flash_varlen_func() -> Callable[..., Tensor] | None:
    """flash-attn 2.x's ``flash_attn.flash_attn_varlen_func`` if it imports cleanly, else None."""
    try:
        from flash_attn import flash_attn_varlen_func
    except (ImportError, OSError):  # not installed, or built against another torch / CUDA
        return None
    return flash_attn_varlen_func


@functools.cache
def _flash4_varlen_func() -> Callable[..., object] | None:
    """flash-attn 4's ``flash_attn.cute.flash_attn_varlen_func`` (CuTe DSL kernels compiled at
    first use; Hopper and Blackwell) if it imports cleanly, else None."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except (ImportError, OSError, RuntimeError):  # absent, or its CUDA libraries do not load
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen_func() -> Callable[..., Tensor] | None:
    """``torch.nn.attention.varlen.varlen_attn`` on a CUDA build of torch >= 2.10, else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _flash2(
    q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int, *, causal: bool
) -> Tensor:
    """flash-attn 2's varlen function (positional boundaries, returns the output)."""
    flash = _flash_varlen_func()
    assert flash is not None
    return flash(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=causal)


def _flash4(
    q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int, *, causal: bool
) -> Tensor:
    """flash-attn 4 takes the boundaries by keyword and returns ``(out, lse)`` (``lse`` None
    unless asked for): keep ``out``."""
    flash = _flash4_varlen_func()
    assert flash is not None
    result = flash(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        causal=causal,
    )
    return result[0] if isinstance(result, tuple) else result


def _torch_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int, *, causal: bool
) -> Tensor:
    """PyTorch's varlen attention. Its causal flag changed form across releases: ``is_causal``
    (2.10) became ``window_size=(-1, 0)`` (later releases), so ask the signature which it takes."""
    varlen_attn = _torch_varlen_func()
    assert varlen_attn is not None
    kwargs = _causal_kwargs(varlen_attn) if causal else {}
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


@functools.cache
def _causal_kwargs(varlen_attn: Callable[..., Tensor]) -> dict[str, object]:
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        return {"window_size": (-1, 0)}
    if "is_causal" in params:
        return {"is_causal": True}
    raise RuntimeError("this torch's varlen_attn takes no causal flag")


# flash-attn 4 is used where it was checked against per-sample attention (tests/test_gpu.py):
# Hopper, head dims 64 and 128. Elsewhere (the table-top VLA's head dim 16, other GPUs) the
# next kernel serves.
_FLASH4_HEAD_DIMS = (64, 128)
_FLASH4_CAPABILITY_MAJOR = (9,)


def _flash4_fits(device: torch.device, head_dim: int | None) -> bool:
    if head_dim is not None and head_dim not in _FLASH4_HEAD_DIMS:
        return False
    return _capability_major(device) in _FLASH4_CAPABILITY_MAJOR


@functools.cache
def _capability_major(device: torch.device) -> int:
    """The CUDA compute capability's major number of ``device`` (9: Hopper)."""
    return torch.cuda.get_device_capability(device)[0]


def _always(device: torch.device, head_dim: int | None) -> bool:
    return True


class VarlenKernel(NamedTuple):
    """One FlashAttention varlen kernel behind ``attention()``."""

    load: Callable[[], object]
    """The imported function, or None where it does not import."""
    fits: Callable[[torch.device, int | None], bool]
    """Whether it serves this GPU and head dim (None: any)."""
    run: Callable[..., Tensor]
    """The call, as ``run(q, k, v, cu_seqlens, max_seqlen, causal=)``."""


# In the order they are preferred. The loaders sit in lambdas so that they are looked up at
# call time (tests replace them).
VARLEN_KERNELS: dict[str, VarlenKernel] = {
    "flash_attn_varlen": VarlenKernel(lambda: _flash_varlen_func(), _always, _flash2),
    "flash_attn4_varlen": VarlenKernel(lambda: _flash4_varlen_func(), _flash4_fits, _flash4),
    "torch_varlen_attn": VarlenKernel(lambda: _torch_varlen_func(), _always, _torch_varlen),
}
_preferred: str | None = None


def prefer_varlen_kernel(name: str | None) -> None:
    """Use the varlen kernel ``name`` (a key of ``VARLEN_KERNELS``) whenever it is available,
    before the default order; ``None`` restores that order. For benchmarks and tests that
    compare kernels on one machine."""
    global _preferred
    if name is not None and name not in VARLEN_KERNELS:
        raise ValueError(f"unknown varlen kernel {name!r}; known: {', '.join(VARLEN_KERNELS)}")
    _preferred = name


def available_varlen_kernels() -> list[str]:
    """Names of the varlen kernels that load in this process (CUDA ones need a GPU to run)."""
    return [name for name, kernel in VARLEN_KERNELS.items() if kernel.load() is not None]


def _kernel_backend(device: torch.device, half: bool, head_dim: int | None = None) -> str | None:
    """The FlashAttention varlen backend for ``device`` (None: use SDPA per segment)."""
    if device.type != "cuda" or not half:
        return None
    names = list(VARLEN_KERNELS)
    if _preferred is not None:
        names.insert(0, _preferred)
    for name in names:
        kernel = VARLEN_KERNELS[name]
        if kernel.load() is not None and kernel.fits(device, head_dim):
            return name
    return None


def backend_name(
    device: torch.device | str, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> str:
    """Name of the packed-attention backend used on ``device``, for logs and benchmark reports.

    Returns ``"flash_attn_varlen"`` (flash-attn 2), ``"flash_attn4_varlen"`` (flash-attn 4, the
    CuTe DSL kernels) or ``"torch_varlen_attn"`` (torch's built-in FlashAttention varlen) when
    ``device`` is CUDA and ``dtype`` is fp16/bf16 (``dtype=None`` assumes half precision, e.g.
    under autocast); else ``"sdpa_per_segment"``. ``head_dim`` (None: any) matters for flash-attn
    4, used for head dims 64 and 128 on Hopper only.
    """
    device = torch.device(device)
    half = dtype is None or dtype in _HALF_DTYPES
    return _kernel_backend(device, half, head_dim) or "sdpa_per_segment"


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Scaled dot-product attention, padded or packed (softmax scale ``1 / sqrt(Dh)``).

    Args:
        q, k, v: padded ``[B, H, L, Dh]`` or packed ``[total_tokens, H, Dh]`` (same dtype/device).
        cu_seqlens: int32[num_docs + 1], cumulative document lengths; selects the packed form.
        max_seqlen: longest document in the pack; required by flash-attn (computed if None).
        causal: each query attends only to keys at or before its position (within its document).
        key_padding_mask: padded form only, bool[B, L], True = real key. A query whose keys are all
            masked gets an undefined (possibly NaN) output; such rows must not be read.

    Returns:
        Same layout and shape as ``q``.
    """
    if cu_seqlens is None:
        return _padded(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
    if key_padding_mask is not None:
        raise ValueError("key_padding_mask is for the padded form; packed tokens carry no padding")
    if q.dim() != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"packed q/k/v must be [total, H, Dh], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with >= 2 entries, got {tuple(cu_seqlens.shape)}")
    backend = _kernel_backend(q.device, q.dtype in _HALF_DTYPES, q.shape[-1])
    if backend is None:
        return _sdpa_per_segment(q, k, v, cu_seqlens, causal=causal)
    if not cu_seqlens.is_cuda:  # checked where it costs no device sync (the kernels check none)
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != q.shape[0] or bounds != sorted(bounds):
            raise ValueError(
                f"cu_seqlens must run non-decreasing from 0 to total_tokens="
                f"{q.shape[0]}, got {bounds[0]}..{bounds[-1]}"
            )
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return VARLEN_KERNELS[backend].run(q, k, v, cu, max_seqlen, causal=causal)


# SDPA kernels for the padded form on CUDA: all but cuDNN. Measured with torch 2.11 on an H200
# (bench/sdpa_backends.py, bench/results/gpu_h200/sdpa_backends.json), masked SDPA's default
# choice takes 247 ms per forward + backward when the length changes every call (cuDNN builds a
# plan per new shape: 85 ms alone), against 0.44 ms for the memory-efficient kernel. Padded
# batches change shape all the time (a batch's longest sample, a rollout batch's size), so cuDNN
# is left out.
_CUDA_PADDED_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def _padded(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_padding_mask: Tensor | None
) -> Tensor:
    """SDPA on ``[B, H, L, Dh]``, with pad keys (and future keys if causal) masked out."""
    if q.dim() != 4:
        raise ValueError(f"padded q/k/v must be [B, H, L, Dh], got {tuple(q.shape)}")
    if q.is_cuda:
        with sdpa_kernel(_CUDA_PADDED_BACKENDS):
            return _padded_sdpa(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
    return _padded_sdpa(q, k, v, causal=causal, key_padding_mask=key_padding_mask)


def _padded_sdpa(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_padding_mask: Tensor | None
) -> Tensor:
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if key_padding_mask.shape != (k.shape[0], k.shape[2]) or key_padding_mask.dtype != torch.bool:
        raise ValueError(
            f"key_padding_mask must be bool[B, L]={k.shape[0], k.shape[2]}, got "
            f"{key_padding_mask.dtype}{list(key_padding_mask.shape)}"
        )
    mask = key_padding_mask[:, None, None, :]  # [B, 1, 1, Lk], broadcast over heads and queries
    if causal:
        tril = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        mask = mask & tril  # top-left aligned, like SDPA's is_causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _sdpa_per_segment(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *, causal: bool
) -> Tensor:
    """Packed attention as SDPA per document, documents of equal length batched into one call.

    The QKV / MLP linears around it still run once over all packed tokens; only the attention
    itself is split, so each document pays ``len**2`` rather than ``total**2`` (dense block mask)
    or ``max_len**2`` (padding). The split is one ``torch.split`` (its backward is one
    concatenation; slicing ``x[start:end]`` per document made backward O(num_docs * total_tokens),
    as each slice's gradient is a zero tensor of the full packed size), and there is one SDPA call
    per distinct document length: measured 1.4-3x faster than a call per document, same result.
    """
    bounds = cu_seqlens.tolist()  # host copy; on CPU this is free
    if bounds[0] != 0 or bounds[-1] != q.shape[0]:
        raise ValueError(
            f"cu_seqlens must run from 0 to total_tokens={q.shape[0]}, "
            f"got {bounds[0]}..{bounds[-1]}"
        )
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if min(lengths) < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    if len(set(lengths)) == 1 and lengths[0] > 0:
        n, length = len(lengths), lengths[0]

        def split(x: Tensor) -> Tensor:  # [n * len, H, Dh] -> [n, H, len, Dh]
            return x.view(n, length, *x.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=causal)
        return out.transpose(1, 2).reshape(q.shape[0], *v.shape[1:])
    groups: dict[int, list[int]] = {}  # length -> indices of the documents that long
    for i, length in enumerate(lengths):
        if length > 0:
            groups.setdefault(length, []).append(i)
    out_shape = (q.shape[0], *v.shape[1:])  # values may be wider than queries and keys
    if not groups:
        return q.new_empty(out_shape)
    segments = [torch.split(x, lengths) for x in (q, k, v)]
    outs: list[Tensor] = [v.new_empty(0, *v.shape[1:])] * len(lengths)
    for idx in groups.values():
        # [g, H, len, Dh] per input; one call for all g documents of this length
        qkv = [torch.stack([seg[i] for i in idx]).transpose(1, 2) for seg in segments]
        out = F.scaled_dot_product_attention(*qkv, is_causal=causal).transpose(1, 2)
        for i, doc in zip(idx, out.unbind(0), strict=True):
            outs[i] = doc
    return torch.cat(outs, dim=0)
