"""The dihedral symmetry augmentation of SFT frames (sft/symmetry.py)."""

from __future__ import annotations

import numpy as np
import pytest

from rlvla3.config.run_config import config_from_dict
from rlvla3.config.sections import SymmetryConfig
from rlvla3.config.typed_load import ConfigError
from roles.sft_trainer import planar_symmetry
from sft.symmetry import NUM_ELEMENTS, augment, transform_image, transform_pairs
from sim.envs import make_env
from sim.experts import TableTopExpert

TABLETOP = planar_symmetry(SymmetryConfig(kind="dihedral"))


def _mirrored(env, element: int):
    """Put the scene under ``element``; returns a function that puts it back."""
    saved = (env._pusher.copy(), env._blocks.copy(), env._targets.copy(), env._vel.copy())
    env._pusher = transform_pairs(env._pusher, [(0, 1)], element)
    env._blocks = transform_pairs(env._blocks, [(0, 1)], element)
    env._targets = transform_pairs(env._targets, [(0, 1)], element)
    env._vel = transform_pairs(env._vel, [(0, 1)], element)
    env._background = None

    def restore() -> None:
        env._pusher, env._blocks, env._targets, env._vel = saved
        env._background = None

    return restore


@pytest.mark.parametrize("env_id", ["rlvla3/TableTopEasy-v0", "rlvla3/TableTop-v0"])
@pytest.mark.parametrize("element", range(NUM_ELEMENTS))
def test_the_tabletop_scene_under_an_element_renders_and_acts_as_the_transformed_frame(
    element, env_id
) -> None:
    """The simulator's own rendering and expert of the rotated/reflected scene equal the
    augmented image, proprio and action, pixel for pixel."""
    env = make_env(env_id, seed=0, image_size=32)
    expert = TableTopExpert()
    rng = np.random.default_rng(element)
    for seed in range(10):
        env.reset(seed=seed)
        for _ in range(2):
            obs, *_ = env.step(rng.uniform(-1, 1, 2))
        action = expert.act(env.privileged_state())
        restore = _mirrored(env, element)
        try:
            mirrored_obs = env._observe()
            mirrored_action = expert.act(env.privileged_state())
        finally:
            restore()
        np.testing.assert_array_equal(transform_image(obs["image"], element), mirrored_obs["image"])
        np.testing.assert_allclose(
            transform_pairs(obs["proprio"], [(0, 1), (2, 3)], element), mirrored_obs["proprio"]
        )
        np.testing.assert_allclose(transform_pairs(action, [(0, 1)], element), mirrored_action)


def test_the_eight_elements_are_distinct_and_element_0_is_the_identity() -> None:
    image = np.random.default_rng(0).integers(0, 255, (6, 6, 3), dtype=np.uint8)
    images = {transform_image(image, e).tobytes() for e in range(NUM_ELEMENTS)}
    assert len(images) == NUM_ELEMENTS
    np.testing.assert_array_equal(transform_image(image, 0), image)
    vectors = {tuple(transform_pairs(np.array([1.0, 2.0]), [(0, 1)], e)) for e in range(8)}
    assert len(vectors) == NUM_ELEMENTS


def test_augment_moves_each_frames_image_proprio_and_action_together() -> None:
    rng = np.random.default_rng(1)
    n = 64
    obs = {
        "image": rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8),
        "proprio": rng.normal(size=(n, 4)).astype(np.float32),
        "instruction": rng.integers(0, 50, (n, 5)).astype(np.int32),
    }
    actions = rng.normal(size=(n, 2)).astype(np.float32)
    before = {k: v.copy() for k, v in obs.items()}, actions.copy()
    out_obs, out_actions = augment(obs, actions, TABLETOP, rng)
    for key, value in before[0].items():  # inputs untouched
        np.testing.assert_array_equal(obs[key], value)
    np.testing.assert_array_equal(actions, before[1])
    np.testing.assert_array_equal(out_obs["instruction"], obs["instruction"])
    used = []
    for i in range(n):
        matches = [
            e
            for e in range(NUM_ELEMENTS)
            if np.array_equal(transform_image(obs["image"][i], e), out_obs["image"][i])
        ]
        assert len(matches) == 1
        e = matches[0]
        used.append(e)
        np.testing.assert_allclose(
            transform_pairs(obs["proprio"][i], [(0, 1), (2, 3)], e), out_obs["proprio"][i]
        )
        np.testing.assert_allclose(transform_pairs(actions[i], [(0, 1)], e), out_actions[i])
    assert len(set(used)) == NUM_ELEMENTS  # 64 frames draw every element


def test_augment_names_what_the_frames_lack() -> None:
    rng = np.random.default_rng(0)
    obs = {"image": np.zeros((2, 8, 8, 3), np.uint8), "proprio": np.zeros((2, 4), np.float32)}
    actions = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="sft.symmetry.obs_pairs.proprio"):
        augment({"image": obs["image"]}, actions, TABLETOP, rng)
    with pytest.raises(ValueError, match="sft.symmetry.image_key: 'image' is not"):
        augment({"proprio": obs["proprio"]}, actions, TABLETOP, rng)
    with pytest.raises(ValueError, match="square"):
        augment({**obs, "image": np.zeros((2, 8, 6, 3), np.uint8)}, actions, TABLETOP, rng)
    with pytest.raises(ValueError, match="action_pairs"):
        augment(obs, np.zeros((2, 1), np.float32), TABLETOP, rng)


def test_a_bad_symmetry_pair_is_a_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="sft.symmetry: obs_pairs.proprio: "):
        config_from_dict(
            {"sft": {"symmetry": {"kind": "dihedral", "obs_pairs": {"proprio": [[0]]}}}}
        )
    with pytest.raises(ConfigError, match="sft.symmetry: action_pairs: .* more than once"):
        config_from_dict({"sft": {"symmetry": {"action_pairs": [[0, 1], [1, 2]]}}})
    with pytest.raises(ConfigError, match="sft.symmetry.kind"):
        config_from_dict({"sft": {"symmetry": {"kind": "rot90"}}})
