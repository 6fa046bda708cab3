"""SFT through the real launcher: demos generated, loss goes down, rollout servers load weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlvla3.runtime.registry import Registry
from sft.lerobot import LeRobotDataset
from tests.launching import REPO, launcher_output, start_launcher, write_yaml


@pytest.mark.parametrize(
    ("stream_buffer_frames", "symmetry", "ranks", "shard"),
    [
        (0, "none", 1, False),
        (60, "none", 1, False),
        (0, "dihedral", 1, False),
        (60, "none", 2, False),
        (0, "none", 2, True),
    ],
    ids=[
        "in_memory",
        "streamed",
        "in_memory_with_symmetry",
        "two_ranks_streamed",
        "two_sharded_ranks",
    ],
)
def test_short_sft_run_lowers_loss_and_publishes_versions_servers_load(
    tmp_path, redis_url, stream_buffer_frames, symmetry, ranks, shard
) -> None:
    cfg = {
        "run": {
            "name": "sft_short",
            "redis_url": redis_url,
            "progress_interval_s": 5.0,
            "stop": {"eval_episodes": 2, "eval_timeout_s": 120, "max_wall_s": 400},
        },
        "roles": {
            "sft_trainer": {"count": ranks, "settings": {"shard": shard}},
            "weight_broadcaster": {"count": 1},
            "rollout_server": {"count": 1},
            "env_worker": {"count": 1},
        },
        "env": {"id": "rlvla3/TableTopEasy-v0", "num_envs_per_worker": 1},
        "policy": {
            "kind": "vla",
            "vla": {"d_model": 32, "num_layers": 1, "num_heads": 2, "num_bins": 16},
        },
        "sft": {
            "dataset": str(tmp_path / "demos"),
            "generate_demos": 6,
            "max_steps": 40,
            "lr": 3e-3,
            "token_budget": 1024,
            "publish_every": 10,
            "checkpoint_every": 20,
            "stream_buffer_frames": stream_buffer_frames,
            "symmetry": {"kind": symmetry},
        },
    }
    run_dir = tmp_path / "run"
    launcher = start_launcher(write_yaml(tmp_path / "sft.yaml", cfg), run_dir)
    try:
        assert launcher.wait(timeout=400) == 0, launcher_output(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert len(LeRobotDataset(tmp_path / "demos").episodes) == 6
    losses = [
        json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learns
    registry = Registry(redis_url, "sft_short")
    final = registry.weight_version()
    # every role ended cleanly (a role whose exit path raised would stay "stopping")
    assert {r.status for r in registry.roles()} == {"done"}
    assert final >= 4  # v0 at start, every 10 steps, and the final weights
    server = next(r for r in registry.roles() if r.role == "rollout_server")
    assert server.stats["policy_version"] == final  # the server loaded the final version
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["evaluation"]["version"] == final and summary["evaluation"]["episodes"] >= 2
    assert 0.0 <= summary["success_rate"] <= 1.0 and summary["final_loss"] == losses[-1]
    if ranks == 2:  # one group; each rank read its 3 episodes and trained every step
        follower = (run_dir / "logs" / "sft_trainer-1.log").read_text()
        assert "rank 1 of 2 (gloo)" in follower and "from 3 episodes" in follower
        assert ("policy sharded over 2 ranks" in follower) == shard


def test_demos_command_writes_a_lerobot_dataset(tmp_path) -> None:
    out = tmp_path / "demos"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rlvla3.cli",
            "demos",
            "--episodes",
            "3",
            "--out",
            str(out),
            "--obs-mode",
            "state",
        ],
        check=True,
        cwd=REPO,
        timeout=120,
    )
    data = LeRobotDataset(out)
    assert len(data.episodes) == 3 and "observation.state" in data[0] and "action" in data[0]
