"""Multi-node benchmark: the same roles on three nodes of a real Slurm cluster and on one host.

``launch/cartpole_3nodes.yaml`` (trainer, rollout server and weight broadcaster on a learner
node; one env worker on each of two sim nodes) runs, in turn, (a) on one host, every node on
loopback: ``rlvla3 launch launch/cartpole_3nodes.yaml``; (b) on the rehearsal cluster of
``launch/rehearsal/cluster.sh`` (three network namespaces with their own 10.x addresses, real
slurmctld/slurmd/munge): ``sbatch --nodes=3 launch/slurm.sbatch launch/cartpole_3nodes.yaml``,
so every message crosses a veth pair and a bridge, CURVE-encrypted, and Redis speaks TLS with
the run user's derived password. Both share this machine's cores, so the ratio is the cost of
the multi-host path (addresses, CURVE, Redis TLS, a network stack per hop), not of a real
network. Per trial: time to
solve (the launcher's ``wall_s``, start-up included) and env steps/s over the run. Trials of the
two alternate (``--repeats`` each); the table shows the median.

Needs root and Debian's ``slurmctld slurmd slurm-client munge``; without them only (a) runs.

    python bench/multi_node.py [--repeats 3] [--json PATH] [--smoke]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.launch_run import launch_and_read, read_summary
from harness.provenance import write_result
from harness.rehearsal import Cluster, unavailable
from harness.report import Table, benchmark_parser

CONFIG = "launch/cartpole_3nodes.yaml"
SMOKE = ["--set", "run.stop.target_mean_return=null", "--set", "run.stop.max_env_steps=3000"]
TIMEOUT_S = 600.0
TABLE = Table.from_layout(
    "setting:<12 | trials:>6d | solved:>7d | time to solve s:>16.1f | env steps/s:>12.0f"
)


def one_host(run_dir: Path, extra: list[str]) -> dict[str, Any]:
    return _result(launch_and_read(CONFIG, run_dir, extra=extra, timeout_s=TIMEOUT_S))


def on_cluster(cluster: Cluster, run_dir: Path, extra: list[str]) -> dict[str, Any]:
    out = run_dir.parent / f"{run_dir.name}.out"
    job = cluster.sbatch(
        "--nodes=3", f"--output={out}", "launch/slurm.sbatch", CONFIG, "--out", str(run_dir), *extra
    )
    deadline = time.monotonic() + TIMEOUT_S
    while (fields := cluster.job_done(job)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Slurm job {job} still running after {TIMEOUT_S}s")
        time.sleep(0.5)  # polling another process's state (Slurm's), bounded by the deadline
    if (fields["JobState"], fields["ExitCode"]) != ("COMPLETED", "0:0"):
        raise RuntimeError(
            f"Slurm job {job}: {fields['JobState']} {fields['ExitCode']}:\n"
            f"{out.read_text()[-2000:]}"
        )
    return _result(read_summary(run_dir))


def _result(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "solved": summary["solved"],
        "wall_s": summary["wall_s"],
        "env_steps": summary["env_steps"],
        "env_steps_per_s": round(summary["env_steps"] / summary["wall_s"], 1),
        "final_mean_return": summary["final_mean_return"],
    }


def median(trials: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(t[key] for t in trials), 2)


def main() -> None:
    parser = benchmark_parser(
        __doc__, smoke_help="one short trial each (3,000 env steps, no solving): for CI"
    )
    parser.add_argument("--repeats", type=int, default=3, help="trials of each setting")
    args = parser.parse_args()
    extra = SMOKE if args.smoke else []
    repeats = 1 if args.smoke else args.repeats
    why_not = unavailable(slurm=True)
    trials: dict[str, list[dict[str, Any]]] = {"one_host": [], "three_nodes": []}
    with tempfile.TemporaryDirectory(prefix="rlvla3-bench-multi-") as tmp:
        cluster = None if why_not else Cluster(Path(tmp) / "cluster", slurm=True)
        try:
            if cluster is not None:
                cluster.up()
            for i in range(repeats):  # alternating, so a change of load hits both alike
                trials["one_host"].append(one_host(Path(tmp) / f"one-{i}", extra))
                if cluster is not None:
                    trials["three_nodes"].append(
                        on_cluster(cluster, Path(tmp) / f"three-{i}", extra)
                    )
        finally:
            if cluster is not None:
                cluster.down()
    report: dict[str, Any] = {"config": CONFIG, "smoke": args.smoke, "trials": trials}
    if why_not:
        report["three_nodes_skipped"] = why_not
    print(TABLE.header())
    for name, runs in trials.items():
        if not runs:
            print(f"{name:12} skipped: {why_not}")
            continue
        report[name] = {
            "solved": sum(r["solved"] for r in runs),
            "trials": len(runs),
            "median_wall_s": median(runs, "wall_s"),
            "median_env_steps_per_s": median(runs, "env_steps_per_s"),
        }
        r = report[name]
        print(
            TABLE.row(name, len(runs), r["solved"], r["median_wall_s"], r["median_env_steps_per_s"])
        )
    if trials["three_nodes"]:
        report["ratio_env_steps_per_s"] = round(
            report["three_nodes"]["median_env_steps_per_s"]
            / report["one_host"]["median_env_steps_per_s"],
            3,
        )
        print(f"three nodes / one host, env steps/s: {report['ratio_env_steps_per_s']:.2f}")
    write_result(args.json, "multi_node", report, vars(args))


if __name__ == "__main__":
    main()
