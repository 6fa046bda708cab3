"""The token VLA's decoding loop: N action tokens per row after its prompt, sampled or greedy
(``TokenVLAPolicy.act``; N = ``action_steps`` x D, step-major).

Each token's distribution is the softmax over the ``bins`` action-token logits alone, and a
row's log-prob is the sum over its N tokens. Two loops give the same tokens and log-probs
(tested to 1e-4 against the policy's teacher-forced ``evaluate``):

- **cached** (LLaVA, Idefics3): one forward over the prompts keeps the model's KV cache, then
  one forward per token over that token alone. The prompts are right-padded, so row ``i``'s
  padding sits between its prompt (``L_i`` tokens) and its action tokens in the cache; each
  step's attention mask keeps the padding out, and explicit position ids ``L_i + j`` give
  action token ``j`` the position it has in ``evaluate``'s layout (right after the prompt).
  Attention follows the cache's slots, rotary embeddings the position ids, so a row's
  log-probs do not depend on what it is batched with.
- **uncached** (every other family): a forward over the prompt and the tokens so far per
  token (the policy's own ``score``). Families whose position ids are not one per token
  (Qwen2-VL's multimodal rotary positions) or whose prompt attends both ways (PaliGemma's
  prefix) would need their own cache layout; they keep this loop, which is correct for any
  family and N forwards over the whole prompt slower.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributions import Categorical

CACHED_FAMILIES = frozenset({"llava", "idefics3"})
"""Model types (``config.model_type``) whose cached decoding is tested equal to ``evaluate``."""

Score = Callable[[dict[str, Tensor], Tensor, Tensor], tuple[Tensor, Tensor]]
"""``(inputs, lengths, tokens int64[B, k]) -> (action logits float32[B, k + 1, bins], the last
prompt token's hidden state float32[B, hidden])``: one uncached forward over prompt + tokens."""


@dataclass(frozen=True, slots=True)
class Decoded:
    """What decoding gives per row.

    Attributes:
        tokens: int64[B, N] action-token indices (bins, not vocabulary ids).
        log_prob: float32[B], the sum of the N tokens' log-probs.
        last_hidden: float32[B, hidden], the last prompt token's hidden state (the value's input).
    """

    tokens: Tensor
    log_prob: Tensor
    last_hidden: Tensor


@dataclass(frozen=True, slots=True)
class ActionDecoder:
    """Decodes a policy's action tokens, with the model's KV cache where its family allows.

    Attributes:
        model: the ``transformers`` image-text-to-text model.
        action_ids: int64[bins], the vocabulary id of each bin.
        score: the policy's uncached forward (the loop of every family without a cache); its
            logits come divided by ``temperature`` already.
        temperature: what the cached loop divides the model's action logits by (the policy's
            ``temperature``), so both loops sample from the same distribution.
    """

    model: nn.Module
    action_ids: Tensor
    score: Score
    temperature: float = 1.0

    @property
    def cached(self) -> bool:
        """Whether this model's family decodes with its KV cache."""
        return self.model.config.model_type in CACHED_FAMILIES

    def decode(
        self,
        inputs: dict[str, Tensor],
        lengths: Tensor,
        count: int,
        deterministic: bool,
        greedy_first: int = 0,
    ) -> Decoded:
        """``count`` tokens after each prompt (``inputs``, right-padded; ``lengths`` int64[B]).
        The first ``greedy_first`` of them are argmax always and left out of the log-prob (a
        greedy plan: what the tokens after it are conditioned on, not a choice of the policy)."""
        picks = _Picks(deterministic, greedy_first, len(lengths), lengths.device)
        if self.cached:
            decoded = self._decode_cached(inputs, lengths, count, picks)
            if decoded is not None:
                return decoded
        return self._decode_uncached(inputs, lengths, count, picks)

    def _decode_uncached(
        self, inputs: dict[str, Tensor], lengths: Tensor, count: int, picks: _Picks
    ) -> Decoded:
        tokens = torch.zeros(len(lengths), 0, dtype=torch.int64, device=lengths.device)
        last_hidden = None
        for j in range(count):
            logits, hidden = self.score(inputs, lengths, tokens)
            token = picks.pick(j, logits[:, j])
            last_hidden = hidden if j == 0 else last_hidden
            tokens = torch.cat([tokens, token[:, None]], dim=1)
        return Decoded(tokens=tokens, log_prob=picks.log_prob, last_hidden=last_hidden)

    def _decode_cached(
        self, inputs: dict[str, Tensor], lengths: Tensor, count: int, picks: _Picks
    ) -> Decoded | None:
        """The cached loop; None when the model kept no cache (training with gradient
        checkpointing turns it off)."""
        rows = torch.arange(len(lengths), device=lengths.device)
        width = inputs["input_ids"].shape[1]
        first = int(lengths.min()) - 1  # logits from the first position any row needs on
        out = self.model(
            **inputs,
            output_hidden_states=True,
            use_cache=True,
            **self._logits_to_keep(width - first),
        )
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        if cache is None:
            return None
        offset = width - out.logits.shape[1]
        logits = out.logits[rows, lengths - 1 - offset][:, self.action_ids].float()
        logits = logits / self.temperature
        last_hidden = out.hidden_states[-1][rows, lengths - 1].float()
        mask = inputs["attention_mask"]
        tokens = []
        for j in range(count):
            token = picks.pick(j, logits)
            tokens.append(token)
            if j == count - 1:
                break
            mask = torch.cat([mask, mask.new_ones(len(lengths), 1)], dim=1)
            step = self.model(
                input_ids=self.action_ids[token][:, None],
                attention_mask=mask,
                position_ids=(lengths + j)[:, None],
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
            logits = step.logits[:, -1, self.action_ids].float() / self.temperature
        return Decoded(
            tokens=torch.stack(tokens, dim=1), log_prob=picks.log_prob, last_hidden=last_hidden
        )

    @property
    def _cache_kwarg(self) -> str:
        # transformers 5 names it ``cache`` from 5.2x on, ``past_key_values`` before
        params = inspect.signature(self.model.forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    def _logits_to_keep(self, keep: int) -> dict[str, int]:
        # a full vocabulary's logits at every prompt position would be most of a large model's
        # activation memory
        params = inspect.signature(self.model.forward).parameters
        return {"logits_to_keep": keep} if "logits_to_keep" in params else {}


class _Picks:
    """Picks each decoded token (argmax when ``deterministic`` or among the ``greedy_first``,
    else sampled) and sums the log-probs of those after the ``greedy_first``."""

    def __init__(
        self, deterministic: bool, greedy_first: int, rows: int, device: torch.device
    ) -> None:
        self.deterministic, self.greedy_first = deterministic, greedy_first
        self.log_prob = torch.zeros(rows, device=device)

    def pick(self, j: int, logits: Tensor) -> Tensor:
        """Token ``j`` per row from action logits float32[B, bins]."""
        dist = Categorical(logits=logits, validate_args=False)
        greedy = self.deterministic or j < self.greedy_first
        token = dist.probs.argmax(-1) if greedy else dist.sample()
        if j >= self.greedy_first:
            self.log_prob = self.log_prob + dist.log_prob(token)
        return token
