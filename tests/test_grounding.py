"""Stage 0 of the table-top learning run (rlvla3/policy/grounding.py): what each stage trains,
the questions' layout, what it refuses, and the launcher writing a grounded preset whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rlvla3.config.run_config import load_config  # noqa: E402
from rlvla3.config.token_vla import PresetGrounding  # noqa: E402
from rlvla3.config.typed_load import ConfigError  # noqa: E402
from rlvla3.launch import command  # noqa: E402
from rlvla3.policy import grounding  # noqa: E402
from rlvla3.policy.hf_model import load_vlm  # noqa: E402
from rlvla3.policy.presets import write_vlm  # noqa: E402

ENV = "rlvla3/TableTopEasy-v0"
ENV_KWARGS = {"image_size": 32, "max_episode_steps": 12}


def small(**steps: int) -> PresetGrounding:
    return PresetGrounding(frames=24, batch_size=4, **steps)


def weights(directory: Path) -> dict[str, torch.Tensor]:
    model = load_vlm(str(directory), torch.float32).model
    return {k: v.clone() for k, v in model.state_dict().items()}


def changed(before: dict, after: dict, part: str) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before if part in k)


def test_the_vision_stage_trains_the_vision_tower_only(tmp_path, monkeypatch) -> None:
    write_vlm(tmp_path, "llava", "test")
    before = weights(tmp_path)
    monkeypatch.setattr(grounding, "PROGRESS_EVERY", 1)
    lines: list[str] = []
    report = grounding.ground_preset(
        str(tmp_path), small(vision_steps=3), ENV, ENV_KWARGS, lines.append
    )
    assert [line.split(",")[0] for line in lines] == [
        "grounding: vision step 1/3",
        "grounding: vision step 2/3",
    ]
    after = weights(tmp_path)
    assert changed(before, after, "vision_tower")
    for part in ("projector", "language_model", "lm_head"):
        assert not changed(before, after, part), part
    saved = json.loads((tmp_path / "grounding.json").read_text())
    assert saved == report and report["vision"]["steps"] == 3 and report["text"]["steps"] == 0
    assert 0 <= report["vision"]["held_out_median_error"] <= 3


def test_both_stages_run_for_both_families(tmp_path) -> None:
    for family in ("llava", "idefics3"):
        directory = tmp_path / family
        write_vlm(directory, family, "test")
        before = weights(directory)
        grounding.ground_preset(
            str(directory), small(vision_steps=2, text_steps=2), ENV, ENV_KWARGS
        )
        after = weights(directory)
        assert changed(before, after, "lm_head"), family
        tower = "vision_tower" if family == "llava" else "vision_model"
        assert changed(before, after, tower), family


def test_a_question_sequence_asks_for_every_object_and_scores_only_the_answers(tmp_path) -> None:
    write_vlm(tmp_path, "llava", "test")
    vlm = load_vlm(str(tmp_path), torch.float32)
    frames = grounding.render_frames(vlm.processor, vlm.image_token, small(), ENV, ENV_KWARGS)
    assert frames.positions.shape == (24, 6, 2)
    assert (frames.positions.abs() <= 1).all()
    order = [5, 0, 3, 1, 4, 2]
    batch = grounding.question_batch(vlm.processor.tokenizer, frames, torch.tensor([7]), [order])
    tokenizer, spans = vlm.processor.tokenizer, batch.answers[0]
    assert sorted(spans) == list(range(6))
    scored = (batch.labels[0] != -100).nonzero().flatten().tolist()
    assert scored == sorted(i for span in spans.values() for i in span)
    for obj, span in spans.items():
        text = tokenizer.decode(batch.ids[0, span.start : span.stop].tolist())
        assert text == grounding.answer_text(frames.positions[7, obj])
    text = tokenizer.decode(batch.ids[0, len(frames.prefix) : spans[5].start].tolist())
    assert text == " blue target?"


def test_grounding_refuses_an_env_that_is_not_the_table_top(tmp_path) -> None:
    write_vlm(tmp_path, "llava", "test")
    with pytest.raises(ConfigError, match="policy.token_vla.preset_grounding"):
        grounding.ground_preset(str(tmp_path), small(vision_steps=1), "CartPole-v1", {})


def launch_config(path: Path, steps: int):
    return load_config(
        None,
        [
            f"env.id={ENV}",
            "env.kwargs={image_size: 32, max_episode_steps: 12}",
            "policy.kind=token_vla",
            f"policy.token_vla.path={path}",
            "policy.token_vla.preset=llava-test",
            "policy.token_vla.prompt='{instruction}{state}'",
            f"policy.token_vla.preset_grounding={{vision_steps: {steps}, frames: 24, batch_size: 4}}",
        ],
    )


def test_the_launcher_writes_a_grounded_preset_whole_or_not_at_all(tmp_path, monkeypatch) -> None:
    path = tmp_path / "models" / "grounded"
    cfg = launch_config(path, steps=2)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(grounding, "ground_preset", interrupted)
    with pytest.raises(KeyboardInterrupt):
        command._write_model_preset(cfg, print)
    assert not (path / "config.json").exists()  # nothing half-made for a role to load
    monkeypatch.undo()
    lines: list[str] = []
    command._write_model_preset(cfg, lines.append)
    assert (path / "config.json").is_file() and (path / "grounding.json").is_file()
    assert not path.with_name("grounded.grounding").exists()
    assert "held-out median position error" in lines[-1]
    stamp = (path / "grounding.json").stat().st_mtime_ns
    command._write_model_preset(cfg, lines.append)  # a model is there: left as it is
    assert (path / "grounding.json").stat().st_mtime_ns == stamp
