"""Simulator throughput: env steps per second of one adapter instance in one process.

Random actions (``action_space.sample()``, seeded), episodes reset when they end (the reset time
counts, as in an env worker). Setup (construction, first reset, and ``--warmup`` steps: for
ManiSkill rgb that includes SAPIEN's one-off first-frame cost on lavapipe) is timed separately and
not in steps/s. Each case stops after ``--steps`` steps or ``--max-seconds``, whichever first.

Cases: ``CartPole-v1`` (state), ``rlvla3/TableTop-v0`` (state, rgb), ``maniskill/PickCube-v1``
(state, rgb; pd_ee_delta_pose, physx_cpu + lavapipe) when mani_skill imports and a Vulkan
driver works, else skipped with the reason.

Usage: ``python bench/sim_throughput.py [--steps 2000] [--max-seconds 30] [--warmup 5]
[--only SUBSTR] [--json PATH]``; the JSON maps case name -> steps/s (skipped cases left out).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from dataclasses import dataclass
from typing import Any

from harness.provenance import write_result
from harness.report import Table, benchmark_parser

from sim.adapter import SimAdapter
from sim.envs import make_env


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One benchmark case: ``make_env(env_id, seed=0, **kwargs)``, reported as ``name``."""

    name: str
    env_id: str
    kwargs: dict[str, Any]
    needs: str | None = None  # an importable module the case needs


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """Measured figures of one case: steps and seconds of the timed loop, setup seconds."""

    name: str
    steps: int
    episodes: int
    elapsed_s: float
    setup_s: float

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.elapsed_s if self.elapsed_s > 0 else float("nan")


CASES = (
    Case(name="CartPole-v1:state", env_id="CartPole-v1", kwargs={}),
    Case(
        name="rlvla3/TableTop-v0:state", env_id="rlvla3/TableTop-v0", kwargs={"obs_mode": "state"}
    ),
    Case(name="rlvla3/TableTop-v0:rgb", env_id="rlvla3/TableTop-v0", kwargs={"obs_mode": "rgb"}),
    Case(
        name="maniskill/PickCube-v1:state",
        env_id="maniskill/PickCube-v1",
        kwargs={"obs_mode": "state"},
        needs="mani_skill",
    ),
    Case(
        name="maniskill/PickCube-v1:rgb",
        env_id="maniskill/PickCube-v1",
        kwargs={"obs_mode": "rgb", "image_size": 64},
        needs="mani_skill",
    ),
)


TABLE = Table.from_layout("case:<32 | steps/s:>10.1f | steps:>7d | episodes:>8d | setup s:>8.1f")


def _timed_loop(env: SimAdapter, max_steps: int, max_seconds: float) -> tuple[int, int, float]:
    """Step with random actions; returns (steps, finished episodes, seconds)."""
    steps = episodes = 0
    start = time.perf_counter()
    deadline = start + max_seconds
    while steps < max_steps:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        steps += 1
        if terminated or truncated:
            episodes += 1
            env.reset()
        if steps % 10 == 0 and time.perf_counter() > deadline:
            break
    return steps, episodes, time.perf_counter() - start


def run_case(case: Case, *, steps: int, max_seconds: float, warmup: int) -> Result:
    """Build the env, reset, take ``warmup`` steps (setup), then time the stepping loop."""
    t0 = time.perf_counter()
    env = make_env(case.env_id, seed=0, **case.kwargs)
    env.action_space.seed(0)
    env.reset()
    for _ in range(warmup):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            env.reset()
    setup_s = time.perf_counter() - t0
    try:
        n, episodes, elapsed = _timed_loop(env, steps, max_seconds)
    finally:
        env.close()
    return Result(name=case.name, steps=n, episodes=episodes, elapsed_s=elapsed, setup_s=setup_s)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, smoke_help="50 steps per case, for CI")
    p.add_argument("--steps", type=int, default=2000, help="max timed steps per case")
    p.add_argument("--max-seconds", type=float, default=30.0, help="max timed seconds per case")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps after the first reset")
    p.add_argument("--only", default="", help="run only cases whose name contains this")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.smoke:
        args.steps, args.max_seconds, args.warmup = 50, 2.0, 1
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    print(TABLE.header())
    figures: dict[str, float] = {}
    for case in CASES:
        if args.only not in case.name:
            continue
        if case.needs is not None and importlib.util.find_spec(case.needs) is None:
            print(f"{case.name:32s} skipped: {case.needs} is not installed", flush=True)
            continue
        try:
            r = run_case(case, steps=args.steps, max_seconds=args.max_seconds, warmup=args.warmup)
        except (ImportError, RuntimeError) as exc:  # no Vulkan driver: RuntimeError from SAPIEN
            print(f"{case.name:32s} skipped: {type(exc).__name__}: {exc}", flush=True)
            continue
        figures[case.name] = r.steps_per_s
        print(TABLE.row(r.name, r.steps_per_s, r.steps, r.episodes, r.setup_s), flush=True)
    write_result(args.json, "sim_throughput", figures, vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
