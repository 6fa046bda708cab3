"""SFT of a token VLA (policy.kind: token_vla) through the real launcher, the model written by the
launcher from a size preset; how SFT counts a token VLA's frames; the presets' command."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rlvla3.config.token_vla import ObservationMapping  # noqa: E402
from rlvla3.config.typed_load import ConfigError  # noqa: E402
from rlvla3.policy import presets  # noqa: E402
from rlvla3.policy.sft_tokens import frame_tokens  # noqa: E402
from rlvla3.policy.token_vla_packing import PackedEvaluator  # noqa: E402
from tests.launching import launcher_output, start_launcher, write_yaml  # noqa: E402
from tests.test_token_vla import make_policy, observations  # noqa: E402
from tests.tiny_vlms import write_tiny_vlm  # noqa: E402


@pytest.mark.slow
def test_sft_trains_a_token_vla_from_a_preset_and_its_loss_falls(tmp_path, redis_url) -> None:
    model_dir = tmp_path / "model"
    cfg = {
        "run": {
            "name": "sft_token_vla",
            "redis_url": redis_url,
            "stop": {"eval_episodes": 2, "eval_timeout_s": 120, "max_wall_s": 300},
        },
        "roles": {
            "sft_trainer": {"count": 1},
            "weight_broadcaster": {"count": 1},
            "rollout_server": {"count": 1},
            "env_worker": {"count": 1},
        },
        "env": {"id": "rlvla3/TableTopEasy-v0", "num_envs_per_worker": 1},
        "policy": {
            "kind": "token_vla",
            "token_vla": {
                "path": str(model_dir),
                "preset": "llava-test",
                "bins": 16,
                "prompt": "{instruction}{state}\n",
                "state_decimals": 1,
                "value_hidden": 16,
            },
        },
        "sft": {
            "dataset": str(tmp_path / "demos"),
            "generate_demos": 4,
            "max_steps": 30,
            "lr": 3e-3,
            "token_budget": 1024,
            "publish_every": 10,
            "checkpoint_every": 30,
            "symmetry": {"kind": "dihedral"},
        },
    }
    run_dir = tmp_path / "run"
    launcher = start_launcher(write_yaml(tmp_path / "sft.yaml", cfg), run_dir)
    try:
        assert launcher.wait(timeout=300) == 0, launcher_output(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert (model_dir / "config.json").is_file()  # the launcher wrote the preset
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 30 and all(m["samples"] > 1 for m in metrics)
    assert losses[0] == pytest.approx(2 * np.log(16), rel=0.1)  # two near-uniform 16-way tokens
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # it learns
    log = (run_dir / "logs" / "sft_trainer-0.log").read_text()
    assert "(DemoSet, packed batches)" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["evaluation"]["episodes"] >= 2 and summary["final_loss"] == losses[-1]


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_a_token_vla_frame_counts_its_prompt_and_action_tokens(tmp_path, family) -> None:
    policy = make_policy(write_tiny_vlm(tmp_path / family, family))  # with the state as text
    counting = frame_tokens(policy)
    obs = observations(6)
    obs["proprio"][0] *= 100  # more digits: more tokens
    frames = {k: v.numpy() for k, v in obs.items()}
    counted = counting.fixed_tokens + counting.variable_tokens(frames)
    _, lengths = policy._prompt_inputs(obs)
    # the byte-level tokenizer has no merges: the prompt's parts add up exactly
    assert counted.tolist() == (lengths + policy.bins.dims).tolist()


def test_a_demo_batch_is_one_packed_row_of_its_counted_tokens(tmp_path) -> None:
    from sft.data import DemoSet
    from sft.demos import generate_demos

    policy = make_policy(write_tiny_vlm(tmp_path / "idefics3", "idefics3"))
    generate_demos("rlvla3/TableTopEasy-v0", 2, tmp_path / "demos", 0)
    counting = frame_tokens(policy, row_tokens=1024)
    data = DemoSet(tmp_path / "demos", counting.fixed_tokens, counting.variable_tokens)
    batch = data.packed_batch(1024, np.random.default_rng(0))
    obs = {k: torch.from_numpy(v) for k, v in batch.obs.items()}
    with torch.no_grad():
        counting.evaluate(obs, policy.from_env_action(torch.from_numpy(batch.actions)))
    rows = counting.evaluate.last
    assert batch.num_samples > 3 and rows.real_tokens == batch.num_tokens <= 1024
    assert rows.inputs["input_ids"].shape == (1, batch.num_tokens)  # no padding at all


def test_sft_packs_a_token_vla_unless_told_not_to(tmp_path) -> None:
    policy = make_policy(
        write_tiny_vlm(tmp_path / "llava", "llava"),
        prompt="{instruction}\n",
        observation=ObservationMapping(state=None),
    )
    packed = frame_tokens(policy, row_tokens=512)
    assert packed.packed and packed.padded_because is None
    assert isinstance(packed.evaluate, PackedEvaluator) and packed.evaluate.varlen  # one row
    padded = frame_tokens(policy, packing=False)
    assert not padded.packed and padded.padded_because == "sft.packing is false"
    assert padded.evaluate == policy.demo_evaluate


def test_the_presets_command_writes_a_model_and_a_wrong_preset_names_its_field(
    tmp_path, capsys
) -> None:
    presets.main(["--family", "idefics3", "--size", "test", "--out", str(tmp_path / "m")])
    assert (tmp_path / "m" / "config.json").is_file() and "wrote" in capsys.readouterr().out
    assert not presets.ensure_preset(str(tmp_path / "m"), "idefics3-test")  # a model is there
    with pytest.raises(ConfigError, match=r"policy.token_vla.preset: no preset 'llava-huge'"):
        presets.ensure_preset(str(tmp_path / "x"), "llava-huge")


def test_a_preset_is_written_aside_and_moved_in_config_last(tmp_path, monkeypatch) -> None:
    """Another node's launcher on a shared file system must never see a config.json beside
    half-written weights: the files are written in a side folder and moved in, config last."""
    moved: list[str] = []
    real_replace = presets.os.replace

    def replace(src, dst):
        moved.append(Path(dst).name)
        assert not (Path(dst).parent / "config.json").exists()  # nothing "there" before the end
        real_replace(src, dst)

    monkeypatch.setattr(presets.os, "replace", replace)
    assert presets.ensure_preset(str(tmp_path / "m"), "llava-test")
    assert moved[-1] == "config.json" and "model.safetensors" in moved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # the side folder is gone
