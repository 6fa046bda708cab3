"""``rlvla3 eval`` (docs/evaluation.md): the protocols' episode lists, the Wilson interval, and
real evaluations of a tiny table-top checkpoint: two workers give the same episodes as one, and
a killed evaluation resumes without playing a recorded episode again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from rlvla3.launch.eval_report import read_episodes, wilson_interval
from sim.protocols import ProtocolEpisode, maniskill_protocol, protocol_for, seeded_protocol
from tests.conftest import wait_until
from tests.launching import REPO, eval_command, run_eval, write_checkpoint_run

ENV = "rlvla3/TableTopEasy-v0"


def test_wilson_interval_matches_known_values() -> None:
    assert wilson_interval(0, 12) == pytest.approx((0.0, 0.24249), abs=1e-5)
    assert wilson_interval(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    assert wilson_interval(50, 50) == pytest.approx((0.92865, 1.0), abs=1e-5)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_seeded_and_maniskill_protocols_list_their_seeds() -> None:
    seeded = protocol_for(suite=None, env_id=ENV, episodes=5, seed=7)
    assert [e.seed for e in seeded.episodes] == [7, 8, 9, 10, 11]
    assert [e.index for e in seeded.episodes] == list(range(5))
    assert len({e.key for e in seeded.episodes}) == 5
    ms = maniskill_protocol("maniskill/PickCube-v1", episodes=3)
    assert [e.seed for e in ms.episodes] == [0, 1, 2]
    assert all(e.ignore_terminations for e in ms.episodes)  # full-length episodes
    assert ms.episodes[0].env_kwargs == {"env_kwargs": {"reconfiguration_freq": 1}}
    assert ms.success_metric == "success_once"


def test_protocol_episodes_round_trip_and_bad_ones_are_named() -> None:
    episode = seeded_protocol(ENV, 2).episodes[1]
    assert ProtocolEpisode.from_dict(json.loads(json.dumps(episode.to_dict()))) == episode
    bad = episode.to_dict() | {"seed": True}
    with pytest.raises(ValueError, match="'seed'"):
        ProtocolEpisode.from_dict(bad)
    with pytest.raises(ValueError, match="unknown fields"):
        ProtocolEpisode.from_dict(episode.to_dict() | {"extra": 1})
    with pytest.raises(ValueError, match="mapping"):
        ProtocolEpisode.from_dict([1, 2])


# --------------------------------------------------------------- real evaluations (the roles)
def tiny_checkpoint(run_dir: Path, max_steps: int = 20) -> Path:
    """A run dir with a config and one checkpoint of a small random MLP on the table-top task."""
    cfg = {
        "run": {"name": "tiny", "heartbeat_ttl_s": 3.0, "progress_interval_s": 1.0},
        "roles": {"env_worker": {"count": 1}, "rollout_server": {"count": 1}},
        "env": {"id": ENV, "kwargs": {"obs_mode": "state", "max_episode_steps": max_steps}},
        "policy": {"kind": "mlp", "hidden_sizes": [16]},
    }
    return write_checkpoint_run(run_dir, cfg)


def outcomes(out: Path) -> dict[str, tuple]:
    return {
        k: (r["success"], r["length"], round(r["return"], 6))
        for k, r in read_episodes(out / "episodes.jsonl").items()
    }


def test_two_workers_give_the_same_episodes_as_one(tmp_path: Path) -> None:
    """Each episode depends only on its seed and the weights: who plays it changes nothing."""
    tiny_checkpoint(tmp_path / "run")
    run_eval(tmp_path / "run", tmp_path / "one", "--episodes", "10", "--workers", "1")
    printed = run_eval(tmp_path / "run", tmp_path / "two", "--episodes", "10", "--workers", "2")
    one, two = outcomes(tmp_path / "one"), outcomes(tmp_path / "two")
    assert len(one) == 10 and one == two
    report = json.loads((tmp_path / "two" / "eval.json").read_text())
    assert report["complete"] and report["overall"]["episodes"] == 10
    assert [e["seed"] for e in report["episodes"]] == list(range(10))
    assert report["greedy"] and all(e["greedy"] and e["version"] == 0 for e in report["episodes"])
    lo, hi = report["overall"]["success_ci95"]
    assert lo <= report["overall"]["success_rate"] <= hi
    assert "overall" in printed and "95% interval" in printed


def test_a_killed_evaluation_resumes_without_replays(tmp_path: Path) -> None:
    """Kill ``rlvla3 eval`` once some episodes are recorded; the next one into the same --out
    plays only the others, and every episode is recorded exactly once."""
    total = 300
    source = tiny_checkpoint(tmp_path / "run", max_steps=30)
    out = tmp_path / "out"
    log = open(tmp_path / "first.log", "wb")
    first = subprocess.Popen(
        eval_command(source, out, "--episodes", str(total)),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    )
    try:
        jsonl = out / "episodes.jsonl"
        wait_until(lambda: jsonl.is_file() and len(read_episodes(jsonl)) >= 5, 120, "episodes")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    recorded = len(read_episodes(jsonl))
    assert 5 <= recorded < total, (tmp_path / "first.log").read_text()
    printed = run_eval(source, out, "--episodes", str(total))
    assert f"{recorded} done before, {total - recorded} to play" in printed
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert sorted(r["seed"] for r in lines) == list(range(total))  # each once: no replays
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counters"]["eval_episodes"] == total - recorded  # the second run played


def test_a_protocol_evaluation_runs_only_the_eval_roles() -> None:
    from rlvla3.config.run_config import config_from_dict
    from rlvla3.config.typed_load import ConfigError

    eval_roles = {"eval_env_worker": {"count": 2}, "eval_rollout_server": {"count": 1}}
    raw = {"run": {"eval": {"protocol": True}}, "roles": eval_roles, "env": {"id": ENV}}
    assert config_from_dict(raw).num_processes("eval_env_worker") == 2
    with pytest.raises(ConfigError, match="run.eval.protocol: runs only the eval roles"):
        config_from_dict(raw | {"roles": eval_roles | {"trainer": {"count": 1}}})
    with pytest.raises(ConfigError, match="roles.eval_rollout_server.count"):
        config_from_dict(raw | {"roles": {"eval_env_worker": {"count": 1}}})
