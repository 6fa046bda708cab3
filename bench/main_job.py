"""The README's main job, timed: ``rlvla3 launch launch/cartpole.yaml``, several times.

PPO on CartPole-v1 (2 env workers × 4 envs, 1 rollout server, 1 trainer, 1 weight broadcaster,
async) until the mean return of the last 20 episodes reaches 475. Per trial: whether it solved,
the launcher's wall time (start-up included) and the env steps it took; the table shows the
median and the range. The run-to-run spread is mostly how many env steps PPO happens to need.

    python bench/main_job.py [--repeats 3] [--json PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.provenance import write_result  # noqa: E402

CONFIG = "launch/cartpole.yaml"
SMOKE = ["--set", "run.stop.target_mean_return=null", "--set", "run.stop.max_env_steps=3000"]


def trial(run_dir: Path, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "rlvla3.cli", "launch", CONFIG, "--out", str(run_dir), *extra]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "solved": s["solved"],
        "wall_s": s["wall_s"],
        "env_steps": s["env_steps"],
        "chunks_dropped": s["counters"].get("chunks_dropped", 0),
        "chunks_produced": s["counters"].get("chunks_produced", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of the main job")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="one 3,000-step run, for CI")
    args = parser.parse_args()
    repeats, extra = (1, SMOKE) if args.smoke else (args.repeats, [])
    with tempfile.TemporaryDirectory(prefix="rlvla3-bench-main-") as tmp:
        trials = [trial(Path(tmp) / f"run{i}", extra) for i in range(repeats)]
    walls, steps = [t["wall_s"] for t in trials], [t["env_steps"] for t in trials]
    results = {
        "trials": trials,
        "solved": sum(t["solved"] for t in trials),
        "median_wall_s": statistics.median(walls),
        "min_wall_s": min(walls),
        "max_wall_s": max(walls),
        "median_env_steps": statistics.median(steps),
    }
    print(f"{'run':>4} {'solved':>7} {'wall s':>8} {'env steps':>10} {'dropped':>8}")
    for i, t in enumerate(trials):
        print(
            f"{i:4d} {t['solved']!s:>7} {t['wall_s']:8.1f} {t['env_steps']:10d} "
            f"{t['chunks_dropped']:4d}/{t['chunks_produced']}"
        )
    print(
        f"median {results['median_wall_s']:.1f} s ({min(walls):.1f}-{max(walls):.1f}), "
        f"{results['median_env_steps']:.0f} env steps; solved {results['solved']}/{repeats}"
    )
    write_result(args.json, "main_job", results, vars(args))


if __name__ == "__main__":
    main()
