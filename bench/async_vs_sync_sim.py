"""Asynchrony on real simulators: ``sync``, ``async_rollout`` and ``async`` on LIBERO and ManiSkill3.

The sibling of ``bench/async_vs_sync.py`` (same launcher, roles and figures) without injected
latency: the simulator's own step is the workload. LIBERO: ``libero/libero_spatial/0`` with
LIBERO's renders (two 128 px cameras, shadows, reflections, MSAA; software EGL or OSMesa without
a GPU). ManiSkill3: ``maniskill/PickCube-v1`` from 64 px camera images (its assets come with the
package; SAPIEN on a CPU Vulkan driver here). All modes run the same small VLA of ours
(``policy.kind: vla``, untrained: this measures throughput, not learning) and PPO as usual.
``--num-envs`` envs over ``--num-workers`` env workers (default: two envs per core, one worker
per core). Each mode runs ``--duration-s`` of steady state after ``--warmup-s``.

On a shared host the load drifts: the modes are interleaved (repeat 1: sync, async,
async_rollout; repeat 2 the reverse; and so on) and every mode's figures carry the 1-minute load
average before and after it. The no-wait bound is async_vs_sync.py's measured one:
num_envs / (envs_per_request x the async run's mean simulator step).
A simulator that is not installed, or does not step here (``sim/env_probe.py``), is skipped
with the reason; ``--smoke`` then exits 0, a full run exits 1 when nothing could run.

    python bench/async_vs_sync_sim.py --sims libero [--num-envs 4] [--num-workers 2]
        [--duration-s 45] [--warmup-s 10] [--repeats 2] [--json PATH]

``--smoke``: sync and async once each, 2 envs in one worker, seconds of each (minutes in all
where the simulators are installed: building their first env is most of it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.mode_rates import measure_rates, mode_roles
from harness.provenance import write_result
from harness.report import Table, benchmark_parser, host_record, load_average_1m

from rlvla3.launch.redis_server import EmbeddedRedis
from sim.env_probe import env_unavailable

ORDERS = (("sync", "async", "async_rollout"), ("async_rollout", "async", "sync"))
"""Mode order of odd and even repeats: each mode runs early and late under the drifting load."""
SMOKE_ORDERS = (("sync", "async"),)
"""``--smoke``: the two modes the gain compares (a simulator's first env is most of its cost)."""
REFERENCE_GAIN_PCT = {"seed_paper_libero": 126.67, "rl_vla3_low": 59.0, "rl_vla3_high": 85.0}
"""Published env-throughput gains of async over sync, percent (issue 35)."""
VLA = {"d_model": 64, "num_layers": 2, "num_heads": 4, "action_head": "gaussian"}
"""The policy of every mode: the VLA transformer at the table-top recipes' size."""
TABLE = Table.from_layout(
    "repeat:>6 | mode:<14 | env steps/s:>12.2f | vs sync:>8 | of bound:>9.1%"
    " | ms/step: env:>13.1f | action:>7.1f | other:>7.1f | load:>10"
)


@dataclass(frozen=True, slots=True)
class SimWorkload:
    """One simulator's case."""

    env_id: str
    """The env every worker runs."""
    kwargs: dict[str, Any]
    """Its ``env.kwargs``."""
    patch_size: int
    """VLA patch side (64 patches per image either way)."""
    chunk_len: int
    """Steps per chunk: a sync round is num_envs x chunk_len steps, several per window."""
    run: dict[str, Any]
    """``run`` keys of its own: the liveness limits a slow first render needs."""


SLOW_START = {"heartbeat_ttl_s": 120.0, "stall_timeout_s": 300.0}
"""The liveness limits of both simulators' runs."""

SIMS = {
    # Building the env freezes a process with the GIL held for seconds (LIBERO's model compile
    # and GL context) to tens of seconds (SAPIEN's first picture in lavapipe, docs/maniskill.md)
    # under load: every role that reads the env's spaces does it, beyond the default 5 s TTL.
    "libero": SimWorkload("libero/libero_spatial/0", {"image_size": 128}, 16, 8, SLOW_START),
    "maniskill": SimWorkload(
        "maniskill/PickCube-v1", {"obs_mode": "rgb", "image_size": 64}, 8, 16, SLOW_START
    ),
}


def run_config(args: argparse.Namespace, sim: SimWorkload, mode: str, redis_url: str) -> dict:
    """The run of one mode; a name of its own, so that no run reads another's counters."""
    return {
        "run": {
            "name": f"bench_{sim.env_id.split('/')[0]}_{mode}_{time.monotonic_ns()}",
            "mode": mode,
            "redis_url": redis_url,
            "progress_interval_s": 3600,
            "stop": {"max_wall_s": args.warmup_s + args.duration_s + 600},
            **sim.run,
        },
        "roles": mode_roles(args.num_workers, args.num_envs),
        "env": {
            "id": sim.env_id,
            "num_envs_per_worker": args.num_envs // args.num_workers,
            "chunk_len": sim.chunk_len,
            "kwargs": sim.kwargs,
        },
        "policy": {"kind": "vla", "vla": {**VLA, "patch_size": sim.patch_size}},
        "algo": {"epochs": 2, "minibatch_size": 64},
    }


def measure_sim(args: argparse.Namespace, sim: SimWorkload, redis_url: str) -> list[dict]:
    """Every repeat's modes, in the repeat's order: rates, per-step times and the load."""
    repeats = []
    with tempfile.TemporaryDirectory(prefix="rlvla3-bench-sim-") as tmp:
        for repeat in range(args.repeats):
            modes: dict[str, dict] = {}
            for mode in args.orders[repeat % len(args.orders)]:
                load_before, started = load_average_1m(), time.monotonic()
                cfg = run_config(args, sim, mode, redis_url)
                got = measure_rates(cfg, args.num_envs, Path(tmp), args.warmup_s, args.duration_s)
                modes[mode] = {**got, "host": host_record(load_before)}
                modes[mode]["wall_s"] = time.monotonic() - started
                print(
                    f"  repeat {repeat + 1} {mode:14s} {got['env_steps_per_s']:7.2f} env steps/s",
                    flush=True,
                )
            repeats.append(summarise_repeat(args, modes))
    return repeats


def summarise_repeat(args: argparse.Namespace, modes: dict[str, dict]) -> dict:
    """One repeat: each mode's figures, async's gain over sync and the no-wait bound."""
    rates = {m: r["env_steps_per_s"] for m, r in modes.items()}
    bound = args.num_envs / (modes["async"]["per_step_ms"]["env_step"] / 1000)
    return {
        "order": list(modes),
        "modes": modes,
        "ratio_vs_sync": {m: rates[m] / rates["sync"] for m in rates},
        "gain_async_vs_sync_pct": (rates["async"] / rates["sync"] - 1) * 100,
        "bound_measured_env_steps_per_s": bound,
        "efficiency_async_measured": rates["async"] / bound,
    }


def print_table(sim_name: str, repeats: list[dict]) -> None:
    print(f"\n{sim_name}: {SIMS[sim_name].env_id}")
    print(TABLE.header())
    for i, rep in enumerate(repeats, 1):
        for mode, r in rep["modes"].items():
            ms, host = r["per_step_ms"], r["host"]
            load = f"{host['load_avg_1m_before']:.1f}->{host['load_avg_1m_after']:.1f}"
            vs = f"{rep['ratio_vs_sync'][mode]:.2f}x"
            of_bound = r["env_steps_per_s"] / rep["bound_measured_env_steps_per_s"]
            row = (i, mode, r["env_steps_per_s"], vs, of_bound, ms["env_step"])
            print(TABLE.row(*row, ms["action_wait"], ms["other"], load))
        print(
            f"{'':6s} async vs sync {rep['gain_async_vs_sync_pct']:+.1f}%, no-wait bound"
            f" {rep['bound_measured_env_steps_per_s']:.2f} env steps/s"
        )
    ref = REFERENCE_GAIN_PCT
    print(
        f"published: +{ref['seed_paper_libero']}% (seed paper, LIBERO),"
        f" +{ref['rl_vla3_low']:.0f}..+{ref['rl_vla3_high']:.0f}% (RL-VLA3)"
    )


def parse_args() -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__, smoke_help="seconds of each mode, once; skips absent simulators"
    )
    cores = os.cpu_count() or 1
    parser.add_argument("--sims", nargs="+", default=list(SIMS), choices=list(SIMS))
    parser.add_argument("--num-envs", type=int, default=2 * cores)
    parser.add_argument("--num-workers", type=int, default=cores)
    parser.add_argument("--duration-s", type=float, default=45.0)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.smoke:
        args.duration_s, args.warmup_s, args.num_envs, args.num_workers = 2.0, 1.0, 2, 1
        args.repeats = 1
    args.orders = SMOKE_ORDERS if args.smoke else ORDERS
    if args.num_envs % args.num_workers:
        parser.error("--num-envs must be a multiple of --num-workers")
    return args


def main() -> None:
    args = parse_args()
    report: dict[str, Any] = {"reference_gain_pct": REFERENCE_GAIN_PCT}
    with EmbeddedRedis() as redis:
        for name in args.sims:
            sim = SIMS[name]
            why = env_unavailable(sim.env_id, json.dumps(sim.kwargs))
            if why is not None:
                print(f"{name}: skipped: {why}", flush=True)
                report[name] = {"skipped": why}
                continue
            print(f"{name}: {args.num_envs} envs over {args.num_workers} env workers", flush=True)
            repeats = measure_sim(args, sim, redis.url)
            gains = [r["gain_async_vs_sync_pct"] for r in repeats]
            report[name] = {
                "workload": {"env_id": sim.env_id, "env_kwargs": sim.kwargs, "vla": VLA},
                "repeats": repeats,
                "gain_async_vs_sync_pct": {"each": gains, "mean": sum(gains) / len(gains)},
            }
            print_table(name, repeats)
    write_result(args.json, "async_vs_sync_sim", report, vars(args))
    if not args.smoke and all("skipped" in report[name] for name in args.sims):
        sys.exit("no simulator could run here")


if __name__ == "__main__":
    main()
