"""Instruction tokens and FiLM conditioning for ``VLAPolicy`` (see rlvla3/policy/vla.py).

Two ways to turn the byte tokens of ``sim.tokenizer`` into transformer tokens
(``VLAConfig.instruction_tokens``):

- ``"bytes"``: one token per real (non-pad) byte: ``byte_embedding + position``.
- ``"words"``: one token per space-separated word, the mean of *position-in-word-specific* byte
  embeddings (byte ``b`` at character ``j`` of its word looks up row ``j * VOCAB_SIZE + b``; all
  characters from ``max_word_chars - 1`` on share the last row block), plus a word position.
  The sum over (byte, character position) pairs tells anagrams apart, unlike a plain bag of bytes.
  "push the red block to the blue target" is 8 tokens instead of 37: the trunk's cost per sample
  falls accordingly (the instruction was ~40 of ~106 tokens of the table-top VLA).

Both return padded ``[B, L, d]`` tokens and a ``bool[B, L]`` "real" mask; the policy drops the
unreal ones before the trunk, exactly as it drops pad bytes. ``sim.tokenizer.instruction_token_counts``
gives the same counts on the host (numpy) for the SFT packer's token budgets.

``FiLM`` (Perez et al. 2018, as used by RT-1 on its image tokens): a pooled summary of the
instruction tokens — the mean over real tokens of a per-token ``GELU(Linear(.))``, which, unlike a
mean of the raw tokens, binds each word to its position ("red block ... blue target" vs
"blue block ... red target") — is mapped to a per-channel scale and shift of the patch
embeddings: ``patch * (1 + gamma) + beta``. The output layer starts at zero, so at initialisation
FiLM is the identity and training decides how strongly the instruction gates what the image tokens
say (e.g. amplifying the channels that detect the named colour).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sim.tokenizer import PAD_ID, SPACE_ID, VOCAB_SIZE, InstructionTokens


def _word_layout(instr: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Word structure of byte tokens int64[B, L].

    Returns ``(is_char bool[B, L], word_index int64[B, L], char_index int64[B, L],
    num_words int64[B])``: whether a byte is part of a word (not pad, not space), the index of
    its word in the sample, and its index inside the word (both only meaningful where is_char).
    """
    is_char = (instr != PAD_ID) & (instr != SPACE_ID)
    before = torch.nn.functional.pad(is_char[:, :-1], (1, 0), value=False)
    starts = is_char & ~before
    word_index = starts.long().cumsum(1) - 1
    pos = torch.arange(instr.shape[1], device=instr.device).expand_as(instr)
    start_pos = torch.where(starts, pos, torch.zeros_like(pos)).cummax(1).values
    return is_char, word_index.clamp(min=0), pos - start_pos, starts.sum(1)


class InstructionEncoder(nn.Module):
    """Byte tokens int64[B, L] -> (tokens float[B, L, d], real bool[B, L]); see module docstring.

    Args:
        mode: ``"bytes"`` or ``"words"``.
        d_model: token width.
        max_len: longest instruction in bytes (sizes the position table).
        max_word_chars: character positions with their own byte embeddings (``"words"`` only).
    """

    def __init__(
        self, mode: InstructionTokens, d_model: int, max_len: int, max_word_chars: int = 8
    ) -> None:
        super().__init__()
        self.mode = mode
        self.max_word_chars = max_word_chars
        rows = VOCAB_SIZE * (max_word_chars if mode == "words" else 1)
        self.embed = nn.Embedding(rows, d_model)
        self.pos = nn.Parameter(torch.zeros(max_len, d_model))
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, instr: Tensor) -> tuple[Tensor, Tensor]:
        length = instr.shape[1]
        if self.mode == "bytes":
            return self.embed(instr) + self.pos[:length], instr != PAD_ID
        is_char, word, char, num_words = _word_layout(instr)
        row = instr + VOCAB_SIZE * char.clamp(max=self.max_word_chars - 1)
        emb = self.embed(row) * is_char[..., None]  # [B, L, d], zero outside words
        b, _, d = emb.shape
        sums = emb.new_zeros(b, length, d).scatter_add_(1, word[..., None].expand_as(emb), emb)
        counts = emb.new_zeros(b, length).scatter_add_(1, word, is_char.to(emb.dtype))
        words = sums / counts.clamp(min=1.0)[..., None] + self.pos[:length]
        real = torch.arange(length, device=instr.device)[None] < num_words[:, None]
        return words, real


class FiLM(nn.Module):
    """Per-channel scale and shift of image features from the instruction tokens (module docstring).

    ``forward(features float[B, N, channels], instr_tokens float[B, L, d_model], real bool[B, L])``
    returns ``features * (1 + gamma) + beta`` with ``gamma, beta: float[B, 1, channels]``;
    ``channels`` defaults to ``d_model`` (patch tokens).
    """

    def __init__(self, d_model: int, channels: int | None = None) -> None:
        super().__init__()
        channels = channels or d_model
        self.norm = nn.LayerNorm(d_model)  # unit-scale inputs, so the GELU is nonlinear
        self.pool_in = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, 2 * channels)
        nn.init.normal_(self.pool_in.weight, std=d_model**-0.5)
        nn.init.zeros_(self.pool_in.bias)
        nn.init.zeros_(self.out.weight)  # identity at init
        nn.init.zeros_(self.out.bias)

    def forward(self, features: Tensor, instr_tokens: Tensor, real: Tensor) -> Tensor:
        mask = real[..., None].to(instr_tokens.dtype)
        hidden = nn.functional.gelu(self.pool_in(self.norm(instr_tokens))) * mask
        pooled = hidden.sum(1) / mask.sum(1).clamp(min=1.0)  # [B, d]
        gamma, beta = self.out(pooled)[:, None].chunk(2, dim=-1)
        return features * (1.0 + gamma) + beta
