"""Failure probe: how a table-top policy's greedy episodes fail, from a run's newest checkpoint.

Plays ``--episodes`` fresh episodes (seeds ``--seed + i``, disjoint from the demos' and the
held-out evaluation's) with the greedy policy of a run directory (its ``config.yaml`` and newest
checkpoint), stepped as one batch in this process, and sorts each failed episode (one that ran
to ``max_episode_steps``) by what the pusher did over its last ``--tail`` steps:

- ``oscillating``: the greedy action turned by more than 90 degrees from one step to the next
  in most of the tail (the pusher shuttles back and forth, usually beside the block);
- ``stalled``: the pusher barely moved (speed under 0.05 table units/s) in most of the tail;
- ``other``: neither (e.g. pushing the block the wrong way, or walking off).

It also reports where failures end (the named block's distance to its target: success is
within 0.2), the success rate per instruction (named block, named target), and how many
episodes **misread** the instruction: one other (block, target) pair of the scene explains most
of their steps, each such step's action within 30 degrees of the scripted expert's action for
that pair and more than 45 degrees from the named pair's (``sim/experts.py``, its clean action);
beside the count, the share of episodes the same test flags when every action is a random
direction in the same states (chance). Those say whether the policy misreads which block and
target are meant or fails at the motion.

    python bench/tabletop_failures.py runs/vla_tabletop_weak [--episodes 300] [--json out.json]

``--smoke`` plays 4 short episodes of an untrained policy built from
``launch/vla_tabletop_weak.yaml`` (CI).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness.launch_run import REPO
from harness.provenance import write_result
from harness.report import Table, benchmark_parser

from rlvla3.config.run_config import Config, load_config
from rlvla3.policy.factory import build_policy
from rlvla3.runtime.checkpoints import load_checkpoint
from sim.envs import make_env
from sim.experts import TableTopExpert
from sim.tabletop import COLOURS, NUM_OBJECTS

STALLED_SPEED = 0.05
"""Table units per second below which the pusher counts as not moving."""
FITS_DEG, MISSES_DEG = 30.0, 45.0
"""A step fits a pair's expert action within FITS_DEG degrees and misses it beyond MISSES_DEG."""
BY_INSTRUCTION = Table.from_layout("instruction:<33 | episodes:>7 | success:>8.2f")


def episodes_parser(doc: str, episodes: int, seed: int, threads: int) -> argparse.ArgumentParser:
    """The flags of a script that plays fresh episodes with a run's policy (this one's and
    ``bench/checkpoint_curve.py``'s): the run dir, ``--episodes``, ``--seed``, ``--threads``."""
    p = benchmark_parser(doc, smoke_help="4 short episodes, untrained policy (CI)")
    p.add_argument("run_dir", nargs="?", help="a run directory (config.yaml, checkpoints/)")
    p.add_argument("--episodes", type=int, default=episodes)
    p.add_argument("--seed", type=int, default=seed, help="seed of the first episode")
    p.add_argument("--threads", type=int, default=threads, help="torch threads")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = episodes_parser(__doc__, episodes=300, seed=900_000, threads=1)
    p.add_argument("--tail", type=int, default=20, help="last steps of a failure classified")
    p.add_argument(
        "--max-episode-steps",
        type=int,
        help="the episodes' time limit (default: the run's env.kwargs, else the env's own)",
    )
    return p.parse_args(argv)


def load_policy(args: argparse.Namespace) -> tuple[Config, torch.nn.Module, str]:
    """The run's config and greedy policy (with its newest checkpoint), and what was loaded."""
    if args.smoke:
        cfg = load_config(
            REPO / "launch/vla_tabletop_weak.yaml",
            ["policy.init_checkpoint=null", "policy.init_launch=null"],
        )
        return cfg, build_policy(cfg).eval(), "untrained (smoke)"
    if args.run_dir is None:
        raise SystemExit("tabletop_failures: give a run directory (or --smoke)")
    run = Path(args.run_dir)
    cfg = load_config(run / "config.yaml")
    policy = build_policy(cfg)
    policy.load_state_dict(load_checkpoint(run, torch.device("cpu"))["model"])
    return cfg, policy.eval(), str(run)


@torch.no_grad()
def play(
    cfg: Config,
    policy: torch.nn.Module,
    episodes: int,
    seed: int,
    max_steps: int | None,
    deterministic: bool = True,
):
    """Greedy episodes (sampled ones: ``deterministic`` False) stepped as one batch: per
    episode its states (the one each action was taken in), success, final block-to-target
    distance, and the env actions and pusher speeds it produced."""
    kwargs = dict(cfg.env.kwargs)
    if max_steps is not None:
        kwargs["max_episode_steps"] = max_steps
    envs = [make_env(cfg.env.id, seed=seed + i, **kwargs) for i in range(episodes)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    states: list[list[Any]] = [[] for _ in envs]
    actions: list[list[np.ndarray]] = [[] for _ in envs]
    speeds: list[list[float]] = [[] for _ in envs]
    success, final = np.zeros(episodes, bool), np.zeros(episodes)
    live = list(range(episodes))
    while live:
        batch = {k: torch.from_numpy(np.stack([obs[i][k] for i in live])) for k in obs[live[0]]}
        out = policy.to_env_action(policy.act(batch, deterministic=deterministic).action)
        out = out.numpy()
        still = []
        for i, action in zip(live, out, strict=True):
            states[i].append(envs[i].privileged_state())
            obs[i], _, terminated, truncated, info = envs[i].step(action)
            actions[i].append(np.asarray(action, np.float64))
            speeds[i].append(float(np.hypot(*envs[i].privileged_state().pusher_vel)))
            if terminated or truncated:
                success[i], final[i] = bool(info["success"]), float(info["block_to_target"])
            else:
                still.append(i)
        live = still
    return states, success, final, actions, speeds


def _angle(a: np.ndarray, b: np.ndarray) -> float:
    """Degrees between two 2-D directions, in [0, 180]."""
    turn = np.degrees(np.arctan2(a[1], a[0]) - np.arctan2(b[1], b[0]))
    return abs((turn + 180.0) % 360.0 - 180.0)


def misread(states: list[Any], actions: list[np.ndarray], expert: TableTopExpert) -> bool:
    """Whether one other (block, target) pair of the scene explains most of an episode's
    actions: the action fits that pair's expert action and misses the named pair's (see the
    module docstring). One pair for most steps, because some pair fits almost any single
    direction (there are 8 others)."""
    fits: collections.Counter[tuple[int, int]] = collections.Counter()
    for state, action in zip(states, actions, strict=True):
        named = (state.block_index, state.target_index)
        errors = {
            pair: _angle(action, expert.act_with_label(_naming(state, pair))[1])
            for pair in itertools.product(range(NUM_OBJECTS), repeat=2)
        }
        if errors[named] > MISSES_DEG:
            fits.update(pair for pair, e in errors.items() if pair != named and e <= FITS_DEG)
    return bool(fits) and max(fits.values()) > len(actions) / 2


def misread_by_chance(states: list[list[Any]], expert: TableTopExpert, seed: int) -> float:
    """The share of episodes ``misread`` flags when every action is a random direction at full
    speed, in the same states: what the count means against chance."""
    rng = np.random.default_rng(seed)
    flagged = 0
    for episode in states:
        angles = rng.uniform(-np.pi, np.pi, len(episode))
        random_actions = [np.array([np.cos(a), np.sin(a)]) for a in angles]
        flagged += misread(episode, random_actions, expert)
    return flagged / max(len(states), 1)


def _naming(state: Any, pair: tuple[int, int]) -> Any:
    """``state`` with another (block, target) pair named."""
    return dataclasses.replace(state, block_index=pair[0], target_index=pair[1])


def failure_kind(actions: list[np.ndarray], speeds: list[float], tail: int) -> str:
    """``oscillating``, ``stalled`` or ``other`` (see the module docstring)."""
    acts, moving = np.array(actions[-tail:]), np.array(speeds[-tail:])
    if (moving < STALLED_SPEED).mean() > 0.5:
        return "stalled"
    if len(acts) > 1 and ((acts[1:] * acts[:-1]).sum(axis=1) < 0).mean() > 0.5:
        return "oscillating"
    return "other"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    episodes, tail = (4, 3) if args.smoke else (args.episodes, args.tail)
    cfg, policy, loaded = load_policy(args)
    states, success, final, actions, speeds = play(
        cfg, policy, episodes, args.seed, 6 if args.smoke else args.max_episode_steps
    )
    starts = [episode[0] for episode in states]
    failed = np.flatnonzero(~success)
    expert = TableTopExpert()
    misreads = [misread(states[i], actions[i], expert) for i in range(episodes)]
    kinds = collections.Counter(failure_kind(actions[i], speeds[i], tail) for i in failed)
    per_instruction: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for start, won in zip(starts, success, strict=True):
        key = f"{COLOURS[start.block_index]} -> {COLOURS[start.target_index]}"
        per_instruction[key][0] += 1
        per_instruction[key][1] += int(won)
    results = {
        "policy": loaded,
        "episodes": episodes,
        "success_rate": float(success.mean()),
        "failures": len(failed),
        "failure_kinds": {k: kinds.get(k, 0) for k in ("oscillating", "stalled", "other")},
        "misread_instruction": {
            "failures": int(sum(misreads[i] for i in failed)),
            "successes": int(sum(misreads[i] for i in np.flatnonzero(success))),
            "share_by_chance": misread_by_chance(states, expert, args.seed),
        },
        "failure_final_distance": {
            "median": float(np.median(final[failed])) if len(failed) else None,
            "share_within_0_3": float((final[failed] <= 0.3).mean()) if len(failed) else None,
        },
        "mean_length": {
            "success": float(np.mean([len(actions[i]) for i in np.flatnonzero(success)]))
            if success.any()
            else None,
            "failure": float(np.mean([len(actions[i]) for i in failed])) if len(failed) else None,
        },
        "success_by_instruction": {
            k: {"episodes": n, "success_rate": won / n}
            for k, (n, won) in sorted(per_instruction.items())
        },
    }
    print(f"{loaded}: greedy success {results['success_rate']:.3f} on {episodes} episodes")
    print(f"{'failures':<34}{len(failed):>6}")
    for kind, n in results["failure_kinds"].items():
        print(f"  {kind:<32}{n:>6}")
    misread_counts = results["misread_instruction"]
    print(
        f"  {'misread the instruction':<32}{misread_counts['failures']:>6}"
        f"   (successes that did: {misread_counts['successes']}; random directions in the same"
        f" states: {misread_counts['share_by_chance']:.0%} of episodes)"
    )
    dist = results["failure_final_distance"]
    if len(failed):
        print(
            f"  final block-to-target distance: median {dist['median']:.2f} (success <= 0.2), "
            f"{dist['share_within_0_3']:.0%} within 0.3"
        )
    BY_INSTRUCTION.print(
        (key, row["episodes"], row["success_rate"])
        for key, row in results["success_by_instruction"].items()
    )
    write_result(args.json, "tabletop_failures", results, vars(args))
    return results


if __name__ == "__main__":
    main()
