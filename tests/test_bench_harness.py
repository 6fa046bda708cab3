"""The benchmark harness's own pieces: tables, command lines, summaries, hyperparameters."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from bench.harness.launch_run import launch_command, read_summary
from bench.harness.ppo_hyperparameters import ppo_hyperparameters
from bench.harness.report import Column, Table, host_line, host_record, point_line


def test_a_layout_formats_titles_and_values_as_its_specs_say() -> None:
    table = Table.from_layout("case:<6 | env steps/s:>12,.0f | ms/step: env:>13.2f | solved:>6")
    assert [c.header for c in table.columns] == ["case", "env steps/s", "ms/step: env", "solved"]
    assert table.header() == f"{'case':<6} {'env steps/s':>12} {'ms/step: env':>13} {'solved':>6}"
    assert (
        table.row("a", 12345.6, 0.125, True) == f"{'a':<6} {12345.6:>12,.0f} {0.125:>13.2f}   True"
    )


def test_a_column_without_width_adds_no_trailing_blanks() -> None:
    table = Table((Column("name", 5, align="<"), Column("", align="<")))
    assert table.header() == "name"
    assert table.row("x", "") == "x"


def test_a_columns_title_may_align_apart_from_its_values() -> None:
    table = Table((Column("serving", 10, ".1f", header_align="<"),))
    assert table.header() == "serving"
    assert table.row(2.0) == "       2.0"


def test_a_curve_point_prints_floats_to_three_decimals() -> None:
    assert point_line({"step": 3, "loss": 0.12345, "kind": "ppo"}) == "step=3 loss=0.123 kind=ppo"


def test_the_host_record_carries_the_load_before_and_after() -> None:
    host = host_record(1.25)
    assert host["load_avg_1m_before"] == 1.25 and host["cpus"] >= 1
    assert host_line(host).startswith(f"host: {host['cpus']} CPUs, 1-min load average 1.2 before")


def test_the_launch_command_sets_each_override(tmp_path) -> None:
    cmd = launch_command("launch/cartpole.yaml", tmp_path, {"run.stop.max_env_steps": 3000})
    assert cmd == [
        sys.executable,
        "-m",
        "rlvla3.cli",
        "launch",
        "launch/cartpole.yaml",
        "--out",
        str(tmp_path),
        "--set",
        "run.stop.max_env_steps=3000",
    ]


def test_a_runs_summary_is_read_from_its_directory(tmp_path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"solved": True, "wall_s": 9.1}))
    assert read_summary(tmp_path) == {"solved": True, "wall_s": 9.1}


def test_ppo_hyperparameters_are_the_updates_keyword_arguments() -> None:
    names = ("epochs", "minibatch_size", "clip_coef", "vf_coef", "ent_coef", "max_grad_norm")
    settings = SimpleNamespace(**{n: i for i, n in enumerate(names)}, lr=1e-3)
    assert ppo_hyperparameters(settings) == {n: i for i, n in enumerate(names)}
