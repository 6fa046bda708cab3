"""The memory check at setup (rlvla3/policy/memory_check.py): the estimate from a checkpoint's
headers counts what the built policy holds, a role whose estimate exceeds the free memory is
refused with one error naming the path, the role's device and both sizes, and the tiny test
models pass on this machine."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rlvla3.config.run_config import Config, load_config  # noqa: E402
from rlvla3.config.typed_load import ConfigError  # noqa: E402
from rlvla3.policy import memory_check  # noqa: E402
from rlvla3.policy.factory import build_policy  # noqa: E402
from rlvla3.policy.memory_check import (  # noqa: E402
    check_role_memory,
    device_free_bytes,
    estimate_token_vla_memory,
)
from tests.test_token_vla import tabletop_spaces  # noqa: E402
from tests.tiny_vlms import write_tiny_vlm  # noqa: E402

LORA_Q_V = ["policy.lora.rank=4", "policy.lora.target_modules=[q_proj, v_proj]"]
LORA_ALL = ["policy.lora.rank=2"]
CUDA = torch.device("cuda:0")


@pytest.fixture(scope="module", params=["llava", "idefics3"])
def model_dir(request, tmp_path_factory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


def token_vla(path: Path, *extra: str) -> Config:
    keys = ["policy.kind=token_vla", f"policy.token_vla.path={path}"]
    return load_config(None, [*keys, "policy.token_vla.value_hidden=16", *extra])


def counts(cfg: Config) -> tuple[int, int]:
    """Parameters and trainable parameters of the policy the factory builds."""
    params = list(build_policy(cfg, tabletop_spaces()).parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


@pytest.mark.parametrize("lora", [[], LORA_Q_V, LORA_ALL], ids=["full", "lora_q_v", "lora_all"])
def test_the_estimate_counts_what_the_built_policy_holds(model_dir, lora) -> None:
    cfg = token_vla(model_dir, *lora)
    estimate = estimate_token_vla_memory(
        cfg.policy.token_vla, cfg.policy.lora, copies=1, trains=True
    )
    assert estimate is not None
    assert (estimate.parameters, estimate.trainable) == counts(cfg)
    if lora:  # the frozen base has no gradients or Adam moments: only the float32 adapters
        assert estimate.training_bytes == 3 * 4 * estimate.trainable
        assert estimate.trainable < estimate.parameters / 7
    else:
        assert estimate.training_bytes == 3 * estimate.copy_bytes
    server = estimate_token_vla_memory(
        cfg.policy.token_vla, cfg.policy.lora, copies=2, trains=False
    )
    assert server.total_bytes == 2 * estimate.copy_bytes and server.trainable == 0


@pytest.mark.parametrize("lora", [[], LORA_Q_V], ids=["full", "lora_q_v"])
def test_a_bfloat16_rollout_server_counts_its_float32_receive_buffer(model_dir, lora) -> None:
    """Its copies cannot be views of the float32 versions, so a full bfloat16 model needs one
    float32 buffer beside them (shared by both copies); with LoRA the float32 adapters and
    heads receive in place."""
    cfg = token_vla(model_dir, *lora, "policy.token_vla.dtype=bfloat16")
    server = estimate_token_vla_memory(
        cfg.policy.token_vla, cfg.policy.lora, copies=2, trains=False, receives=True
    )
    if lora:
        assert server.receive_bytes == 0
    else:
        assert server.receive_bytes == 4 * server.parameters
        assert server.total_bytes == 2 * server.copy_bytes + server.receive_bytes
        assert "float32 buffer" in server.describe()


def test_bfloat16_halves_the_model_and_keeps_the_heads_float32(model_dir) -> None:
    f32 = token_vla(model_dir, *LORA_Q_V)
    bf16 = token_vla(model_dir, *LORA_Q_V, "policy.token_vla.dtype=bfloat16")
    a, b = (
        estimate_token_vla_memory(c.policy.token_vla, c.policy.lora, copies=1, trains=True)
        for c in (f32, bf16)
    )
    small = a.trainable * 4  # adapters and value head: float32 in both
    assert b.copy_bytes - small == (a.copy_bytes - small) // 2
    assert b.training_bytes == a.training_bytes


def test_refusal_names_the_path_the_device_setting_and_both_sizes_in_gib(model_dir) -> None:
    cfg = token_vla(model_dir)
    need = estimate_token_vla_memory(
        cfg.policy.token_vla, cfg.policy.lora, copies=1, trains=True
    ).total_bytes
    with pytest.raises(ConfigError) as err:
        check_role_memory(
            cfg, "trainer", CUDA, copies=1, trains=True, free_bytes=lambda d: need - 1
        )
    message = str(err.value)
    assert message.startswith(f"policy.token_vla.path: the model in '{model_dir}' does not fit")
    assert "on cuda:0 (roles.trainer.settings.device)" in message
    sizes = [float(x) for x in re.findall(r"([0-9.e+-]+) GiB", message)]
    assert sizes[0] == pytest.approx(need / 2**30, rel=1e-2)  # what it needs
    assert sizes[-1] == pytest.approx((need - 1) / 2**30, rel=1e-2)  # what is free
    # exactly enough passes; so does LoRA in memory that refuses full fine-tuning
    assert check_role_memory(cfg, "trainer", CUDA, copies=1, trains=True, free_bytes=lambda d: need)
    lora = token_vla(model_dir, *LORA_Q_V)
    assert check_role_memory(
        lora, "trainer", CUDA, copies=1, trains=True, free_bytes=lambda d: need - 1
    )
    # a rollout server holds two copies: one copy's worth of free memory is not enough
    one_copy = estimate_token_vla_memory(
        cfg.policy.token_vla, cfg.policy.lora, copies=1, trains=False
    ).total_bytes
    with pytest.raises(ConfigError, match=r"roles.rollout_server.settings.device.*2 copies"):
        check_role_memory(
            cfg, "rollout_server", CUDA, copies=2, trains=False, free_bytes=lambda d: one_copy
        )


def test_tiny_models_pass_on_this_machine(model_dir) -> None:
    free = device_free_bytes(torch.device("cpu"))
    assert free is None or free > 0
    cfg = token_vla(model_dir)
    assert check_role_memory(cfg, "trainer", torch.device("cpu"), copies=2, trains=True)
    assert device_free_bytes(torch.device("meta")) is None  # unreadable: the check is skipped
    other = load_config(None)  # another policy family: nothing to check
    assert (
        check_role_memory(other, "trainer", CUDA, copies=1, trains=True, free_bytes=lambda d: 0)
        is None
    )


def test_a_tied_checkpoint_counts_its_output_embedding_once_untied(model_dir, tmp_path) -> None:
    """A checkpoint that ties its output embedding to the input one saves it once; the loader
    unties it (the weight path needs every tensor apart), so the estimate counts it twice."""
    from safetensors.torch import load_file, save_file

    tied = Path(shutil.copytree(model_dir, tmp_path / "tied"))
    weights = load_file(tied / "model.safetensors")
    head = next(n for n in weights if n.endswith("lm_head.weight"))
    embed = next(n for n in weights if n.endswith("embed_tokens.weight"))
    weights[embed] = weights.pop(head).clone()
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tied / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(config))
    cfg = token_vla(tied)
    estimate = estimate_token_vla_memory(
        cfg.policy.token_vla, cfg.policy.lora, copies=1, trains=True
    )
    assert (estimate.parameters, estimate.trainable) == counts(cfg)


def test_without_safetensors_the_config_gives_the_shapes(model_dir, tmp_path) -> None:
    bare = Path(shutil.copytree(model_dir, tmp_path / "bare"))
    (bare / "model.safetensors").unlink()
    cfg = token_vla(bare, *LORA_Q_V)
    estimate = estimate_token_vla_memory(
        cfg.policy.token_vla, cfg.policy.lora, copies=1, trains=True
    )
    assert (estimate.parameters, estimate.trainable) == counts(token_vla(model_dir, *LORA_Q_V))
    assert (
        estimate_token_vla_memory(
            token_vla(tmp_path / "nowhere").policy.token_vla, cfg.policy.lora, copies=1, trains=True
        )
        is None
    )  # the load reports a bad directory itself


def test_mem_available_is_read_from_meminfo(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemAvailable:    2048 kB\n")
    assert memory_check._mem_available(meminfo) == 2048 * 1024
    assert memory_check._mem_available(tmp_path / "absent") is None


@pytest.mark.parametrize("role", ["trainer", "sft_trainer"])
def test_a_sharded_learner_counts_its_share_of_the_training_state(model_dir, role) -> None:
    cfg = token_vla(model_dir, f"roles.{role}.count=2", f"roles.{role}.settings.shard=true")
    whole = estimate_token_vla_memory(cfg.policy.token_vla, cfg.policy.lora, copies=1, trains=True)
    # a rank of 2: the whole policy once (every rank builds it before sharding) + half the rest
    rank_need = whole.copy_bytes + -(-whole.training_bytes // 2)
    assert rank_need < whole.total_bytes
    estimate = check_role_memory(
        cfg, role, CUDA, copies=1, trains=True, free_bytes=lambda d: rank_need
    )
    assert estimate.total_bytes == rank_need and "1/2 of it here" in estimate.describe()
    with pytest.raises(ConfigError, match="does not fit"):
        check_role_memory(
            cfg, role, CUDA, copies=1, trains=True, free_bytes=lambda d: rank_need - 1
        )
    # replicated ranks each hold all of it
    replicated = token_vla(model_dir, f"roles.{role}.count=2")
    with pytest.raises(ConfigError, match="does not fit"):
        check_role_memory(
            replicated, role, CUDA, copies=1, trains=True, free_bytes=lambda d: rank_need
        )
