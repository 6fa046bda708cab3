"""Random-shift augmentation of SFT images (sft/augment.py)."""

from __future__ import annotations

import numpy as np
import pytest

from sft.augment import random_shift


def _offset_of(original: np.ndarray, shifted: np.ndarray, pad: int) -> tuple[int, int] | None:
    """The (dy, dx) that turns ``original`` into ``shifted`` (edge-padded), if any."""
    padded = np.pad(original, ((pad, pad), (pad, pad), (0, 0)), mode="edge")
    h, w, _ = original.shape
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            if np.array_equal(padded[dy : dy + h, dx : dx + w], shifted):
                return dy - pad, dx - pad
    return None


def test_each_image_is_its_own_edge_padded_shift_within_the_pad() -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 12, 10, 3), dtype=np.uint8)  # distinct pixels: one offset
    shifted = random_shift(images, 2, rng)
    assert shifted.shape == images.shape and shifted.dtype == np.uint8
    offsets = [_offset_of(a, b, 2) for a, b in zip(images, shifted, strict=True)]
    assert None not in offsets
    assert len(set(offsets)) > 10  # per image, not one offset for the batch
    assert {dy for dy, _ in offsets} == {-2, -1, 0, 1, 2}
    assert (images == random_shift(images, 0, rng)).all()  # pad 0: off


def test_a_single_image_without_a_batch_axis_is_refused() -> None:
    with pytest.raises(ValueError, match=r"images: shape \[8, 8, 3\]"):
        random_shift(np.zeros((8, 8, 3), np.uint8), 1, np.random.default_rng(0))
