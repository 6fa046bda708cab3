"""The token-VLA policy on image-text-to-text families that ``rlvla3`` names nowhere
(tests/tiny_vlm_families.py: PaliGemma, Gemma 3, LLaVA-NeXT, LLaVA-OneVision, Idefics2, SmolVLM,
InternVL, Aya Vision, Qwen2-VL, Qwen2.5-VL, and Mistral 3 where torchvision is installed),
each a tiny random-weight checkpoint with its own processor: load, act (batched, greedy and
sampled, prompts of different lengths), act's log-probs equal to evaluate's, one PPO update,
LoRA adapters, and SFT's packed evaluation (or the reason a family cannot pack)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

from rlvla3.config.lora import LoraConfig  # noqa: E402
from rlvla3.config.token_vla import TokenVLAConfig  # noqa: E402
from rlvla3.config.typed_load import ConfigError  # noqa: E402
from rlvla3.policy.action_tokens import action_bins  # noqa: E402
from rlvla3.policy.device_inputs import DeviceInputs  # noqa: E402
from rlvla3.policy.hf_model import wrap_vlm  # noqa: E402
from rlvla3.policy.lora import apply_lora  # noqa: E402
from rlvla3.policy.token_vla import TokenVLAPolicy  # noqa: E402
from rlvla3.policy.token_vla_packing import (  # noqa: E402
    PackedEvaluator,
    packing_unsupported,
    sliding_window,
)
from tests.test_token_vla import (  # noqa: E402
    make_policy,
    observations,
    ppo_update,
    tabletop_spaces,
)
from tests.tiny_vlm_families import (  # noqa: E402
    FAMILY_BUILDERS,
    TORCHVISION_FAMILIES,
    VIDEO_FAMILIES,
    build_family,
    write_family,
)

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


@pytest.fixture(scope="module", params=sorted(FAMILY_BUILDERS))
def family(request) -> str:
    if request.param in TORCHVISION_FAMILIES and not HAS_TORCHVISION:
        pytest.skip(f"{request.param}'s processor is constructed only with torchvision")
    return request.param


@pytest.fixture(scope="module")
def policy_of(family, tmp_path_factory):
    """``policy_of(**token_vla fields)``: a fresh policy of ``family``, loaded from its
    directory by ``build_token_vla``, or (a family whose processor needs torchvision, without
    it) wrapped around the same model and processor in memory."""
    if family in VIDEO_FAMILIES and not HAS_TORCHVISION:

        def in_memory(**fields) -> TokenVLAPolicy:
            config = TokenVLAConfig(
                **{"path": "unused", "dtype": "float32", "bins": 16, "value_hidden": 16, **fields}
            )
            spaces = tabletop_spaces()
            bins = action_bins(spaces.action, config)
            vlm = wrap_vlm(*build_family(family))
            image_shape = spaces.observation["image"].shape
            shortcut, _ = DeviceInputs.probe(vlm.processor, vlm.image_token, image_shape)
            return TokenVLAPolicy(vlm, config, bins, device_inputs=shortcut)

        return in_memory
    directory = write_family(tmp_path_factory.mktemp(family), family)
    return lambda **fields: make_policy(directory, **fields)


def test_act_is_batched_and_its_log_probs_are_what_evaluate_recomputes(policy_of) -> None:
    policy = policy_of()
    obs = observations(5)
    _, lengths = policy._prompt_inputs(obs)
    assert len(set(lengths.tolist())) > 2  # right-padded prompts of different lengths
    torch.manual_seed(0)
    sampled, greedy = policy.act(obs), policy.act(obs, deterministic=True)
    for out in (sampled, greedy):
        assert out.action.shape == (5, 2) and ((out.action >= 0) & (out.action < 16)).all()
        assert torch.isfinite(out.log_prob).all() and (out.log_prob <= 0).all()
        again = policy.evaluate(obs, out.action)
        torch.testing.assert_close(again.log_prob, out.log_prob, atol=1e-4, rtol=0)
        torch.testing.assert_close(again.value, out.value, atol=1e-4, rtol=0)
    assert torch.equal(policy.act(obs, deterministic=True).action, greedy.action)
    for row in (1, 3):  # shorter prompts than the batch's longest: padding inside the batch
        alone = policy.act({k: v[row : row + 1] for k, v in obs.items()}, deterministic=True)
        assert torch.equal(alone.action[0], greedy.action[row])
        torch.testing.assert_close(alone.log_prob[0], greedy.log_prob[row], atol=1e-4, rtol=0)


NO_DEVICE_INPUTS = {
    **dict.fromkeys(("llava_next", "llava_onevision"), "pixel_values"),
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl"), "pixel_values"),
    "mllama": "cross_attention_mask",
}
"""Families ``DeviceInputs``' probe refuses, and what its reason names: processors that tile
the image (LLaVA-NeXT, LLaVA-OneVision) or flatten it into patches (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL), or whose per-token image mask changes with the prompt (Mllama); the processor
builds every batch."""


def test_device_inputs_are_taken_where_the_probe_allows_and_change_nothing(
    family, policy_of
) -> None:
    policy = policy_of()
    if family in NO_DEVICE_INPUTS:
        image_shape = tabletop_spaces().observation["image"].shape
        shortcut, why_not = DeviceInputs.probe(
            policy.processor, policy.prompt.image_token, image_shape
        )
        assert shortcut is None and NO_DEVICE_INPUTS[family] in why_not, why_not
        assert policy.device_inputs is None
        return
    assert policy.device_inputs is not None
    obs = observations(5)
    fast = policy.act(obs, deterministic=True)
    policy.device_inputs = None
    slow = policy.act(obs, deterministic=True)
    assert torch.equal(fast.action, slow.action)
    torch.testing.assert_close(fast.log_prob, slow.log_prob, atol=1e-5, rtol=0)


def test_one_ppo_update_changes_the_model_and_stays_finite(policy_of) -> None:
    changed = ppo_update(policy_of())
    # the language model's attention moved, not only the vision tower's
    text = [k for k in changed if "q_proj" in k and "vision" not in k and "visual" not in k]
    assert text, changed
    assert any(k.startswith("value_head.") for k in changed)


def test_lora_trains_adapters_and_the_value_head_only(policy_of) -> None:
    policy = policy_of()
    apply_lora(policy, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    trained = policy.trained_state_names()
    assert any("lora_" in n for n in trained)
    assert all("lora_" in n or n.startswith("value_head.") for n in trained)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == set(trained)
    obs = observations(3)
    out = policy.act(obs)
    again = policy.evaluate(obs, out.action)
    torch.testing.assert_close(again.log_prob, out.log_prob, atol=1e-4, rtol=0)


@pytest.mark.skipif(HAS_TORCHVISION, reason="the video processor loads with torchvision")
@pytest.mark.parametrize("family", sorted(VIDEO_FAMILIES))
def test_a_processor_that_needs_torchvision_is_one_clear_error(family, tmp_path) -> None:
    directory = write_family(tmp_path / family, family)
    with pytest.raises(
        ConfigError, match=r"policy.token_vla.path: .*processor.*(Torchvision|`torchvision`)"
    ):
        make_policy(directory)


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "mask"])
def test_packed_evaluate_gives_the_padded_figures_or_says_why_not(policy_of, varlen) -> None:
    """SFT's packed evaluation: the padded figures per frame where the family packs, and the
    reason it trains on padded batches where it does not. A sliding-window family packs
    frames no longer than its window (4,096 tokens here), and evaluates a batch with a longer
    frame (a window of 16) padded, where the window applies."""
    policy = policy_of().eval()
    reason = packing_unsupported(policy.model)
    if reason is not None:
        known = ("token_type_ids", "rotary positions are multimodal", "cross-attention")
        assert any(why in reason for why in known), reason
        return
    obs = observations(6)
    action = torch.randint(0, 16, (6, 2), generator=torch.Generator().manual_seed(1))
    text = policy.model.config.get_text_config()
    windows = [None] if sliding_window(policy.model) is None else [16, 4096]
    log_probs = []
    for window in windows:
        if window is not None:
            text.sliding_window = window
        with torch.no_grad():
            padded = policy.evaluate(obs, action)
            log_probs.append(padded.log_prob)
            evaluator = PackedEvaluator(policy, 400, varlen=varlen)
            packed = evaluator(obs, action)
        longest = int(policy._prompt_inputs(obs)[1].max()) + 2
        too_long = window is not None and longest > window
        assert evaluator.padded_batches == int(too_long)
        assert (evaluator.last is None) == too_long
        for name in ("log_prob", "entropy", "value"):
            got, want = getattr(packed, name), getattr(padded, name)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    if len(windows) > 1:  # a window shorter than the frames matters
        assert not torch.allclose(log_probs[0], log_probs[1], atol=1e-3)
