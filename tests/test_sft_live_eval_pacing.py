"""An SFT run's live evaluation paced by ``env_worker.settings.episodes_per_version``: the env
worker plays that many episodes on each published version, then waits for the next, and the
end-of-run evaluation still plays all its episodes."""

from __future__ import annotations

import json
from collections import Counter

from rlvla3.runtime.registry import Registry
from tests.test_rl_loop import run_to_end

_VERSIONS = 6  # v0, every 10 of the 50 steps (the last one is the final weights)


def test_live_evaluation_plays_a_few_episodes_per_version(tmp_path, redis_url) -> None:
    cfg = {
        "run": {
            "name": "sft_paced",
            "redis_url": redis_url,
            "stop": {"eval_episodes": 4, "eval_timeout_s": 120, "max_wall_s": 400},
        },
        "roles": {
            "sft_trainer": {"count": 1},
            "weight_broadcaster": {"count": 1},
            "rollout_server": {"count": 1},
            "env_worker": {"count": 1, "settings": {"episodes_per_version": 1}},
        },
        # 3-step episodes: unpaced, a single env finishes dozens per version
        "env": {
            "id": "rlvla3/TableTopEasy-v0",
            "num_envs_per_worker": 1,
            "kwargs": {"max_episode_steps": 3},
        },
        "policy": {"kind": "vla", "vla": {"d_model": 32, "num_layers": 1, "num_heads": 2}},
        "sft": {
            "dataset": str(tmp_path / "demos"),
            "generate_demos": 4,
            "max_steps": 50,
            "token_budget": 1024,
            "publish_every": 10,
            "checkpoint_every": 50,
        },
    }
    run_dir = run_to_end(tmp_path, cfg, timeout_s=400)
    registry = Registry(redis_url, "sft_paced")
    final = registry.weight_version()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["evaluation"] == {**summary["evaluation"], "version": final}
    assert summary["evaluation"]["episodes"] >= 4  # the end-of-run evaluation was not paused
    live = Counter(
        e["min_version"] for e in registry.series("episodes") if e["max_version"] < final
    )
    # one episode per version, and at most one more that the pause caught under way
    assert live and max(live.values()) <= 2, live
    assert sum(live.values()) <= 2 * _VERSIONS, live
