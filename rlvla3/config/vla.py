"""``VLAConfig``, the VLA's architecture, apart from the model so that the run config can check
``policy.vla`` without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from sim.tokenizer import InstructionTokens, instruction_token_counts

ActionHead = Literal["discrete_bins", "gaussian", "categorical"]

# Fields that follow the env's observation and action spaces when ``policy.vla`` leaves them out.
FIELDS_FROM_ENV_SPACES = (
    "image_size",
    "channels",
    "max_instruction_len",
    "proprio_dim",
    "num_actions",
    "action_dim",
    "action_low",
    "action_high",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class VLAConfig:
    """Architecture of ``VLAPolicy``. Defaults are the tiny CPU test model."""

    image_size: int = 64
    """Square image side in pixels (obs["image"] is uint8[B, S, S, channels])."""
    patch_size: int = 8
    """Side of a square patch in pixels; must divide ``image_size``."""
    channels: int = 3
    """Image channels."""
    d_model: int = 64
    """Transformer width."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads; must divide ``d_model``."""
    mlp_ratio: float = 4.0
    """MLP hidden width / ``d_model``."""
    max_instruction_len: int = 32
    """Longest instruction in tokens (obs["instruction"] is int32[B, <=this])."""
    proprio_dim: int = 8
    """Proprioceptive state size (obs["proprio"] is float32[B, P]); 0 = no token."""
    action_head: ActionHead = "discrete_bins"
    """``"discrete_bins"``, ``"gaussian"`` or ``"categorical"``."""
    action_dim: int = 7
    """Continuous action dimensions D (bins and Gaussian heads)."""
    num_bins: int = 256
    """Bins per action dimension (bins head)."""
    action_low: float = -1.0
    """Lower bound of every action dimension (bins head; Gaussian ``to_env_action``)."""
    action_high: float = 1.0
    """Upper bound of every action dimension."""
    num_actions: int = 2
    """Number of discrete actions (categorical head)."""
    init_log_std: float = -0.5
    """Initial log standard deviation (Gaussian head)."""
    dropout: float = 0.0
    """Dropout on the residual branches (0 for RL: log-probs must be reproducible)."""
    instruction_tokens: InstructionTokens = "bytes"
    """``"bytes"`` (one token per byte) or ``"words"`` (one per word)."""
    film: bool = False
    """FiLM-condition the patch embeddings (and the keypoint stem) on the instruction."""
    keypoints: int = 0
    """Spatial-softmax keypoints of the conv stem's one extra token (0: no stem)."""
    stem_channels: int = 16
    """Width of the keypoint conv stem."""
    value_hidden: int = 0
    """Hidden units of an MLP value head on the CLS state (0: a linear head)."""
    detach_value: bool = False
    """The value head reads the trunk's features without sending gradients into the trunk, so
    the critic's loss cannot move the features the actor uses (RL from a pretrained trunk)."""

    def __post_init__(self) -> None:
        checks = {
            "image_size must be divisible by patch_size": self.image_size % self.patch_size == 0,
            "d_model must be divisible by num_heads": self.d_model % self.num_heads == 0,
            "action_head must be discrete_bins, gaussian or categorical": self.action_head
            in ("discrete_bins", "gaussian", "categorical"),
            "num_bins must be >= 2": self.num_bins >= 2,
            "num_actions must be >= 1": self.num_actions >= 1,
            "action_low must be < action_high": self.action_low < self.action_high,
            "num_layers, action_dim, max_instruction_len must be >= 1": min(
                self.num_layers, self.action_dim, self.max_instruction_len
            )
            >= 1,
            "proprio_dim, keypoints must be >= 0": min(self.proprio_dim, self.keypoints) >= 0,
            "stem_channels must be >= 1": self.stem_channels >= 1,
            "value_hidden must be >= 0": self.value_hidden >= 0,
            "dropout must be in [0, 1)": 0.0 <= self.dropout < 1.0,
            "instruction_tokens must be bytes or words": self.instruction_tokens
            in ("bytes", "words"),
        }
        failed = [msg for msg, ok in checks.items() if not ok]
        if failed:
            raise ValueError(f"invalid VLAConfig: {'; '.join(failed)}")

    @property
    def num_patches(self) -> int:
        """Image tokens per sample: ``(image_size / patch_size) ** 2``."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_fixed_tokens(self) -> int:
        """Tokens every sample has before its instruction: CLS, proprio (if any), keypoints (if
        any), patches."""
        return 1 + (self.proprio_dim > 0) + (self.keypoints > 0) + self.num_patches

    def instruction_token_counts(self, instructions: np.ndarray) -> np.ndarray:
        """Instruction tokens of each sample, from its byte tokens int[N, L]: int64[N]."""
        return instruction_token_counts(instructions, self.instruction_tokens)
