"""Image augmentation for supervised training on few demonstrations.

A policy cloned from tens of demonstrations memorises where things sit in each frame; shifting
every training image by a few random pixels (edge-padded, then cropped back to its size) makes
it read relative positions instead. The same augmentation as DrQ / RAD's random shift.
"""

from __future__ import annotations

import numpy as np


def random_shift(images: np.ndarray, pad: int, rng: np.random.Generator) -> np.ndarray:
    """``images`` [N, H, W, C] each shifted by its own random offset in ``[-pad, pad]`` pixels
    per axis; the border repeats the edge pixels. ``pad`` 0 returns ``images`` unchanged."""
    if pad == 0:
        return images
    if images.ndim != 4:
        raise ValueError(f"images: shape {list(images.shape)}, expected [N, H, W, C]")
    n, h, w, _ = images.shape
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="edge")
    rows = rng.integers(0, 2 * pad + 1, n)[:, None] + np.arange(h)  # [N, H]
    cols = rng.integers(0, 2 * pad + 1, n)[:, None] + np.arange(w)  # [N, W]
    return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
