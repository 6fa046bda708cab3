"""``policy.init_launch``: one ``rlvla3 launch`` runs the stage that makes the init checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlvla3.config.run_config import load_config
from rlvla3.config.typed_load import ConfigError
from rlvla3.launch import command as launch_command


def _second_stage(tmp_path: Path, **policy: str) -> Path:
    fields = "\n".join(f"  {k}: {v}" for k, v in policy.items())
    path = tmp_path / "second.yaml"
    path.write_text(f"run: {{name: second}}\npolicy:\n{fields}\n")
    return path


@pytest.fixture
def first_stage_calls(monkeypatch):
    """Replace the recursive ``launch`` of the first stage; it writes a checkpoint by default."""
    calls: list[tuple[str, str]] = []
    behaviour = {"code": 0, "writes": True}

    def fake_launch(config_path, overrides=(), *, out=None, echo=print, **_):
        calls.append((config_path, out))
        if behaviour["writes"]:
            (Path(out) / "checkpoints").mkdir(parents=True, exist_ok=True)
            (Path(out) / "checkpoints" / "ckpt_00000001.pt").write_bytes(b"x")
        return behaviour["code"]

    monkeypatch.setattr(launch_command, "launch", fake_launch)
    return calls, behaviour


def test_runs_the_first_stage_into_the_init_dir_once(tmp_path, first_stage_calls):
    calls, _ = first_stage_calls
    init_dir = tmp_path / "sft_run"
    path = _second_stage(tmp_path, init_checkpoint=str(init_dir), init_launch="first.yaml")
    cfg = load_config(path)
    assert launch_command._run_init_launch(cfg, str(path), echo=lambda _: None) == 0
    assert calls == [("first.yaml", str(init_dir))]
    # A checkpoint is there now: a second launch goes straight to its own roles.
    assert launch_command._run_init_launch(cfg, str(path), echo=lambda _: None) == 0
    assert len(calls) == 1


def test_a_failed_or_checkpointless_first_stage_stops_the_launch(tmp_path, first_stage_calls):
    _, behaviour = first_stage_calls
    path = _second_stage(tmp_path, init_checkpoint=str(tmp_path / "a"), init_launch="first.yaml")
    behaviour.update(code=3, writes=False)
    assert launch_command._run_init_launch(load_config(path), str(path), echo=lambda _: None) == 3
    behaviour.update(code=0, writes=False)
    said: list[str] = []
    assert launch_command._run_init_launch(load_config(path), str(path), echo=said.append) == 1
    assert "without writing a checkpoint" in said[-1]


def test_init_launch_needs_init_checkpoint_and_may_not_name_itself(tmp_path):
    path = _second_stage(tmp_path, init_launch="first.yaml")
    with pytest.raises(ConfigError, match="policy.init_launch: needs policy.init_checkpoint"):
        load_config(path)
    itself = str(tmp_path / "second.yaml")
    path = _second_stage(tmp_path, init_checkpoint=str(tmp_path / "x"), init_launch=itself)
    with pytest.raises(ConfigError, match="is this launch file itself"):
        launch_command._run_init_launch(load_config(path), str(path), echo=lambda _: None)


def test_the_run_pins_the_init_checkpoint_file_it_starts_from(tmp_path, first_stage_calls):
    """A run dir as ``init_checkpoint`` becomes its newest checkpoint file at launch: every
    role, a restarted one too, then loads those weights even after the first stage's run
    writes newer ones (a LoRA run's frozen base must be the same in all of them)."""
    init_dir = tmp_path / "sft_run"
    path = _second_stage(tmp_path, init_checkpoint=str(init_dir), init_launch="first.yaml")
    cfg = load_config(path)
    assert launch_command._pin_init_checkpoint(cfg) == cfg  # nothing there yet: as given
    launch_command._run_init_launch(cfg, str(path), echo=lambda _: None)
    pinned = launch_command._pin_init_checkpoint(cfg).policy.init_checkpoint
    assert pinned == str((init_dir / "checkpoints" / "ckpt_00000001.pt").resolve())
    (init_dir / "checkpoints" / "ckpt_00000002.pt").write_bytes(b"x")  # the first stage goes on
    as_written = load_config(None, [f"policy.init_checkpoint={pinned}"])  # the run's config.yaml
    assert launch_command._pin_init_checkpoint(as_written).policy.init_checkpoint == pinned
    assert launch_command._pin_init_checkpoint(cfg).policy.init_checkpoint.endswith("2.pt")


def test_a_resumed_run_keeps_the_init_checkpoint_it_started_from(tmp_path):
    """``--resume`` pins the file the run's config.yaml recorded, not the first stage's newest
    (the base under its adapters and its KL reference stay); gone, it is one error."""
    init_dir = tmp_path / "sft_run"
    (init_dir / "checkpoints").mkdir(parents=True)
    first = init_dir / "checkpoints" / "ckpt_00000001.pt"
    first.write_bytes(b"x")
    cfg = load_config(None, [f"policy.init_checkpoint={init_dir}"])
    run = tmp_path / "rl_run"
    run.mkdir()
    started = launch_command._pin_init_checkpoint(cfg).policy.init_checkpoint
    (run / "config.yaml").write_text(f"policy: {{init_checkpoint: {started}}}\n")
    (init_dir / "checkpoints" / "ckpt_00000002.pt").write_bytes(b"x")
    assert launch_command._pin_init_checkpoint(cfg, run).policy.init_checkpoint == started
    assert launch_command._pin_init_checkpoint(cfg).policy.init_checkpoint.endswith("2.pt")
    elsewhere = load_config(None, [f"policy.init_checkpoint={tmp_path / 'other'}"])
    assert launch_command._pin_init_checkpoint(elsewhere, run) == elsewhere  # not under it
    first.unlink()
    # without LoRA or a KL reference the trainer resumes from its own checkpoints alone
    assert launch_command._pin_init_checkpoint(cfg, run).policy.init_checkpoint.endswith("2.pt")
    with_lora = load_config(None, [f"policy.init_checkpoint={init_dir}", "policy.lora.rank=4"])
    with pytest.raises(ConfigError, match="started from .*ckpt_00000001.pt, which is not there"):
        launch_command._pin_init_checkpoint(with_lora, run)
    # a run whose config names the folder (never pinned) resumes as before
    (run / "config.yaml").write_text(f"policy: {{init_checkpoint: {init_dir}}}\n")
    assert launch_command._pin_init_checkpoint(with_lora, run).policy.init_checkpoint.endswith(
        "2.pt"
    )
