"""``DeviceInputs``: the processor's model inputs with the pixels normalised in torch and each
prompt's tokens cached, taken only where a probe shows they are the processor's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from gymnasium import spaces  # noqa: E402

from rlvla3.policy import device_inputs as shortcut_module  # noqa: E402
from rlvla3.policy.device_inputs import PIXELS, PROBE_ATOL, DeviceInputs  # noqa: E402
from rlvla3.policy.hf_model import load_vlm, processor_inputs  # noqa: E402
from tests.test_token_vla import make_policy, observations, tabletop_spaces  # noqa: E402
from tests.tiny_vlms import FAMILIES, IMAGE_SIZE, write_tiny_vlm  # noqa: E402


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


def test_its_inputs_are_the_processors_for_new_images_and_prompts(model_dir) -> None:
    vlm = load_vlm(str(model_dir), torch.float32)
    shortcut, why_not = DeviceInputs.probe(
        vlm.processor, vlm.image_token, (IMAGE_SIZE, IMAGE_SIZE, 3)
    )
    assert shortcut is not None, why_not
    rng = np.random.default_rng(7)
    token = vlm.image_token
    for prompts in (
        [f"{token}pick the cube\n", f"{token}state -0.12 0.50\n", f"{token}x", f"{token}go\n"],
        [f"{token}a much longer instruction than any seen at the probe, twice over\n"] * 2,
    ):
        images = rng.integers(0, 256, (len(prompts), IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
        theirs = processor_inputs(vlm.processor, images, prompts)
        ours = shortcut(torch.from_numpy(images), prompts)
        assert set(ours) == set(theirs)
        for key, value in theirs.items():
            assert ours[key].shape == value.shape and ours[key].dtype == value.dtype, key
            if key == PIXELS:
                assert (ours[key] - value).abs().max() <= PROBE_ATOL
            else:
                assert torch.equal(ours[key], value), key


def test_the_policy_acts_and_evaluates_as_with_the_processor(model_dir) -> None:
    policy = make_policy(model_dir, prompt="{instruction}{state}\n")
    assert policy.device_inputs is not None
    obs = observations(6)
    fast = policy.act(obs, deterministic=True)
    fast_eval = policy.evaluate(obs, fast.action)
    policy.device_inputs = None  # every batch through the processor
    slow = policy.act(obs, deterministic=True)
    assert torch.equal(fast.action, slow.action)
    torch.testing.assert_close(fast.log_prob, slow.log_prob, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.value, slow.value, atol=1e-5, rtol=0)
    slow_eval = policy.evaluate(obs, fast.action)
    torch.testing.assert_close(fast_eval.log_prob, slow_eval.log_prob, atol=1e-5, rtol=0)
    # numpy observations (SFT's datasets) take the same path
    as_numpy = policy.act({k: v.numpy() for k, v in obs.items()}, deterministic=True)
    assert torch.equal(as_numpy.action, slow.action)


def test_a_processor_that_resizes_keeps_the_processor_and_says_why(model_dir) -> None:
    """An env image of another size than the processor's: its pixel_values are resized, not
    the image's pixels; the policy still acts, through the processor."""
    vlm = load_vlm(str(model_dir), torch.float32)
    shortcut, why_not = DeviceInputs.probe(vlm.processor, vlm.image_token, (48, 48, 3))
    assert shortcut is None and "pixel_values" in why_not
    env = tabletop_spaces()
    observation = dict(env.observation.spaces)
    observation["image"] = spaces.Box(0, 255, (48, 48, 3), np.uint8)
    policy = make_policy(model_dir, {"observation": spaces.Dict(observation)})
    assert policy.device_inputs is None
    obs = observations(3)
    obs["image"] = torch.randint(0, 256, (3, 48, 48, 3), dtype=torch.uint8)
    out = policy.act(obs, deterministic=True)
    torch.testing.assert_close(
        policy.evaluate(obs, out.action).log_prob, out.log_prob, atol=1e-4, rtol=0
    )


def test_a_processor_that_does_not_normalise_keeps_the_processor(model_dir) -> None:
    vlm = load_vlm(str(model_dir), torch.float32)
    vlm.processor.image_processor.do_normalize = False
    shortcut, why_not = DeviceInputs.probe(
        vlm.processor, vlm.image_token, (IMAGE_SIZE, IMAGE_SIZE, 3)
    )
    assert shortcut is None and "normalise" in why_not


def test_the_prompt_cache_keeps_the_most_recent_prompts(model_dir, monkeypatch) -> None:
    monkeypatch.setattr(shortcut_module, "MAX_PROMPTS", 2)
    vlm = load_vlm(str(model_dir), torch.float32)
    shortcut, _ = DeviceInputs.probe(vlm.processor, vlm.image_token, (IMAGE_SIZE, IMAGE_SIZE, 3))
    token = vlm.image_token
    prompts = [f"{token}one\n", f"{token}two\n", f"{token}three\n", f"{token}two\n"]
    images = np.random.default_rng(0).integers(0, 256, (4, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    ours = shortcut(torch.from_numpy(images), prompts)
    assert list(shortcut.prompts) == [f"{token}three\n", f"{token}two\n"]
    theirs = processor_inputs(vlm.processor, images, prompts)
    assert torch.equal(ours["input_ids"], theirs["input_ids"])


def test_images_of_another_size_than_probed_go_through_the_processor(model_dir) -> None:
    """Demos recorded at another image size than the env's: the processor resizes them, as
    it would without the shortcut, which refuses them itself."""
    policy = make_policy(model_dir)
    assert policy.device_inputs is not None
    obs = observations(3)
    obs["image"] = torch.randint(0, 256, (3, 2 * IMAGE_SIZE, 2 * IMAGE_SIZE, 3), dtype=torch.uint8)
    assert not policy.device_inputs.fits(obs["image"])
    fast = policy.act(obs, deterministic=True)
    policy.device_inputs = None
    slow = policy.act(obs, deterministic=True)
    assert torch.equal(fast.action, slow.action)
    torch.testing.assert_close(fast.log_prob, slow.log_prob, atol=0, rtol=0)
    vlm = load_vlm(str(model_dir), torch.float32)
    shortcut, _ = DeviceInputs.probe(vlm.processor, vlm.image_token, (IMAGE_SIZE, IMAGE_SIZE, 3))
    with pytest.raises(ValueError, match="policy.token_vla.observation.image"):
        shortcut(obs["image"], [f"{vlm.image_token}go\n"] * 3)
