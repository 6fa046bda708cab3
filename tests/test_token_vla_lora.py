"""LoRA on the token-VLA family (``policy.lora`` with ``policy.kind: token_vla``) on the tiny
random-weight checkpoints of tests/test_token_vla.py: what trains and travels, the launch's
check of the targets, float32 adapters on a bfloat16 model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from rlvla3.config.run_config import load_config  # noqa: E402
from rlvla3.config.typed_load import ConfigError  # noqa: E402
from rlvla3.policy.factory import build_policy, check_lora_targets  # noqa: E402
from tests.test_token_vla import FAMILIES, observations, tabletop_spaces  # noqa: E402
from tests.tiny_vlms import IMAGE_SIZE, write_tiny_vlm  # noqa: E402
from transport.weights import FlatLayout, WeightTarget  # noqa: E402


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory):
    return write_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


def test_lora_on_a_token_vla_trains_adapters_and_value_head_only(model_dir) -> None:
    """``policy.lora`` on a pretrained model: the factory adds the adapters, only they and the
    value head train, act and evaluate still agree, and the weight path ships those alone."""
    keys = [
        "policy.kind=token_vla",
        f"policy.token_vla.path={model_dir}",
        "policy.token_vla.bins=8",
        "policy.token_vla.dtype=float32",
        "policy.token_vla.value_hidden=16",
        "policy.lora.rank=4",
        "policy.lora.target_modules=[q_proj, v_proj]",
    ]
    policy = build_policy(load_config(None, keys), tabletop_spaces())
    trained = policy.trained_state_names()
    assert trained and all("lora_" in n or n.startswith("value_head.") for n in trained)
    assert any("lora_" in n for n in trained)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == set(trained)
    obs = observations(3)
    out = policy.act(obs)
    again = policy.evaluate(obs, out.action)
    torch.testing.assert_close(again.log_prob, out.log_prob, atol=1e-4, rtol=0)
    assert set(FlatLayout.of(policy).names) == set(trained)


def test_lora_trains_and_ships_the_state_projector_with_the_adapters(model_dir) -> None:
    keys = [
        "policy.kind=token_vla",
        f"policy.token_vla.path={model_dir}",
        "policy.token_vla.bins=8",
        "policy.token_vla.value_hidden=16",
        "policy.token_vla.state_projector=8",
        "policy.lora.rank=4",
        "policy.lora.target_modules=[q_proj, v_proj]",
    ]
    policy = build_policy(load_config(None, keys), tabletop_spaces())
    trained = set(policy.trained_state_names())
    projector = {n for n, _ in policy.named_parameters() if n.startswith("state_projector.")}
    assert projector and projector <= trained
    assert set(FlatLayout.of(policy).names) == trained


def test_the_launch_checks_lora_targets_without_loading_the_weights(model_dir) -> None:
    """The launcher's check builds the model's structure on the meta device (from_pretrained
    refuses it): a wrong target is one error before any role starts."""
    keys = [
        "env.id=rlvla3/TableTopEasy-v0",
        f"env.kwargs={{image_size: {IMAGE_SIZE}}}",
        "policy.kind=token_vla",
        f"policy.token_vla.path={model_dir}",
        "policy.lora.rank=4",
    ]
    check_lora_targets(load_config(None, [*keys, "policy.lora.target_modules=[q_proj]"]))
    with pytest.raises(ConfigError, match="policy.lora.target_modules: 'nonexistent' names no"):
        check_lora_targets(load_config(None, [*keys, "policy.lora.target_modules=[nonexistent]"]))


def test_adapters_on_a_bfloat16_model_train_in_float32(model_dir) -> None:
    """peft gives adapters their base layer's dtype; ours are float32 (as what the weight path
    ships and the memory estimate counts), the model under them bfloat16, and the log-probs
    of act and evaluate still agree."""
    keys = [
        "policy.kind=token_vla",
        f"policy.token_vla.path={model_dir}",
        "policy.token_vla.dtype=bfloat16",
        "policy.lora.rank=4",
        "policy.lora.target_modules=[q_proj, v_proj]",
    ]
    policy = build_policy(load_config(None, keys), tabletop_spaces())
    adapters = {n: p.dtype for n, p in policy.named_parameters() if "lora_" in n}
    assert adapters and set(adapters.values()) == {torch.float32}
    assert policy.model.get_output_embeddings().weight.dtype == torch.bfloat16
    layout = FlatLayout.of(policy)
    assert WeightTarget.of(layout, policy).bound  # the trained tensors receive in place
    obs = observations(3)
    out = policy.act(obs)
    torch.testing.assert_close(policy.evaluate(obs, out.action).log_prob, out.log_prob)
