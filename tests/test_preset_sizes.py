"""The size presets of rlvla3/policy/presets.py: the real-size preset's shape and parameter count
(built on the meta device: no weights), and images of another size than the preset's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rlvla3.policy import presets  # noqa: E402


@pytest.mark.parametrize("family", sorted(presets.FAMILIES))
def test_the_half_billion_preset_is_over_half_a_billion_parameters(family: str) -> None:
    assert presets.parse_preset(f"{family}-0.5b", "policy.token_vla.preset") == (family, "0.5b")
    with torch.device("meta"):
        model, processor = presets.FAMILIES[family](presets.VOCAB_SIZE, presets.SIZES["0.5b"])
    count = sum(p.numel() for p in model.parameters())
    assert count == {"llava": 558_056_448, "idefics3": 560_148_480}[family]  # the docstring's
    vision = model.config.vision_config
    assert (vision.image_size, vision.patch_size, vision.intermediate_size) == (224, 14, 4096)
    text = model.config.get_text_config()
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size) == (1024, 24, 4096)
    assert text.max_position_embeddings >= 256 + 256  # the image's tokens and the text's
    if family == "llava":
        crop = processor.image_processor.crop_size
        assert (crop.height, crop.width, processor.patch_size) == (224, 224, 14)
    else:  # 16 x 16 patches, pixel-shuffled 2 x 2
        assert processor.image_seq_len == 64


@pytest.mark.parametrize("family", sorted(presets.FAMILIES))
def test_a_preset_processor_resizes_images_of_another_size(tmp_path, family: str) -> None:
    from transformers import AutoProcessor

    presets.write_vlm(tmp_path, family, "test")
    processor = AutoProcessor.from_pretrained(tmp_path, local_files_only=True)
    prompt = [processor.image_token + "push"]
    shapes = set()
    for side in (presets.IMAGE_SIZE, 2 * presets.IMAGE_SIZE, 20):
        image = np.random.default_rng(side).integers(0, 256, (side, side, 3), np.uint8)
        batch = processor(images=[[image]], text=prompt, return_tensors="pt")
        shapes.add((tuple(batch["pixel_values"].shape), tuple(batch["input_ids"].shape)))
    assert len(shapes) == 1  # every size becomes the preset's own: the same pixels and tokens
    ((pixels, _),) = shapes
    assert pixels[-2:] == (presets.IMAGE_SIZE, presets.IMAGE_SIZE)
