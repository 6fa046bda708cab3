"""Checkpoint curve: greedy and sampled success of each of a table-top run's checkpoints, and
of its warm start, on the same fresh episodes.

A run's held-out evaluation plays 100 episodes per point and its end 100-300: differences of
a few hundredths are within their noise. This plays ``--episodes`` (1,000 by default: a
standard error of about 0.015) fresh episodes (seeds ``--seed + i``, disjoint from the demos'
and the held-out evaluation's) with every checkpoint the run kept
(``roles.trainer.settings.keep_checkpoints``, ``algo.checkpoint_every``) and with the warm
start it began from (``policy.init_checkpoint``), twice each: greedy (the action the policy
takes with ``deterministic``, argmax for the token VLA) and sampled (what PPO trained), the
sampling seeded, stepped as one batch in this process (``bench/tabletop_failures.py``).

    python bench/checkpoint_curve.py RUN_DIR [--episodes 1000] [--json out.json]

``--smoke`` plays 4 short episodes of an untrained policy built from
``launch/vla_tabletop_weak.yaml``, saved and loaded as a checkpoint (CI).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from harness.launch_run import REPO
from harness.provenance import write_result
from harness.report import Table
from tabletop_failures import episodes_parser, play

from rlvla3.config.run_config import Config, load_config
from rlvla3.policy.factory import build_policy
from rlvla3.runtime.checkpoints import checkpoints, load_checkpoint, save_checkpoint

TABLE = Table.from_layout("checkpoint:<44 | version:>8 | greedy:>7.3f | sampled:>8.3f")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return episodes_parser(__doc__, episodes=1000, seed=500_000, threads=2).parse_args(argv)


def points(args: argparse.Namespace, tmp: Path) -> tuple[Config, list[tuple[str, Path]]]:
    """The run's config and the checkpoints to play: (label, path), the warm start first."""
    if args.smoke:
        cfg = load_config(
            REPO / "launch/vla_tabletop_weak.yaml",
            ["policy.init_checkpoint=null", "policy.init_launch=null"],
        )
        state = {"model": build_policy(cfg).state_dict(), "version": 0}
        return cfg, [("untrained (smoke)", save_checkpoint(tmp, 0, state, keep=1))]
    if args.run_dir is None:
        raise SystemExit("checkpoint_curve: give a run directory (or --smoke)")
    run = Path(args.run_dir)
    cfg = load_config(run / "config.yaml")
    found = [(path.name, path) for path in checkpoints(run / "checkpoints")]
    if not found:
        raise SystemExit(f"checkpoint_curve: no checkpoint in {run / 'checkpoints'}")
    init = cfg.policy.init_checkpoint
    if init:
        start = Path(init) if Path(init).is_absolute() else REPO / init
        found.insert(0, ("warm start", start))
    return cfg, found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    episodes, max_steps = (4, 6) if args.smoke else (args.episodes, None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlvla3-checkpoint-curve-") as tmp:
        cfg, found = points(args, Path(tmp))
        policy = build_policy(cfg)
        print(TABLE.header())
        for label, path in found:
            loaded = load_checkpoint(path, torch.device("cpu"))
            policy.load_state_dict(loaded["model"])
            policy.eval()
            row: dict[str, Any] = {
                "checkpoint": label,
                "path": str(path),
                "version": loaded.get("version"),
            }
            for name, deterministic in (("greedy", True), ("sampled", False)):
                torch.manual_seed(args.seed)
                success = play(cfg, policy, episodes, args.seed, max_steps, deterministic)[1]
                row[name] = float(success.mean())
            rows.append(row)
            print(TABLE.row(label, row["version"], row["greedy"], row["sampled"]), flush=True)
    results = {"episodes": episodes, "seed": args.seed, "points": rows}
    write_result(args.json, "checkpoint_curve", results, vars(args))
    return results


if __name__ == "__main__":
    main()
