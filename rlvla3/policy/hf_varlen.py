"""Our varlen attention (``rlvla3.policy.attention.attention`` with ``cu_seqlens``) inside a
``transformers`` language model, for packed token-VLA rows.

``transformers`` 5 packs for sdpa and eager attention with a dense block-diagonal mask over the
whole row: every token pays the row's length squared, the frames' own attention a small part of
it (measured: packed SFT of the llava-tiny preset 6.6x slower than padded on CPU,
bench/token_vla_packing.py). Its varlen path is FlashAttention only, which needs a CUDA GPU and
the flash-attn package. This module registers one more attention implementation,
``rlvla3_varlen``, under ``transformers``' ``AttentionInterface``: given the packed row's
``cu_seq_lens_q`` (the kwargs transformers' own FlashAttention path reads, passed through the
model's forward) it runs ``attention()`` per frame: FlashAttention varlen kernels on a GPU,
SDPA per segment (one call per distinct frame length) on CPU. Without them (a padded batch, the
act side) it is transformers' sdpa, unchanged.

Only the language model switches (``use_varlen_attention``); vision towers keep theirs.
"""

from __future__ import annotations

import functools
import math

from torch import Tensor, nn

from rlvla3.policy.attention import attention

VARLEN_ATTENTION = "rlvla3_varlen"
"""The attention implementation's name in ``transformers``' registry."""
SWITCHABLE = ("sdpa", "eager")
"""Implementations ``use_varlen_attention`` replaces (FlashAttention packs varlen itself)."""


def varlen_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """``transformers``' attention-function contract: q [B, H, L, Dh], k/v [B, Hkv, L, Dh] ->
    ([B, L, H, Dh], None). Varlen over one packed row when ``cu_seq_lens_q`` is given."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"{VARLEN_ATTENTION}: cu_seq_lens_q bounds one packed row, unmasked")
    if dropout:
        raise ValueError(f"{VARLEN_ATTENTION}: attention dropout is not supported")
    groups = getattr(module, "num_key_value_groups", 1)
    head_dim = query.shape[-1]
    factor = 1.0 if scaling is None else scaling * math.sqrt(head_dim)
    if not math.isclose(factor, 1.0):  # attention() scales by 1/sqrt(Dh): the model's into q
        query = query * factor
    q, k, v = (
        x[0].transpose(0, 1) for x in (query, repeat_kv(key, groups), repeat_kv(value, groups))
    )
    out = attention(
        q, k, v, cu_seqlens=cu_seqlens, max_seqlen=kwargs.get("max_length_q"), causal=True
    )
    return out[None], None


def _varlen_mask(*, attention_mask: Tensor | None = None, **kwargs):
    """No mask for a packed row (the frames' bounds travel as ``cu_seq_lens_q``); sdpa's mask
    for a padded batch."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


@functools.cache
def register() -> None:
    """Register ``rlvla3_varlen`` with ``transformers`` (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, _varlen_mask)


def use_varlen_attention(model: nn.Module) -> bool:
    """Switch ``model``'s language model to ``rlvla3_varlen`` where it runs sdpa or eager.
    Returns whether the model now runs it."""
    text = model.config.get_text_config()
    current = getattr(text, "_attn_implementation", None)
    if current == VARLEN_ATTENTION:
        return True
    if current not in SWITCHABLE:
        return False
    register()
    key = next((name for name in model.config.sub_configs if name == "text_config"), None)
    model.set_attn_implementation({key: VARLEN_ATTENTION} if key else VARLEN_ATTENTION)
    return text._attn_implementation == VARLEN_ATTENTION
