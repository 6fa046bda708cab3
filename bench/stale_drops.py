"""Env work thrown away: the share of produced samples each shipped RL launch YAML drops as stale.

Every launch YAML that trains with RL runs as shipped (``rlvla3 launch``, its SFT stage first
where it has one and no checkpoint is there yet), with two changes: it stops after
``--rl-s`` seconds of RL (or on its own stop rule, whichever comes first), and without the
end-of-run evaluation. From each run's ``summary.json``: the samples trained and the samples
dropped (``samples_dropped``: chunks older than ``algo.max_staleness`` versions, or refused by
the chunk checks), the chunks produced and lost (``chunk_accounting``).

The multi-node YAML runs on this host (every node's roles on loopback), as
``bench/multi_node.py``'s one-host half does.

    python bench/stale_drops.py [--rl-s 240] [--json PATH] [--smoke]
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from harness.launch_run import launch_and_read
from harness.provenance import write_result
from harness.report import Table, benchmark_parser

TABLE = Table.from_layout(
    "launch YAML:<36 | RL s:>6.0f | env steps:>10, | dropped:>8.2% | lost:>5d | solved:>6"
)
RL_YAMLS = (
    "launch/cartpole.yaml",
    "launch/cartpole_3nodes.yaml",
    "launch/vla_tabletop.yaml",
    "launch/vla_tabletop_weak.yaml",
    "launch/sft_then_rl_tabletop.yaml",
)
SFT_TIMEOUT_S = 3600  # a YAML's SFT stage runs first when its checkpoint is missing


def measure(config: str, out: Path, rl_s: float) -> dict[str, Any]:
    """Run ``config`` for at most ``rl_s`` seconds of RL; its drop figures."""
    summary = launch_and_read(
        config,
        out,
        {"run.stop.max_wall_s": rl_s, "run.stop.eval_episodes": 0},
        timeout_s=rl_s + SFT_TIMEOUT_S,
    )
    c = summary["counters"]
    consumed, dropped = c.get("samples_consumed", 0), c.get("samples_dropped", 0)
    return {
        "wall_s": summary["wall_s"],
        "env_steps": summary["env_steps"],
        "samples_consumed": consumed,
        "samples_dropped": dropped,
        "dropped_share": dropped / (consumed + dropped) if consumed + dropped else 0.0,
        "chunks_produced": c.get("chunks_produced", 0),
        "chunks_dropped": c.get("chunks_dropped", 0),
        "chunks_lost": summary["chunks_lost"],
        "solved": summary["solved"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = benchmark_parser(__doc__, smoke_help="the CartPole YAML for 15 s, for CI")
    p.add_argument("--rl-s", type=float, default=240.0, help="longest RL stage per YAML (s)")
    p.add_argument("--only", nargs="*", default=None, help="these YAMLs only")
    args = p.parse_args(argv)
    yamls = list(args.only or RL_YAMLS)
    if args.smoke:
        yamls, args.rl_s = ["launch/cartpole.yaml"], 15.0
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlvla3-drops-") as tmp:
        for i, config in enumerate(yamls):
            results[config] = got = measure(config, Path(tmp) / f"run{i}", args.rl_s)
            print(
                f"{config:36s} {got['dropped_share']:7.2%} of {got['samples_consumed'] + got['samples_dropped']:>9,} "
                f"samples dropped; chunks {got['chunks_dropped']}/{got['chunks_produced']} "
                f"dropped, {got['chunks_lost']} lost",
                flush=True,
            )
    print()
    TABLE.print(
        (
            config,
            got["wall_s"],
            got["env_steps"],
            got["dropped_share"],
            got["chunks_lost"],
            got["solved"],
        )
        for config, got in results.items()
    )
    worst = max(r["dropped_share"] for r in results.values())
    print(f"\nworst: {worst:.2%} of produced samples dropped as stale")
    write_result(args.json, "stale_drops", results, vars(args))
    return results


if __name__ == "__main__":
    main()
