"""Packed (padding-free) evaluation of a token VLA (rlvla3/policy/token_vla_packing.py) on the
tiny LLaVA and Idefics3 checkpoints: per frame the padded evaluate's figures, frames isolated
from each other in a row, and the families that cannot pack refused with their reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rlvla3.policy.token_vla_packing import (  # noqa: E402
    PackedEvaluator,
    pack_frames,
    packing_unsupported,
)
from tests.test_token_vla import FAMILIES, make_policy, observations  # noqa: E402
from tests.tiny_vlms import write_tiny_vlm  # noqa: E402

FRAMES = 6


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


def _actions(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 16, (n, 2), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("row_tokens", [None, 300])
def test_packed_evaluate_gives_each_frame_the_padded_figures(model_dir, row_tokens) -> None:
    policy = make_policy(model_dir).eval()
    obs, action = observations(FRAMES), _actions(FRAMES)
    packed = PackedEvaluator(policy, 4096)
    packed.row_tokens = row_tokens  # None: one row; 300: several rows, each with a tail
    with torch.no_grad():
        padded, got = policy.evaluate(obs, action), packed(obs, action)
    _, lengths = policy._prompt_inputs(obs)
    assert len(set(lengths.tolist())) > 2  # prompts of different lengths
    rows = packed.last.inputs["input_ids"].shape[0]
    assert rows == 1 if row_tokens is None else rows > 1
    assert packed.last.real_tokens == int(lengths.sum()) + FRAMES * 2
    for name in ("log_prob", "entropy", "value"):
        torch.testing.assert_close(getattr(got, name), getattr(padded, name), atol=1e-4, rtol=0)


def test_a_frame_never_attends_to_another_in_its_row(model_dir) -> None:
    policy = make_policy(model_dir).eval()
    obs, action = observations(FRAMES), _actions(FRAMES)
    packed = PackedEvaluator(policy, 4096)
    with torch.no_grad():
        before = packed(obs, action).log_prob
        first = int(torch.argmin(packed.last.last_prompt))  # the row's first frame
        changed = {k: v.clone() for k, v in obs.items()}
        changed["image"][first] = 255 - changed["image"][first]
        changed["proprio"][first] += 1.0
        after = packed(changed, action).log_prob
    assert packed.last.inputs["input_ids"].shape[0] == 1  # all frames in one row
    others = torch.arange(FRAMES) != first
    assert not torch.allclose(after[first], before[first], atol=1e-4)  # the change is seen
    torch.testing.assert_close(after[others], before[others], atol=1e-5, rtol=0)


def test_packed_evaluate_trains(model_dir) -> None:
    policy = make_policy(model_dir).train()
    loss = -PackedEvaluator(policy, 4096)(observations(3), _actions(3)).log_prob.mean()
    loss.backward()
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def _qwen2_vl():
    import transformers as tf

    text = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 300,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]},
    }
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2}
    config = tf.Qwen2VLConfig(text_config=text, vision_config=vision)
    return tf.Qwen2VLForConditionalGeneration(config)


def _paligemma():
    import transformers as tf

    text = {
        "model_type": "gemma",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": 300,
        "head_dim": 16,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "image_size": 32,
        "patch_size": 8,
    }
    config = tf.PaliGemmaConfig(text_config=text, vision_config=vision, projection_dim=32)
    return tf.PaliGemmaForConditionalGeneration(config)


@pytest.mark.parametrize(
    ("build", "reason"),
    [(_qwen2_vl, "rotary positions are multimodal"), (_paligemma, "token_type_ids")],
)
def test_families_that_cannot_pack_say_why(build, reason) -> None:
    assert reason in packing_unsupported(build())


def test_the_tested_families_pack_and_flash_attention_takes_one_row(model_dir) -> None:
    policy = make_policy(model_dir)
    assert packing_unsupported(policy.model) is None
    assert PackedEvaluator(policy, 512).row_tokens == 512
    policy.model.config._attn_implementation = "flash_attention_2"  # varlen: batches of one row
    assert PackedEvaluator(policy, 512).row_tokens is None


def test_an_input_neither_per_token_nor_per_image_is_named() -> None:
    inputs = {"input_ids": torch.ones(2, 5, dtype=torch.int64), "image_grid": torch.ones(7, 3)}
    with pytest.raises(ValueError, match="'image_grid' \\(7, 3\\) is neither per token"):
        pack_frames(
            inputs,
            torch.tensor([5, 3]),
            torch.zeros(2, 1, dtype=torch.int64),
            row_tokens=None,
            pad_id=0,
        )
