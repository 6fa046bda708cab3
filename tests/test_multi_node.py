"""Two launchers with --node share one run through one Redis (multi-host, simulated on loopback)."""

from __future__ import annotations

import json

from rlvla3.registry import Registry
from tests.launching import launcher_output, start_launcher, write_yaml


def test_each_node_starts_only_its_roles_and_the_run_ends_everywhere(tmp_path, redis_url) -> None:
    cfg = {
        "run": {"name": "two_nodes", "redis_url": redis_url, "progress_interval_s": 5.0,
                "stop": {"max_env_steps": 600, "max_wall_s": 200}},
        "nodes": [{"name": "head", "host": "127.0.0.1"}, {"name": "sim", "host": "127.0.0.1"}],
        "roles": {
            "env_worker": {"count": 2, "node": "sim"},
            "rollout_server": {"count": 1, "node": "head"},
            "trainer": {"count": 1, "node": "head"},
            "weight_broadcaster": {"count": 1, "node": "head"},
        },
        "env": {"id": "CartPole-v1", "num_envs_per_worker": 1, "chunk_len": 16},
    }  # fmt: skip
    config = write_yaml(tmp_path / "two.yaml", cfg)
    head = start_launcher(config, tmp_path / "head", "--node", "head")
    sim = start_launcher(config, tmp_path / "sim", "--node", "sim")
    try:
        assert sim.wait(timeout=240) == 0, launcher_output(tmp_path / "sim")
        assert head.wait(timeout=240) == 0, launcher_output(tmp_path / "head")
    finally:
        for p in (head, sim):
            if p.poll() is None:
                p.kill()
    registry = Registry(redis_url, "two_nodes")
    placed = {(r.role, r.node) for r in registry.roles()}
    assert placed == {("env_worker", "sim"), ("rollout_server", "head"), ("trainer", "head"),
                      ("weight_broadcaster", "head")}  # fmt: skip
    assert {r.status for r in registry.roles()} == {"done"}
    assert sorted(p.name for p in (tmp_path / "sim" / "logs").iterdir()) == [
        "env_worker-0.log", "env_worker-1.log"]  # fmt: skip
    summary = json.loads((tmp_path / "head" / "summary.json").read_text())
    assert summary["env_steps"] >= 600
