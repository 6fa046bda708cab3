"""Padding-free ("packed") evaluation of a token VLA: several frames back to back in one row.

A frame is its prompt (the processor's tokens: image tokens, instruction, state) followed by its
D action tokens. ``pack_frames`` lays frames back to back with ``position_ids`` that restart at
0 for every frame, and no ``attention_mask`` (that is how ``transformers`` 5 recognises a packed
batch). Which attention keeps the frames apart:

- **varlen** (the default): the language model's sdpa or eager attention is switched to
  ``rlvla3_varlen`` (``rlvla3/policy/hf_varlen.py``), our ``attention()`` over the frames'
  ``cu_seqlens``; every frame in one row, no padding at all;
- a FlashAttention implementation: ``transformers``' own varlen path, also one row (it packs
  only a batch of one row, ``_is_packed_sequence``);
- ``varlen=False`` on sdpa or eager: ``transformers``' ``masking_utils`` finds the restarts
  (``find_packed_sequence_indices``) and builds a dense block-diagonal causal mask; frames go
  into rows of at most ``row_tokens`` (best-fit decreasing, ``sft.packing.pack``), each row's
  tail its own segment (its positions restart too). Every token then pays its row's length
  squared: slower than padding on CPU (bench/token_vla_packing.py), kept for comparison.

Images: the vision towers of LLaVA and Idefics3 / SmolVLM encode every image of the batch on its
own and scatter the features over the image tokens in row-major order (``masked_scatter``), so
the per-image tensors (``pixel_values``, ``pixel_attention_mask``...) are put in the order the
frames take in the rows, and each frame's image tokens get its own image.

What cannot pack (``packing_unsupported``, decided once from the model):
- multimodal rotary positions (Qwen2-VL and its kin: 3-D position ids computed from the image
  grid by the model's ``get_rope_index``): positions that restart per frame are not theirs;
- ``token_type_ids`` (PaliGemma, Gemma 3: a bidirectional prefix per sample): transformers
  reads them at the packed positions, not at the tokens, once it remaps a packed mask;
- cross-attention to the images (Mllama: ``cross_attention_mask`` [B, L, images, tiles]),
  which the packed rows do not lay out.

A sliding attention window (Mistral, Cohere 2...) does not stop packing: packed attention
attends over the whole frame, which is what the window does for a frame no longer than it.
A batch with a longer frame is evaluated padded instead (``PackedEvaluator.padded_batches``
counts them), where the model applies its window itself.

Per frame the figures are the padded ``TokenVLAPolicy.evaluate``'s (tested to 1e-4 in float32):
log-prob and entropy summed over the D action tokens, the value head on the last prompt
token's last hidden state.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributions import Categorical

from rlvla3.policy.base import EvalOutput, ObsBatch
from rlvla3.policy.hf_varlen import VARLEN_ATTENTION, use_varlen_attention
from rlvla3.policy.token_vla import TokenVLAPolicy
from sft.packing import pack

_MASK_KEYS = ("attention_mask",)
"""Per-token inputs left out of a packed batch: their absence is what marks it as packed."""


def packing_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot take packed rows, or None when it can."""
    params = inspect.signature(model.forward).parameters
    if "position_ids" not in params:
        return "its forward takes no position_ids"
    inner = getattr(model, "model", None)
    if any(hasattr(m, "get_rope_index") for m in (model, inner) if m is not None):
        return (
            "its rotary positions are multimodal (3-D position ids from the image grid, "
            "Qwen2-VL's kind), which do not restart per frame"
        )
    if float(getattr(model.config.get_text_config(), "attention_dropout", 0.0) or 0.0) > 0:
        return "its language model drops attention weights out, which varlen attention does not"
    if "token_type_ids" in params:
        return (
            "it takes token_type_ids (a bidirectional prefix per sample), which transformers' "
            "packed mask reads at the wrong places"
        )
    if "cross_attention_mask" in params:
        return (
            "its images enter through cross-attention layers (Mllama's kind), masked per token "
            "and image, which the packed rows do not lay out"
        )
    return None


def sliding_window(model: nn.Module) -> int | None:
    """The language model's sliding attention window where some layer uses one (Gemma 3,
    Mistral, Cohere 2...), else None (Qwen2 configs carry a window they do not use)."""
    text = model.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    if not window or getattr(text, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def one_row_only(model: nn.Module) -> bool:
    """Whether the language model's attention is varlen, which takes one row (FlashAttention,
    ``rlvla3_varlen``), rather than a block-diagonal mask over rows."""
    text = model.config.get_text_config()
    implementation = getattr(text, "_attn_implementation", None) or ""
    return "flash" in implementation or implementation == VARLEN_ATTENTION


@dataclass(frozen=True, slots=True)
class PackedRows:
    """Frames laid back to back in rows.

    Attributes:
        inputs: the model's inputs: ``input_ids`` and ``position_ids`` int64[R, W], other
            per-token inputs [R, W], per-image inputs in the frames' row-major order.
        row: int64[B], each frame's row (frames in their original order).
        last_prompt: int64[B], the column of each frame's last prompt token in its row.
        real_tokens: tokens of the frames (prompts and action tokens).
        slots: R * W, the tokens the model runs on (real ones and the rows' tails).
        cu_seqlens: int32[B + 1], the frames' bounds in a single row (None for several rows).
        max_seqlen: the longest frame's tokens.
    """

    inputs: dict[str, Tensor]
    row: Tensor
    last_prompt: Tensor
    real_tokens: int
    slots: int
    cu_seqlens: Tensor | None
    max_seqlen: int

    def varlen_kwargs(self) -> dict[str, Tensor | int]:
        """The frames' bounds as the forward kwargs ``transformers`` hands its attention
        functions (FlashAttention's names; ``rlvla3_varlen`` reads the same)."""
        if self.cu_seqlens is None:
            raise ValueError("varlen attention takes one packed row")
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }

    @property
    def padding_fraction(self) -> float:
        """The share of the model's token slots that is row tail."""
        return 1.0 - self.real_tokens / self.slots


def pack_frames(
    inputs: dict[str, Tensor],
    lengths: Tensor,
    action_tokens: Tensor,
    *,
    row_tokens: int | None,
    pad_id: int,
) -> PackedRows:
    """Lay right-padded processor inputs out as packed rows.

    Args:
        inputs: the processor's batch: per-token inputs [B, L] (prompts right-padded), per-image
            inputs with B leading.
        lengths: int64[B], each prompt's real tokens.
        action_tokens: int64[B, D], each frame's action tokens (vocabulary ids).
        row_tokens: the most tokens a row holds; None: every frame in one row.
        pad_id: the token id of the rows' tails.

    Raises:
        ValueError: an input that is neither per-token nor per-image (named), or a frame longer
            than ``row_tokens``.
    """
    b, d = action_tokens.shape
    sizes = (lengths + d).tolist()
    bins = [list(range(b))] if row_tokens is None else pack(sizes, row_tokens)
    width = max(sum(sizes[i] for i in frames) for frames in bins)
    device = lengths.device
    position = torch.zeros(len(bins), width, dtype=torch.int64, device=device)
    row = torch.empty(b, dtype=torch.int64, device=device)
    start = torch.empty(b, dtype=torch.int64, device=device)
    for r, frames in enumerate(bins):
        column = 0
        for i in frames:
            position[r, column : column + sizes[i]] = torch.arange(sizes[i], device=device)
            row[i], start[i] = r, column
            column += sizes[i]
        position[r, column:] = torch.arange(width - column, device=device)  # the tail's segment
    order = torch.tensor([i for frames in bins for i in frames], device=device)
    layout = _Layout(row, start, lengths, position.shape)
    packed = {"position_ids": position}
    for key, value in inputs.items():
        if key in _MASK_KEYS:
            continue
        if key == "input_ids":
            packed[key] = layout.tokens(value, action_tokens, pad_id)
        elif _per_token(value, inputs["input_ids"]):
            packed[key] = layout.tokens(value, torch.zeros_like(action_tokens), 0)
        elif value.dim() and value.shape[0] == b:
            packed[key] = value.index_select(0, order)
        else:
            raise ValueError(
                f"token VLA packing: the processor's {key!r} {tuple(value.shape)} is neither per "
                f"token nor per image of the {b} frames"
            )
    cu_seqlens = None
    if len(bins) == 1:
        bounds = torch.tensor([0] + [sizes[i] for i in bins[0]], device=device).cumsum(0)
        cu_seqlens = bounds.to(torch.int32)
    return PackedRows(
        packed, row, start + lengths - 1, sum(sizes), len(bins) * width, cu_seqlens, max(sizes)
    )


def _per_token(value: Tensor, input_ids: Tensor) -> bool:
    return value.shape == input_ids.shape and not value.is_floating_point()


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where each frame's tokens go: row, first column, prompt length, and the rows' shape."""

    row: Tensor
    start: Tensor
    lengths: Tensor
    shape: torch.Size

    def tokens(self, prompts: Tensor, suffix: Tensor, fill: int) -> Tensor:
        """Right-padded per-token prompts [B, L] and their suffixes [B, D] -> rows [R, W]."""
        out = prompts.new_full(self.shape, fill)
        for i, n in enumerate(self.lengths.tolist()):
            r, s, d = int(self.row[i]), int(self.start[i]), suffix.shape[1]
            out[r, s : s + n] = prompts[i, :n]
            out[r, s + n : s + n + d] = suffix[i]
        return out


class PackedEvaluator:
    """``TokenVLAPolicy.evaluate`` over packed rows: the same figures per frame, no padding but
    the rows' tails.

    Args:
        policy: the token VLA (its model must pass ``packing_unsupported``).
        row_tokens: the most tokens a row holds (``sft.token_budget``) under a block-diagonal
            mask; varlen attention takes every frame in one row.
        varlen: switch the language model's sdpa or eager attention to ``rlvla3_varlen``
            (``rlvla3/policy/hf_varlen.py``); False leaves transformers' dense packed mask.

    Attributes:
        window: the language model's sliding attention window (None: it has none).
        padded_batches: batches evaluated padded because a frame was longer than ``window``.
    """

    def __init__(self, policy: TokenVLAPolicy, row_tokens: int, *, varlen: bool = True) -> None:
        reason = packing_unsupported(policy.model)
        if reason is not None:
            raise ValueError(f"{type(policy.model).__name__} cannot pack: {reason}")
        if varlen:
            use_varlen_attention(policy.model)
        self.policy = policy
        self.varlen = one_row_only(policy.model)
        self.row_tokens = None if self.varlen else row_tokens
        self.window = sliding_window(policy.model)
        self.padded_batches = 0
        self.last: PackedRows | None = None

    def __call__(self, obs: ObsBatch, action: Tensor) -> EvalOutput:
        """Log-prob float32[B] and entropy float32[B] (each summed over the K x D tokens, a
        plan's too: ``TokenVLAPolicy.demo_evaluate`` on packed frames) and
        value float32[B] of actions int64[B, D] (an action chunk's int64[B, K, D])."""
        policy = self.policy
        inputs, lengths = policy._prompt_inputs(obs)
        tokens = policy.action_tokens(action, lengths)
        dims = tokens.shape[1]
        if self.window is not None and int(lengths.max()) + dims > self.window:
            # packed attention would see past the window: the padded batch applies it
            self.padded_batches += 1
            return policy.evaluate_prompts(inputs, lengths, tokens, obs)
        rows = pack_frames(
            inputs,
            lengths,
            policy.action_ids[tokens],
            row_tokens=self.row_tokens,
            pad_id=policy.pad_id,
        )
        self.last = rows
        # column j of a frame predicts its action token j
        columns = rows.last_prompt[:, None] + torch.arange(dims, device=lengths.device)
        kwargs, picked = {}, columns
        if policy.keeps_logits:  # the vocabulary's logits only where an action token is read
            keep = torch.unique(columns)
            kwargs["logits_to_keep"] = keep
            picked = torch.searchsorted(keep, columns)
        if self.varlen:
            kwargs.update(rows.varlen_kwargs())
        with policy.state_added(obs, rows.last_prompt, rows.row):
            out = policy.model(**rows.inputs, output_hidden_states=True, use_cache=False, **kwargs)
        logits = out.logits[rows.row[:, None], picked][..., policy.action_ids].float()
        logits = logits / policy.config.temperature
        last_hidden = out.hidden_states[-1][rows.row, rows.last_prompt].float()
        dist = Categorical(logits=logits, validate_args=False)
        return EvalOutput(
            log_prob=dist.log_prob(tokens).sum(-1),
            entropy=dist.entropy().sum(-1),
            value=policy._value(last_hidden, obs),
        )
