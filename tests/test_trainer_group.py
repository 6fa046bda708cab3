"""``trainer.count: 2``: one data-parallel training group of real role processes (gloo)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from rlvla3.runtime.checkpoints import checkpoints, load_checkpoint
from rlvla3.runtime.registry import Registry
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
