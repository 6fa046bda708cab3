"""The token VLA learns the table-top task: ``launch/token_vla_tabletop.yaml``'s two stages, timed.

Stage 0 and 1 run ``launch/sft_token_vla_tabletop.yaml``: ``rlvla3 launch`` writes the
llava-tiny preset into a fresh temp dir and grounds it (``policy.token_vla.preset_grounding``,
rlvla3/policy/grounding.py), then SFT clones 2,000 demos (its greedy success on fresh episodes
is the start); stage 2 runs ``launch/token_vla_tabletop.yaml`` from that checkpoint (PPO with
periodic held-out evaluation; its final greedy success is the end). The goal (issue 32): the
end at least 0.3 above the start within 40 minutes of the whole command (each launch timed
from its start, the preset, its grounding and the demos included) on a 2-core CPU. Prints each
stage and the evaluation curve, writes JSON.

``--plan``: the same with plan tokens (``launch/sft_token_vla_plan_tabletop.yaml``, then
``launch/token_vla_plan_tabletop.yaml``).

``--smoke``: the ``test`` size preset, a few grounding steps, 2 demos, a few SFT steps and a
few hundred RL env steps, in a temp dir (seconds, for CI: it runs, it does not learn).

    python bench/token_vla_tabletop.py [--json PATH] [--smoke] [--plan]
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.launch_run import launch_and_read
from harness.provenance import write_result
from harness.report import Table, benchmark_parser

CONFIGS = {
    False: ("launch/sft_token_vla_tabletop.yaml", "launch/token_vla_tabletop.yaml"),
    True: ("launch/sft_token_vla_plan_tabletop.yaml", "launch/token_vla_plan_tabletop.yaml"),
}
"""``--plan`` -> the (SFT, RL) launch files."""
GOAL = 0.3
"""Greedy success the RL stage must add to the SFT start."""
STAGES = Table.from_layout(
    "stage:<5 | command s:>10.1f | run s:>8.1f | env steps:>10d | success:>8.3f"
)
CURVE = Table.from_layout("version:>8d | episodes:>9d | success:>8.3f")


def smoke_overrides(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(SFT, RL) ``--set`` overrides of a seconds-long run of both stages in ``tmp``."""
    model = {"policy.token_vla.preset": "llava-test"}
    grounding = "{vision_steps: 2, text_steps: 2, frames: 16, batch_size: 4}"
    sft = {
        **model,
        "policy.token_vla.preset_grounding": grounding,
        "sft.dataset": tmp / "demos",
        "sft.generate_demos": 2,
        "sft.max_steps": 4,
        "sft.token_budget": 1024,
        "sft.publish_every": 2,
        "sft.checkpoint_every": 2,
        "run.stop.eval_episodes": 2,
    }
    rl = {
        **model,
        "env.num_envs_per_worker": 8,
        "algo.batch_steps": 64,
        "algo.minibatch_size": 32,
        "run.stop.max_env_steps": 300,
        "run.stop.eval_episodes": 2,
        "run.eval.every_versions": 1,
        "run.eval.episodes": 2,
    }
    return sft, rl


def run_stages(tmp: Path, smoke: bool, plan: bool = False) -> dict[str, Any]:
    """Both stages into ``tmp`` (``plan``: the plan-token launch files); the summaries'
    figures."""
    sft_config, rl_config = CONFIGS[plan]
    sft_over, rl_over = smoke_overrides(tmp) if smoke else ({}, {})
    model = {"policy.token_vla.path": tmp / "model"}  # a fresh model: stage 0 runs, timed
    sft_dir = tmp / "sft"
    sft = _timed(sft_config, sft_dir, {**sft_over, **model}, timeout_s=1800)
    rl_over = {**rl_over, **model, "policy.init_checkpoint": sft_dir, "policy.init_launch": "null"}
    rl = _timed(rl_config, tmp / "rl", rl_over, timeout_s=2700)
    start, end = sft["success_rate"], rl["success_rate"]
    return {
        "grounding": json.loads((tmp / "model" / "grounding.json").read_text()),
        "sft": _stage(sft),
        "rl": _stage(rl),
        "start_success": start,
        "end_success": end,
        "gain": end - start,
        "goal_gain": GOAL,
        "reached": end - start >= GOAL,
        "wall_s": sft["command_s"] + rl["command_s"],
        "evaluations": [
            {k: e.get(k) for k in ("version", "episodes", "success_rate", "env_steps", "t")}
            for e in rl.get("evaluations") or []
        ],
    }


def _timed(config: str, run_dir: Path, overrides: dict[str, Any], timeout_s: float) -> dict:
    """The launch's summary, with ``command_s``: the whole command's seconds (the run's own
    ``wall_s`` starts once its roles do)."""
    started = time.monotonic()
    summary = launch_and_read(config, run_dir, overrides, timeout_s=timeout_s)
    return {**summary, "command_s": time.monotonic() - started}


def _stage(summary: dict[str, Any]) -> dict[str, Any]:
    keys = ("command_s", "wall_s", "env_steps", "success_rate", "stop_reason")
    return {k: summary.get(k) for k in keys}


def main() -> None:
    parser = benchmark_parser(__doc__, smoke_help="the test-size model for seconds, for CI")
    parser.add_argument("--plan", action="store_true", help="the plan-token launch files")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlvla3-bench-token-vla-") as tmp:
        results = run_stages(Path(tmp), args.smoke, args.plan)
    STAGES.print(
        (name, *(results[name][k] for k in ("command_s", "wall_s", "env_steps", "success_rate")))
        for name in ("sft", "rl")
    )
    CURVE.print((e["version"], e["episodes"], e["success_rate"]) for e in results["evaluations"])
    print(
        f"greedy success {results['start_success']:.3f} -> {results['end_success']:.3f} "
        f"(+{results['gain']:.3f}, goal +{GOAL}) in {results['wall_s'] / 60:.1f} min"
    )
    write_result(args.json, "token_vla_tabletop", results, vars(args))


if __name__ == "__main__":
    main()
