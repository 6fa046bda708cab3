"""What SFT needs to know of a policy family: how many tokens one demo frame is, so that a batch
holds ``sft.token_budget`` tokens, and how a batch of frames is evaluated (packed or padded).

The loss is the same for every family (the negative log-likelihood of the demonstrated actions,
``EvalOutput.log_prob``); only the sequence a frame becomes differs:

- the VLA (``policy.kind: vla``) packs: a frame is its fixed tokens (CLS, proprio, keypoints,
  patches) plus its instruction's, and attention runs per sample on the packed sequence;
- the token VLA (``policy.kind: token_vla``) runs a ``transformers`` model: a frame is its
  prompt (image tokens, instruction and state as text) plus one token per action dimension and
  step (``action_steps`` x D: its next K actions). With ``sft.packing`` (and a family that packs:
  ``token_vla_packing.packing_unsupported``) a batch's frames lie back to back in rows of
  ``sft.token_budget`` tokens, nothing padded but a row's tail; else a batch is right-padded to
  its longest frame, the padding on top of the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch import Tensor, nn

from rlvla3.config.typed_load import ConfigError
from rlvla3.policy.base import EvalOutput, ObsBatch
from rlvla3.policy.hf_model import pil_images
from rlvla3.policy.token_vla import TokenVLAPolicy
from rlvla3.policy.token_vla_packing import PackedEvaluator, packing_unsupported
from rlvla3.policy.vla import VLAPolicy

_PROBE_IMAGE_SIDE = 32


@dataclass(frozen=True, slots=True)
class FrameTokens:
    """How a policy family counts and evaluates demo frames.

    Attributes:
        fixed_tokens: tokens every frame has.
        variable_tokens: the frames' observations [N, ...] -> each frame's further tokens
            int64[N] (its instruction's; a token VLA's: its prompt text's).
        packed: whether a batch is packed without padding (else right-padded to its longest).
        evaluate: (observations, policy actions) -> ``EvalOutput``, packed or padded.
        padded_because: why a family that could pack trains on padded batches (None: it packs).
    """

    fixed_tokens: int
    variable_tokens: Callable[[dict[str, np.ndarray]], np.ndarray]
    packed: bool
    evaluate: Callable[[ObsBatch, Tensor], EvalOutput]
    padded_because: str | None = None


def frame_tokens(policy: nn.Module, *, packing: bool = True, row_tokens: int = 2048) -> FrameTokens:
    """The token counting and evaluation of ``policy``'s family (``packing``: ``sft.packing``;
    ``row_tokens``: ``sft.token_budget``); a family SFT cannot train is a ``ConfigError``."""
    if isinstance(policy, VLAPolicy):
        config = policy.config

        def instruction_tokens(obs: dict[str, np.ndarray]) -> np.ndarray:
            if "instruction" not in obs:
                return np.zeros(len(next(iter(obs.values()))), np.int64)
            return config.instruction_token_counts(obs["instruction"])

        return FrameTokens(config.num_fixed_tokens, instruction_tokens, True, policy.evaluate)
    if isinstance(policy, TokenVLAPolicy):
        fixed, variable = _token_vla_counts(policy)
        reason = packing_unsupported(policy.model) if packing else "sft.packing is false"
        if reason is None:
            return FrameTokens(fixed, variable, True, PackedEvaluator(policy, row_tokens))
        return FrameTokens(fixed, variable, False, policy.demo_evaluate, padded_because=reason)
    raise ConfigError(
        f"policy.kind: SFT trains policy.kind vla or token_vla, not {type(policy).__name__}"
    )


def _token_vla_counts(policy: TokenVLAPolicy):
    """The image's tokens (and what the processor adds around a prompt) plus the action tokens,
    and each frame's prompt text on its own. Exact for a tokenizer that splits at special
    tokens, as the image token is (a SentencePiece tokenizer's prefix space may count one
    token more or less), while the processor expands an image into a fixed number of tokens
    (families that tile large images into several count more for a large camera)."""
    config, processor, prompt = policy.config, policy.processor, policy.prompt
    image = np.zeros((_PROBE_IMAGE_SIDE, _PROBE_IMAGE_SIDE, 3), np.uint8)
    probe = processor(images=pil_images([image]), text=[prompt.image_token], return_tensors="pt")
    fixed = int(probe["attention_mask"].sum()) + policy.bins.tokens
    tokenizer, mapping = processor.tokenizer, config.observation

    def prompt_tokens(obs: dict[str, np.ndarray]) -> np.ndarray:
        states = None if config.text_state is None else obs[config.text_state]
        texts = [
            text[len(prompt.image_token) :]
            for text in prompt.prompts(obs[mapping.instruction], states)
        ]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return np.asarray([len(ids) for ids in encoded], np.int64)

    return fixed, prompt_tokens
