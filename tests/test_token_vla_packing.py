"""Packed (padding-free) evaluation of a token VLA (rlvla3/policy/token_vla_packing.py) on the
tiny LLaVA and Idefics3 checkpoints: per frame the padded evaluate's figures, frames isolated
from each other in a row, and the families that cannot pack refused with their reason."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from gymnasium import spaces

pytest.importorskip("transformers")

from rlvla3.config.token_vla import ObservationMapping  # noqa: E402
from rlvla3.config.typed_load import ConfigError  # noqa: E402
from rlvla3.policy.hf_varlen import VARLEN_ATTENTION  # noqa: E402
from rlvla3.policy.token_vla_packing import (  # noqa: E402
    PackedEvaluator,
    pack_frames,
    packing_unsupported,
)
from tests.test_token_vla import (  # noqa: E402
    FAMILIES,
    make_policy,
    observations,
    projected_policy,
    tabletop_spaces,
)
from tests.tiny_vlms import write_tiny_vlm  # noqa: E402

FRAMES = 6


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


def _actions(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 16, (n, 2), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "mask"])
def test_packed_evaluate_gives_each_frame_the_padded_figures(model_dir, varlen) -> None:
    policy = make_policy(model_dir).eval()
    obs, action = observations(FRAMES), _actions(FRAMES)
    with torch.no_grad():
        padded = policy.evaluate(obs, action)
        # varlen: one row, frames bounded by cu_seqlens; mask: rows of 300 tokens with tails
        packed = PackedEvaluator(policy, 300, varlen=varlen)
        got = packed(obs, action)
    _, lengths = policy._prompt_inputs(obs)
    assert len(set(lengths.tolist())) > 2  # prompts of different lengths
    rows = packed.last.inputs["input_ids"].shape[0]
    assert rows == 1 if varlen else rows > 1
    text = policy.model.config.get_text_config()
    assert (text._attn_implementation == VARLEN_ATTENTION) == varlen
    assert packed.last.real_tokens == int(lengths.sum()) + FRAMES * 2
    for name in ("log_prob", "entropy", "value"):
        torch.testing.assert_close(getattr(got, name), getattr(padded, name), atol=1e-4, rtol=0)
    with torch.no_grad():  # the padded path is unchanged beside it (the act side's)
        again = policy.evaluate(obs, action)
    torch.testing.assert_close(again.log_prob, padded.log_prob, atol=1e-5, rtol=0)


def test_packed_evaluate_of_action_chunks_gives_the_padded_figures(model_dir) -> None:
    policy = make_policy(model_dir, action_steps=3).eval()
    obs = observations(FRAMES)
    action = torch.randint(0, 16, (FRAMES, 3, 2), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        padded = policy.evaluate(obs, action)
        packed = PackedEvaluator(policy, 300)
        got = packed(obs, action)
    _, lengths = policy._prompt_inputs(obs)
    assert packed.last.real_tokens == int(lengths.sum()) + FRAMES * 3 * 2
    for name in ("log_prob", "entropy", "value"):
        torch.testing.assert_close(getattr(got, name), getattr(padded, name), atol=1e-4, rtol=0)


def test_packed_evaluate_keeps_the_temperature_and_the_critic_observation(model_dir) -> None:
    """A policy with ``temperature`` and a mapped ``observation.critic``: the packed figures
    are still the padded ones (log-probs of the tempered distribution, the critic's value)."""
    env = tabletop_spaces()
    with_state = spaces.Dict(
        dict(env.observation.spaces) | {"state": spaces.Box(-1.0, 1.0, (3,), np.float32)}
    )
    policy = make_policy(
        model_dir,
        {"observation": with_state},
        temperature=0.5,
        observation=ObservationMapping(critic="state"),
    ).eval()
    obs = observations(FRAMES) | {"state": torch.randn(FRAMES, 3)}
    action = _actions(FRAMES)
    with torch.no_grad():
        padded = policy.evaluate(obs, action)
        got = PackedEvaluator(policy, 300)(obs, action)
    for name in ("log_prob", "entropy", "value"):
        torch.testing.assert_close(getattr(got, name), getattr(padded, name), atol=1e-4, rtol=0)
    with pytest.raises(ConfigError, match="policy.token_vla.observation.critic: .*no 'state'"):
        policy.evaluate({k: v for k, v in obs.items() if k != "state"}, action)


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "mask"])
def test_packed_evaluate_adds_the_projected_state_where_the_padded_one_does(
    model_dir, varlen
) -> None:
    """``state_projector``: each packed frame's state embedding lands on its own last prompt
    token, so the packed figures and gradients are the padded ones."""
    padded = projected_policy(model_dir).train()
    packed = copy.deepcopy(padded)
    obs, action = observations(FRAMES), _actions(FRAMES)
    want = padded.evaluate(obs, action)
    got = PackedEvaluator(packed, 300, varlen=varlen)(obs, action)
    for name in ("log_prob", "entropy", "value"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-4, rtol=0)
    want.log_prob.sum().backward()
    got.log_prob.sum().backward()
    for mine, theirs in zip(
        packed.state_projector.parameters(), padded.state_projector.parameters(), strict=True
    ):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "mask"])
def test_a_frame_never_attends_to_another_in_its_row(model_dir, varlen) -> None:
    policy = make_policy(model_dir).eval()
    obs, action = observations(FRAMES), _actions(FRAMES)
    packed = PackedEvaluator(policy, 4096, varlen=varlen)
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


def test_packed_evaluate_gives_the_padded_gradients(model_dir) -> None:
    padded = make_policy(model_dir).train()
    packed = copy.deepcopy(padded)
    obs, action = observations(4), _actions(4)
    (-padded.evaluate(obs, action).log_prob.mean()).backward()
    (-PackedEvaluator(packed, 4096)(obs, action).log_prob.mean()).backward()
    grads = dict(packed.named_parameters())
    compared = 0
    for name, param in padded.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(grads[name].grad, param.grad, atol=1e-4, rtol=1e-3)
            compared += 1
    assert compared > 10


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
    text = policy.model.config.get_text_config()
    text.attention_dropout = 0.1
    assert "drops attention weights out" in packing_unsupported(policy.model)
    text.attention_dropout = 0.0
    assert PackedEvaluator(policy, 512, varlen=False).row_tokens == 512  # sdpa: masked rows
    text._attn_implementation = "flash_attention_2"  # varlen: batches of one row
    assert PackedEvaluator(policy, 512).row_tokens is None
    assert text._attn_implementation == "flash_attention_2"  # left as it is
    text._attn_implementation = "sdpa"
    assert PackedEvaluator(policy, 512).row_tokens is None
    assert text._attn_implementation == VARLEN_ATTENTION


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
