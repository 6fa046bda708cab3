"""What the run's durable Redis costs: the main job's env steps/s per ``run.redis_appendfsync``.

The run's own redis-server keeps an append-only file (docs/reliability.md); ``always`` fsyncs
every write before answering, ``everysec`` once a second, ``no`` leaves it to the OS. Each
policy runs the main job for a fixed number of env steps (no target, so every trial does the
same work), alternating, and the table gives env steps/s and the ratio to ``no``.

    python bench/redis_fsync.py [--steps 40000] [--repeats 2] [--json PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.provenance import write_result  # noqa: E402

POLICIES = ("no", "everysec", "always")


def trial(run_dir: Path, policy: str, steps: int) -> float:
    overrides = {
        "run.stop.target_mean_return": "null",
        "run.stop.max_env_steps": steps,
        "run.redis_appendfsync": policy,
    }
    cmd = [sys.executable, "-m", "rlvla3.cli", "launch", "launch/cartpole.yaml"]
    cmd += ["--out", str(run_dir)]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={value}"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    return s["env_steps"] / s["wall_s"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40_000, help="env steps per trial")
    parser.add_argument("--repeats", type=int, default=2, help="trials per policy")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="3,000 steps, one trial each")
    args = parser.parse_args()
    steps, repeats = (3000, 1) if args.smoke else (args.steps, args.repeats)
    rates: dict[str, list[float]] = {p: [] for p in POLICIES}
    with tempfile.TemporaryDirectory(prefix="rlvla3-bench-fsync-") as tmp:
        for i in range(repeats):
            for policy in POLICIES:
                rates[policy].append(trial(Path(tmp) / f"{policy}{i}", policy, steps))
    base = statistics.median(rates["no"])
    results = {}
    print(f"{'appendfsync':12} {'env steps/s':>12} {'vs no':>7}")
    for policy in POLICIES:
        median = statistics.median(rates[policy])
        results[policy] = {"steps_per_s": rates[policy], "median": median, "ratio": median / base}
        print(f"{policy:12} {median:12.0f} {median / base:7.2f}")
    write_result(args.json, "redis_fsync", results, {"steps": steps, "repeats": repeats})


if __name__ == "__main__":
    main()
