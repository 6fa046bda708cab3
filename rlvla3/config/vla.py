"""``VLAConfig``, the VLA's architecture and the type of ``policy.vla``, apart from the model so
that the run config can check it without importing torch.

The fields that describe the env (image size, action dimensions...) are null until the policy is
built: then the env's observation and action spaces decide them, unless the YAML set them
(``VLAConfig.resolved``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from sim.tokenizer import InstructionTokens, instruction_token_counts

ActionHead = Literal["discrete_bins", "gaussian", "categorical"]


def from_env(without_env: Any) -> Any:
    """A field the env's spaces decide when ``policy.vla`` leaves it out (null until then), and
    ``without_env`` when there is no env to ask (a model built directly, as the tests do)."""
    return dataclasses.field(default=None, metadata={"without_env": without_env})


@dataclass(frozen=True, slots=True, kw_only=True)
class VLAConfig:
    """Architecture of ``VLAPolicy``. Defaults are the tiny CPU test model. A field whose default
    is "from the env" follows the env's observation and action spaces when left out (null), and
    takes the value after "else" when the env has no such space."""

    image_size: int | None = from_env(64)
    """Square image side in pixels (obs["image"] is uint8[B, S, S, channels])."""
    patch_size: int = 8
    """Side of a square patch in pixels; must divide ``image_size``."""
    channels: int | None = from_env(3)
    """Image channels."""
    d_model: int = 64
    """Transformer width."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads; must divide ``d_model``."""
    mlp_ratio: float = 4.0
    """MLP hidden width / ``d_model``."""
    max_instruction_len: int | None = from_env(32)
    """Longest instruction in tokens (obs["instruction"] is int32[B, <=this])."""
    proprio_dim: int | None = from_env(8)
    """Proprioceptive state size (obs["proprio"] is float32[B, P]); 0 = no token."""
    action_head: ActionHead | None = from_env("discrete_bins")
    """``"discrete_bins"``, ``"gaussian"`` or ``"categorical"`` (from the env: ``categorical``
    for a discrete action space)."""
    action_dim: int | None = from_env(7)
    """Continuous action dimensions D (bins and Gaussian heads)."""
    num_bins: int = 256
    """Bins per action dimension (bins head)."""
    action_low: float | None = from_env(-1.0)
    """Lower bound of every action dimension (bins head; Gaussian ``to_env_action``)."""
    action_high: float | None = from_env(1.0)
    """Upper bound of every action dimension."""
    num_actions: int | None = from_env(2)
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
        failed = _problems(self)
        if failed:
            raise ValueError(f"invalid VLAConfig: {'; '.join(failed)}")

    def resolved(self, env_fields: Mapping[str, Any]) -> VLAConfig:
        """This config with every field left to the env set: from ``env_fields`` (what the env's
        spaces say, ``rlvla3.policy.factory``) where it has the field, else to its value without
        an env. Fields the YAML set stay as they are."""
        unset = {
            name: env_fields.get(name, f.metadata["without_env"])
            for name, f in _ENV_FIELDS.items()
            if getattr(self, name) is None
        }
        return dataclasses.replace(self, **unset) if unset else self

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


_ENV_FIELDS = {f.name: f for f in dataclasses.fields(VLAConfig) if "without_env" in f.metadata}


def _problems(config: VLAConfig) -> list[str]:
    """What is wrong with ``config``. A field the env decides is checked with its value without
    an env until then, except the image size: it must divide by the patch size only once known."""
    c = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    c |= {k: f.metadata["without_env"] for k, f in _ENV_FIELDS.items() if c[k] is None}
    checks = {
        "image_size must be divisible by patch_size": config.image_size is None
        or config.image_size % c["patch_size"] == 0,
        "d_model must be divisible by num_heads": c["d_model"] % c["num_heads"] == 0,
        "action_head must be discrete_bins, gaussian or categorical": c["action_head"]
        in ("discrete_bins", "gaussian", "categorical"),
        "num_bins must be >= 2": c["num_bins"] >= 2,
        "num_actions must be >= 1": c["num_actions"] >= 1,
        "action_low must be < action_high": c["action_low"] < c["action_high"],
        "num_layers, action_dim, max_instruction_len must be >= 1": min(
            c["num_layers"], c["action_dim"], c["max_instruction_len"]
        )
        >= 1,
        "proprio_dim, keypoints must be >= 0": min(c["proprio_dim"], c["keypoints"]) >= 0,
        "stem_channels must be >= 1": c["stem_channels"] >= 1,
        "value_hidden must be >= 0": c["value_hidden"] >= 0,
        "dropout must be in [0, 1)": 0.0 <= c["dropout"] < 1.0,
        "instruction_tokens must be bytes or words": c["instruction_tokens"] in ("bytes", "words"),
    }
    return [msg for msg, ok in checks.items() if not ok]
