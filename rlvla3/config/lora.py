"""``LoraConfig``, the type of ``policy.lora``: low-rank adapters (LoRA, via peft) on the policy.

With ``rank`` > 0 every role builds the policy with adapters on ``target_modules``
(``rlvla3/policy/lora.py``); the trainers train the adapters and the policy's heads only, the
weight sync ships only those tensors, and checkpoints hold only those (``rlvla3 export`` merges
them into a plain checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlvla3.config.typed_load import bounded, to_dict


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters on the policy (off unless ``rank`` > 0). docs/models.md, LoRA."""

    rank: int = bounded(0, ge=0)
    """Rank of each adapter (0: no LoRA, every parameter trains)."""
    alpha: float | None = bounded(None, gt=0)
    """LoRA's scale numerator: an adapter adds ``alpha / rank`` times its product (null: ``rank``, a scale of 1)."""
    dropout: float = bounded(0.0, ge=0, le=1)
    """Dropout on each adapter's input while training (rollout servers act in eval mode, without it)."""
    target_modules: list[str] = field(default_factory=list)
    """Module names (or name endings, as peft matches them: ``qkv``, ``q_proj``, ``mlp.0``) to adapt; Linear, Conv and Embedding modules outside the heads. Empty: every Linear outside the heads."""

    @property
    def enabled(self) -> bool:
        """Whether the policy carries adapters."""
        return self.rank > 0

    @property
    def scale_alpha(self) -> float:
        """``alpha``, or ``rank`` when left null."""
        return float(self.rank if self.alpha is None else self.alpha)


def checkpoint_record(lora: LoraConfig, base: str | None) -> dict[str, Any]:
    """What a LoRA run's checkpoint records beside its tensors (key ``lora``), so that the
    whole model can be rebuilt from it (``rlvla3.policy.lora.load_init_weights``, ``rlvla3
    export``): its ``policy.lora`` section and the base checkpoint under the adapters (None:
    the policy's own initial weights, as a pretrained model loads them from its folder, or
    drawn from ``run.seed``)."""
    return {"config": to_dict(lora), "base": str(Path(base).resolve()) if base else None}
