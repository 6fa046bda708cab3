"""``trainer.count: 2``: one data-parallel training group of real role processes (gloo)."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch

from rlvla3.runtime.checkpoints import checkpoints, load_checkpoint
from rlvla3.runtime.chunk_ledger import balance, settled_marks
from rlvla3.runtime.registry import Registry
from tests.conftest import wait_until
from tests.launching import launcher_output, start_launcher, write_yaml
from tests.test_rl_loop import assert_no_chunk_lost, cartpole_config, run_to_end


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_two_trainer_ranks_train_as_one_group(tmp_path, redis_url, shard: bool) -> None:
    name = f"cp_group_{shard}"
    cfg = cartpole_config(name, redis_url, "async")
    cfg["roles"]["trainer"]["count"] = 2
    cfg["roles"]["trainer"].setdefault("settings", {})["shard"] = shard
    run_dir = run_to_end(tmp_path, cfg)
    registry = Registry(redis_url, name)
    c = registry.counters()
    assert c["updates"] >= 2 and registry.weight_version() >= 2
    assert_no_chunk_lost(registry, c)
    leader = (run_dir / "logs" / "trainer-0.log").read_text()
    follower = (run_dir / "logs" / "trainer-1.log").read_text()
    assert "rank 0 of 2 (gloo)" in leader and "rank 1 of 2 (gloo)" in follower
    sharded = "policy sharded over 2 ranks"
    assert (sharded in leader, sharded in follower) == (shard, shard)
    # the follower trained every update the leader did (its slice of each), and only rank 0
    # wrote checkpoints and published versions
    followed = int(re.search(r"trained (\d+) updates as rank 1", follower).group(1))
    assert followed == c["updates"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == c["updates"]
    # both ranks ended cleanly, and the leader's last checkpoint holds every update
    records = {r.index: r.status for r in registry.roles() if r.role == "trainer"}
    assert records == {0: "done", 1: "done"}
    assert "the leader did not say stop" not in follower
    newest = checkpoints(run_dir / "checkpoints")[-1]
    assert load_checkpoint(newest, torch.device("cpu"))["updates"] == c["updates"]


def test_a_failed_leader_hands_its_chunks_to_its_successor(tmp_path, redis_url) -> None:
    """Rank 1 killed: rank 0's next collective fails and it stops with an error, holding the
    chunks of the update it was in. It leaves them unsettled, as a killed trainer would, so
    the env workers resend them to the restarted group: nothing is lost or left in flight."""
    name = "cp_group_failed_leader"
    cfg = cartpole_config(name, redis_url, "async")
    cfg["roles"]["trainer"]["count"] = 2
    cfg["run"]["stop"] = {"max_wall_s": 200}
    run_dir = tmp_path / "run"
    launcher = start_launcher(write_yaml(tmp_path / "cfg.yaml", cfg), run_dir)
    registry = Registry(redis_url, name)
    try:
        wait_until(lambda: registry.weight_version() >= 5, 150, "5 weight versions")
        follower = next(r for r in registry.roles() if r.role == "trainer" and r.index == 1)
        os.kill(follower.pid, signal.SIGKILL)
        leader_log = run_dir / "logs" / "trainer-0.log"
        wait_until(lambda: "failed holding" in leader_log.read_text(), 120, "rank 0 failed")
        successor = "were in the buffer of the trainer before this one"
        wait_until(lambda: successor in leader_log.read_text(), 120, "rank 0's successor")
        pushed = {
            field.removeprefix("pushed|"): high
            for field, high in registry.chunk_ledger().items()
            if field.startswith("pushed|")
        }
        assert pushed, "the env workers recorded no chunks"

        def marks_passed() -> bool:
            marks = settled_marks(registry.chunk_ledger())
            return all(marks.get(p, 0) > high for p, high in pushed.items())

        wait_until(marks_passed, 150, "every chunk pushed before the failure settled")
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=120) == 130, launcher_output(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    handed = re.search(r"failed holding (\d+) chunks: (\d+) go back", leader_log.read_text())
    assert handed is not None and int(handed.group(2)) == int(handed.group(1)) > 0
    c = registry.counters()
    assert c["chunks_returned"] >= int(handed.group(2))  # its successor took them back
    chunks = balance(registry.chunk_ledger(), c)
    assert chunks.balanced and chunks.lost == 0 and chunks.buffered == 0, chunks


@pytest.mark.slow
def test_launch_cartpole_with_a_sharded_trainer_group_solves(tmp_path) -> None:
    """``rlvla3 launch launch/cartpole.yaml`` with two sharded trainer ranks reaches its
    target: published and checkpointed weights are the whole ones gathered from the shards."""
    from rlvla3.launch.command import launch

    overrides = ["roles.trainer.count=2", "roles.trainer.settings.shard=true"]
    code = launch("launch/cartpole.yaml", overrides, out=str(tmp_path / "run"), echo=lambda _: None)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert code == 0 and summary["solved"], summary
    follower = (tmp_path / "run" / "logs" / "trainer-1.log").read_text()
    assert "policy sharded over 2 ranks" in follower
