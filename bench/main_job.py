"""The README's main job, timed: ``rlvla3 launch launch/cartpole.yaml``, several times.

PPO on CartPole-v1 (2 env workers × 4 envs, 1 rollout server, 1 trainer, 1 weight broadcaster,
async) until the mean return of the last 20 episodes reaches 475. Per trial: whether it solved,
the launcher's wall time (start-up included) and the env steps it took; the table shows the
median and the range. The run-to-run spread is mostly how many env steps PPO happens to need.

    python bench/main_job.py [--repeats 3] [--json PATH] [--smoke]
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from harness.launch_run import launch_and_read
from harness.provenance import write_result
from harness.report import Table, benchmark_parser

CONFIG = "launch/cartpole.yaml"
SMOKE = {"run.stop.target_mean_return": "null", "run.stop.max_env_steps": 3000}
TABLE = Table.from_layout("run:>4d | solved:>7 | wall s:>8.1f | env steps:>10d | dropped:>8")


def trial(run_dir: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    s = launch_and_read(CONFIG, run_dir, overrides)
    return {
        "solved": s["solved"],
        "wall_s": s["wall_s"],
        "env_steps": s["env_steps"],
        "chunks_dropped": s["counters"].get("chunks_dropped", 0),
        "chunks_produced": s["counters"].get("chunks_produced", 0),
    }


def main() -> None:
    parser = benchmark_parser(__doc__, smoke_help="one 3,000-step run, for CI")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the main job")
    args = parser.parse_args()
    repeats, overrides = (1, SMOKE) if args.smoke else (args.repeats, {})
    with tempfile.TemporaryDirectory(prefix="rlvla3-bench-main-") as tmp:
        trials = [trial(Path(tmp) / f"run{i}", overrides) for i in range(repeats)]
    walls, steps = [t["wall_s"] for t in trials], [t["env_steps"] for t in trials]
    results = {
        "trials": trials,
        "solved": sum(t["solved"] for t in trials),
        "median_wall_s": statistics.median(walls),
        "min_wall_s": min(walls),
        "max_wall_s": max(walls),
        "median_env_steps": statistics.median(steps),
    }
    TABLE.print(
        (
            i,
            t["solved"],
            t["wall_s"],
            t["env_steps"],
            f"{t['chunks_dropped']:4d}/{t['chunks_produced']}",
        )
        for i, t in enumerate(trials)
    )
    print(
        f"median {results['median_wall_s']:.1f} s ({min(walls):.1f}-{max(walls):.1f}), "
        f"{results['median_env_steps']:.0f} env steps; solved {results['solved']}/{repeats}"
    )
    write_result(args.json, "main_job", results, vars(args))


if __name__ == "__main__":
    main()
