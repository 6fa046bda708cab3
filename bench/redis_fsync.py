"""What the run's durable Redis costs: the main job's env steps/s per ``run.redis_appendfsync``.

The run's own redis-server keeps an append-only file (docs/reliability.md); ``always`` fsyncs
every write before answering, ``everysec`` once a second, ``no`` leaves it to the OS. Each
policy runs the main job for a fixed number of env steps (no target, so every trial does the
same work), alternating, and the table gives env steps/s and the ratio to ``no``.

    python bench/redis_fsync.py [--steps 40000] [--repeats 2] [--json PATH] [--smoke]
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from harness.launch_run import launch_and_read
from harness.provenance import write_result
from harness.report import Table, benchmark_parser

POLICIES = ("no", "everysec", "always")
TABLE = Table.from_layout("appendfsync:<12 | env steps/s:>12.0f | vs no:>7.2f")


def trial(run_dir: Path, policy: str, steps: int) -> float:
    overrides = {
        "run.stop.target_mean_return": "null",
        "run.stop.max_env_steps": steps,
        "run.redis_appendfsync": policy,
    }
    s = launch_and_read("launch/cartpole.yaml", run_dir, overrides)
    return s["env_steps"] / s["wall_s"]


def main() -> None:
    parser = benchmark_parser(__doc__, smoke_help="3,000 steps, one trial each")
    parser.add_argument("--steps", type=int, default=40_000, help="env steps per trial")
    parser.add_argument("--repeats", type=int, default=2, help="trials per policy")
    args = parser.parse_args()
    steps, repeats = (3000, 1) if args.smoke else (args.steps, args.repeats)
    rates: dict[str, list[float]] = {p: [] for p in POLICIES}
    with tempfile.TemporaryDirectory(prefix="rlvla3-bench-fsync-") as tmp:
        for i in range(repeats):
            for policy in POLICIES:
                rates[policy].append(trial(Path(tmp) / f"{policy}{i}", policy, steps))
    base = statistics.median(rates["no"])
    results = {}
    print(TABLE.header())
    for policy in POLICIES:
        median = statistics.median(rates[policy])
        results[policy] = {"steps_per_s": rates[policy], "median": median, "ratio": median / base}
        print(TABLE.row(policy, median, median / base))
    write_result(args.json, "redis_fsync", results, {"steps": steps, "repeats": repeats})


if __name__ == "__main__":
    main()
