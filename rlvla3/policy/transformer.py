"""The VLA's transformer trunk: pre-norm self-attention blocks over packed or padded tokens.

Packed tokens (float[T, d], documents at ``cu_seqlens``) run through the variable-length form of
``rlvla3.policy.attention.attention``; padded ones (float[B, L, d]) through its masked form.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from rlvla3.policy.attention import attention


class SelfAttention(nn.Module):
    """Multi-head self-attention on packed ``[T, d]`` or padded ``[B, L, d]`` tokens."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(
        self,
        x: Tensor,
        *,
        cu_seqlens: Tensor | None = None,
        max_seqlen: int | None = None,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        rows: Tensor | None = None,
    ) -> Tensor:
        """Attention output of every token, or (packed form, ``rows`` int64[R] given) of the
        tokens ``rows`` only: ``[R, d]``, every token still serving as a key and value."""
        h, dh = self.num_heads, self.head_dim
        if cu_seqlens is not None:  # packed: [T, d] -> q, k, v [T, H, Dh]
            q, k, v = self.qkv(x).view(x.shape[0], 3, h, dh).unbind(1)
            out = attention(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, causal=causal)
            out = out.reshape(x.shape)
            return self.proj(out if rows is None else out[rows])
        if rows is not None:
            raise ValueError("rows is for the packed form")
        b, n, _ = x.shape  # padded: [B, L, d] -> q, k, v [B, H, L, Dh]
        q, k, v = self.qkv(x).view(b, n, 3, h, dh).permute(2, 0, 3, 1, 4).unbind(0)
        out = attention(q, k, v, key_padding_mask=key_padding_mask, causal=causal)
        return self.proj(out.transpose(1, 2).reshape(x.shape))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, num_heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        hidden = int(d_model * mlp_ratio)
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, num_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, rows: Tensor | None = None, **attn_kwargs) -> Tensor:
        """``x``'s shape, or ``[R, d]`` for the packed tokens ``rows`` alone (see
        ``Transformer.forward``)."""
        attended = self.attn(self.ln1(x), rows=rows, **attn_kwargs)
        x = (x if rows is None else x[rows]) + self.drop(attended)
        return x + self.drop(self.mlp(self.ln2(x)))


class Transformer(nn.Module):
    """A stack of pre-norm blocks plus a final LayerNorm, in packed or padded form.

    ``forward(x, cu_seqlens=..., max_seqlen=...)`` takes packed float[T, d] tokens;
    ``forward(x, key_padding_mask=...)`` takes padded float[B, L, d]. Output has ``x``'s shape,
    or, packed with ``out_rows`` int64[R], the final states of those tokens alone, float[R, d].
    """

    def __init__(
        self,
        *,
        d_model: int,
        num_layers: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.blocks = nn.ModuleList(
            Block(d_model, num_heads, mlp_ratio, dropout) for _ in range(num_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.apply(init_weights)
        for block in self.blocks:  # GPT-2: scale residual outputs by depth
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * num_layers))

    def forward(
        self,
        x: Tensor,
        *,
        cu_seqlens: Tensor | None = None,
        max_seqlen: int | None = None,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        out_rows: Tensor | None = None,
    ) -> Tensor:
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            # The last block's output is only read at out_rows: its attention projection, MLP
            # and norms run on those rows alone (the VLA reads one CLS row of ~27 tokens: 3/8 of
            # a 2-layer trunk's matmuls, ~6% of the table-top VLA's forward and backward);
            # every row still serves as a key and value.
            x = block(
                x,
                rows=out_rows if i == last else None,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                key_padding_mask=key_padding_mask,
                causal=causal,
            )
        return self.ln_f(x)


def init_weights(module: nn.Module) -> None:
    """GPT-2 initialisation: linear and conv weights and embeddings from N(0, 0.02), biases 0."""
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
