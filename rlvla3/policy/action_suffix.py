"""A padded batch of prompts with each row's action tokens appended right after its prompt:
what a teacher-forced forward over prompt + actions takes (``TokenVLAPolicy._score``).

A shorter row's action tokens land inside its padding, so every column an action token takes
gets the action token's values, not the padding's. Per-image inputs (``pixel_values``,
Qwen2-VL's ``image_grid_thw`` [B, 3]) pass unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor


def append_action_tokens(
    inputs: dict[str, Tensor],
    lengths: Tensor,
    action_ids: Tensor,
    *,
    pad_id: int,
    suffix_token_type: int,
) -> dict[str, Tensor]:
    """``inputs`` (a processor's right-padded batch, prompts of ``lengths`` tokens) with the
    vocabulary ids ``action_ids`` int64[B, k] after each row's prompt. Per-token inputs grow
    by k columns: ``input_ids`` get the action ids, ``attention_mask`` 1, ``token_type_ids``
    ``suffix_token_type`` (PaliGemma's suffix), any other integer one 0; one with more dims
    than the token's (Mllama's ``cross_attention_mask`` [B, L, images, tiles]) gives each
    action token its row's last prompt token's values."""
    b, k = action_ids.shape
    if not k:
        return dict(inputs)
    columns = lengths[:, None] + torch.arange(k, device=lengths.device)
    values = {"input_ids": action_ids, "attention_mask": 1, "token_type_ids": suffix_token_type}
    per_token = inputs["input_ids"].shape
    extended = {}
    for key, value in inputs.items():
        if value.shape[:2] == per_token and not value.is_floating_point():
            if value.dim() == 2:
                pad = pad_id if key == "input_ids" else 0
                value = torch.cat([value, value.new_full((b, k), pad)], dim=1)
                value = value.scatter(1, columns, values.get(key, 0))
            else:
                value = _as_last_prompt_token(value, lengths, columns)
        extended[key] = value
    return extended


def _as_last_prompt_token(value: Tensor, lengths: Tensor, columns: Tensor) -> Tensor:
    """A per-token input of more dims, extended at ``columns`` [B, k] by copies of each row's
    last prompt token's values (an action token attends to the images as that token does)."""
    b, k = columns.shape
    rows = torch.arange(b, device=value.device)
    last = value[rows, lengths - 1]  # [B, ...]
    value = torch.cat([value, value.new_zeros((b, k, *value.shape[2:]))], dim=1)
    value[rows[:, None], columns] = last[:, None].expand(b, k, *last.shape[1:])
    return value
