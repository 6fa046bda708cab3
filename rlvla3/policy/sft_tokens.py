"""What SFT needs to know of a policy family: how many tokens one demo frame is, so that a batch
holds ``sft.token_budget`` tokens, and whether the family packs a batch without padding.

The loss is the same for every family (the negative log-likelihood of the demonstrated actions,
``ActorCritic.evaluate``); only the sequence a frame becomes differs:

- the VLA (``policy.kind: vla``) packs: a frame is its fixed tokens (CLS, proprio, keypoints,
  patches) plus its instruction's, and attention runs per sample on the packed sequence;
- the token VLA (``policy.kind: token_vla``) runs a ``transformers`` model on right-padded
  batches: a frame is its prompt (image tokens, instruction and state as text) plus one token per
  action dimension and step (``action_steps`` x D: its next K actions). The budget counts these
  real tokens; the padding a batch adds on top is not in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch import nn

from rlvla3.config.typed_load import ConfigError
from rlvla3.policy.token_vla import TokenVLAPolicy
from rlvla3.policy.vla import VLAPolicy
from rlvla3.policy.vla_prompt import decode_instruction

_PROBE_IMAGE_SIDE = 32


@dataclass(frozen=True, slots=True)
class FrameTokens:
    """How a policy family counts a demo frame's tokens.

    Attributes:
        fixed_tokens: tokens every frame has besides its instruction's.
        instruction_tokens: byte tokens int[N, L] -> each frame's instruction tokens int64[N].
        packed: whether a batch is packed without padding (else right-padded to its longest).
    """

    fixed_tokens: int
    instruction_tokens: Callable[[np.ndarray], np.ndarray]
    packed: bool


def frame_tokens(policy: nn.Module) -> FrameTokens:
    """The token counting of ``policy``'s family; a family SFT cannot train is a ``ConfigError``."""
    if isinstance(policy, VLAPolicy):
        config = policy.config
        return FrameTokens(config.num_fixed_tokens, config.instruction_token_counts, packed=True)
    if isinstance(policy, TokenVLAPolicy):
        return _token_vla_tokens(policy)
    raise ConfigError(
        f"policy.kind: SFT trains policy.kind vla or token_vla, not {type(policy).__name__}"
    )


def _token_vla_tokens(policy: TokenVLAPolicy) -> FrameTokens:
    """The prompt without its instruction (the image's tokens, the template, a state of zeros)
    plus the K x D action tokens, and the instruction's tokens on their own. Approximate by a few
    tokens: a state of more values writes more of them, and a BPE tokenizer with merges may
    split the whole prompt differently than its parts."""
    config, processor = policy.config, policy.processor
    # the processor resizes every image to the model's input (families that tile large images
    # into several would count more tokens for a large camera)
    image = np.zeros((_PROBE_IMAGE_SIDE, _PROBE_IMAGE_SIDE, 3), np.uint8)
    states = None
    if config.observation.state is not None:
        states = np.zeros((1, 1), np.float32)  # one value: real states add a few tokens each
    text = policy.prompt.prompts(np.zeros((1, 1), np.int64), states)
    prompt = processor(images=[[image]], text=text, return_tensors="pt")
    fixed = int(prompt["attention_mask"].sum()) + policy.bins.steps * policy.bins.dims
    tokenizer = processor.tokenizer

    def instruction_tokens(instructions: np.ndarray) -> np.ndarray:
        texts = [decode_instruction(row) for row in instructions]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return np.asarray([len(ids) for ids in encoded], np.int64)

    return FrameTokens(fixed, instruction_tokens, packed=False)
