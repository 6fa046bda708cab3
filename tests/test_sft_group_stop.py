"""A two-rank SFT group stopped mid-run leaves cleanly: whichever rank is asked first, rank 0
says the last step and ``stop``, no rank waits in a collective for ``run.stall_timeout_s``, and
rank 0's last checkpoint loads (real launcher, real Redis, gloo)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from rlvla3.runtime.checkpoints import check, checkpoints, load_checkpoint
from rlvla3.runtime.registry import Registry
from tests.conftest import wait_until
from tests.launching import TINY_TABLETOP_VLA, launcher_output, pid_gone, start_launcher, write_yaml

_STALL_S = 600.0  # a rank that waited on it would miss the test's own deadline by far
_DEADLINE_S = 120.0


def _config(tmp_path, redis_url: str) -> dict:
    return {
        "run": {
            "name": "sft_stop",
            "redis_url": redis_url,
            "stall_timeout_s": _STALL_S,
            "stop_timeout_s": _STALL_S,  # the launcher must not kill what hangs
            "stop": {"max_wall_s": 900},
        },
        "roles": {"sft_trainer": {"count": 2}, "weight_broadcaster": {"count": 1}},
        **TINY_TABLETOP_VLA,
        "sft": {
            "dataset": str(tmp_path / "demos"),
            "generate_demos": 4,
            "max_steps": 100_000,
            "token_budget": 512,
            "publish_every": 5,
            "checkpoint_every": 5,
        },
    }


@pytest.mark.parametrize("first", [0, 1], ids=["rank0_asked_first", "rank1_asked_first"])
def test_a_two_rank_sft_group_stopped_mid_run_leaves_cleanly(tmp_path, redis_url, first) -> None:
    run_dir = tmp_path / "run"
    launcher = start_launcher(
        write_yaml(tmp_path / "sft.yaml", _config(tmp_path, redis_url)), run_dir
    )
    registry = Registry(redis_url, "sft_stop")
    metrics = run_dir / "metrics.jsonl"

    def steps() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    try:
        wait_until(lambda: steps() >= 12, 300, "12 SFT steps")  # 2 checkpoints written
        ranks = {r.index: r.pid for r in registry.roles() if r.role == "sft_trainer"}
        # as two nodes' launchers do: one rank asked to stop, the other a moment later
        os.kill(ranks[first], signal.SIGTERM)
        if first == 1:  # the follower goes on taking rank 0's steps meanwhile
            now = steps()
            wait_until(lambda: steps() >= now + 3, 60, "steps after rank 1's stop")
        else:
            wait_until(lambda: pid_gone(ranks[0]), _DEADLINE_S, "rank 0 gone")
        try:
            os.kill(ranks[1 - first], signal.SIGTERM)
        except ProcessLookupError:  # rank 0's stop already ended the follower: also clean
            assert first == 0
        wait_until(
            lambda: all(pid_gone(pid) for pid in ranks.values()), _DEADLINE_S, "both ranks gone"
        )
        records = {r.index: r for r in registry.roles() if r.role == "sft_trainer"}
        assert {i: (r.status, r.restarts) for i, r in records.items()} == {
            0: ("done", 0),
            1: ("done", 0),
        }, launcher_output(run_dir)
        newest = checkpoints(run_dir / "checkpoints")[-1]
        assert check(newest) is None
        assert load_checkpoint(newest, torch.device("cpu"))["updates"] >= 10
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=_DEADLINE_S) == 130, launcher_output(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    follower_log = (run_dir / "logs" / "sft_trainer-1.log").read_text()
    assert "trained" in follower_log and "as rank 1" in follower_log
    assert "Traceback" not in follower_log, follower_log[-3000:]
