"""Symmetry augmentation of demonstration frames for top-down planar tasks.

A task seen from above whose table, dynamics and spawns look the same after a rotation by a
multiple of 90 degrees or a reflection (the dihedral group of the square, 8 elements) gives
eight demonstrations for each one recorded: rotate or reflect the image, and the same to every
``(x, y)`` pair of the proprio vector and of the action. The built-in table-top task has that
symmetry (a square table centred at 0, spawns drawn symmetrically, per-axis speed limits); a
scene with gravity, text or a fixed camera angle does not.

An element is three flags applied in order: swap x and y, negate x, negate y. Images are
``[..., H, W, C]`` with row 0 at the top (y = +1) and column 0 at the left (x = -1), H = W.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

NUM_ELEMENTS = 8


@dataclass(frozen=True, slots=True)
class PlanarSymmetry:
    """Where the planar quantities of a frame are.

    Attributes:
        image_key: observation key of the top-down image.
        obs_pairs: observation key -> index pairs ``(x, y)`` in its last axis (positions and
            velocities alike: both transform as vectors).
        action_pairs: index pairs ``(x, y)`` in the action's last axis.
    """

    image_key: str
    obs_pairs: Mapping[str, Sequence[Sequence[int]]]
    action_pairs: Sequence[Sequence[int]]


def element_flags(element: int) -> tuple[bool, bool, bool]:
    """``(swap, negate_x, negate_y)`` of dihedral element ``element`` in ``[0, 8)``."""
    if not 0 <= element < NUM_ELEMENTS:
        raise ValueError(f"dihedral element must be in [0, {NUM_ELEMENTS}), got {element}")
    return bool(element & 4), bool(element & 1), bool(element & 2)


def transform_image(image: np.ndarray, element: int) -> np.ndarray:
    """``image`` (``[..., H, W, C]``, H = W) under ``element``."""
    swap, neg_x, neg_y = element_flags(element)
    out = image
    if swap:
        # (x, y) -> (y, x): pixel (row, col) comes from (S-1-col, S-1-row).
        out = np.swapaxes(out[..., ::-1, ::-1, :], -3, -2)
    if neg_x:
        out = out[..., :, ::-1, :]
    if neg_y:
        out = out[..., ::-1, :, :]
    return np.ascontiguousarray(out)


def transform_pairs(values: np.ndarray, pairs: Sequence[Sequence[int]], element: int) -> np.ndarray:
    """A copy of ``values`` with each ``(x, y)`` index pair of its last axis under ``element``."""
    swap, neg_x, neg_y = element_flags(element)
    out = np.array(values, copy=True)
    for ix, iy in pairs:
        x, y = values[..., ix], values[..., iy]
        if swap:
            x, y = y, x
        out[..., ix] = -x if neg_x else x
        out[..., iy] = -y if neg_y else y
    return out


def check(obs: Mapping[str, np.ndarray], actions: np.ndarray, symmetry: PlanarSymmetry) -> None:
    """Raise ValueError, naming the field, when ``symmetry`` does not fit this batch."""
    if symmetry.image_key not in obs:
        raise ValueError(
            f"sft.symmetry.image_key: {symmetry.image_key!r} is not an observation key of the "
            f"frames ({sorted(obs)})"
        )
    for key in symmetry.obs_pairs:
        if key not in obs:
            raise ValueError(
                f"sft.symmetry.obs_pairs.{key}: {key!r} is not an observation key of the frames "
                f"({sorted(obs)})"
            )
    image = obs[symmetry.image_key]
    if image.ndim < 3 or image.shape[-3] != image.shape[-2]:
        raise ValueError(
            f"sft.symmetry.image_key {symmetry.image_key!r}: needs square [H, W, C] images, "
            f"got shape {image.shape[1:]}"
        )
    named = [(f"obs_pairs.{k}", obs[k], p) for k, p in symmetry.obs_pairs.items()]
    for where, values, pairs in [*named, ("action_pairs", actions, symmetry.action_pairs)]:
        width = values.shape[-1]
        if any(not 0 <= i < width for pair in pairs for i in pair):
            raise ValueError(f"sft.symmetry.{where}: {pairs!r} out of range for width {width}")


def augment(
    obs: Mapping[str, np.ndarray],
    actions: np.ndarray,
    symmetry: PlanarSymmetry,
    rng: np.random.Generator,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Each frame of a batch under its own random element; the inputs are left unchanged.

    Raises:
        ValueError: naming a key or index of ``symmetry`` that the batch lacks.
    """
    check(obs, actions, symmetry)
    elements = rng.integers(NUM_ELEMENTS, size=len(actions))
    image_key = symmetry.image_key
    # Only the arrays that change are copied; the rest (instructions) are shared, read-only.
    out_obs = dict(obs)
    for key in (image_key, *symmetry.obs_pairs):
        out_obs[key] = np.array(obs[key], copy=True)
    out_actions = np.array(actions, copy=True)
    for element in range(1, NUM_ELEMENTS):  # element 0 is the identity
        rows = np.flatnonzero(elements == element)
        if rows.size == 0:
            continue
        out_obs[image_key][rows] = transform_image(obs[image_key][rows], element)
        for key, pairs in symmetry.obs_pairs.items():
            out_obs[key][rows] = transform_pairs(obs[key][rows], pairs, element)
        out_actions[rows] = transform_pairs(actions[rows], symmetry.action_pairs, element)
    return out_obs, out_actions
