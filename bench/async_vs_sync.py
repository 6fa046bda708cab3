"""Asynchrony benchmark: the real launcher and roles in ``sync``, ``async_rollout`` and ``async``.

One workload for all three modes: ``--num-envs`` envs (over ``--num-workers`` env workers) whose
every step takes an extra heavy-tailed latency (``sim/straggler.py``: lognormal with the given
mean and sigma), PPO training as usual. Each mode runs for ``--duration-s`` seconds of steady
state (after ``--warmup-s``); env steps/s is read from the run's Redis counters. The no-wait bound
is what the envs could do if no env ever waited for anything: num_envs / mean step latency,
with the latency as configured (``bound_env_steps_per_s``, ``efficiency_async``: the strict
figures) and as the async run's simulators actually took it (``bound_measured_env_steps_per_s``,
``efficiency_async_measured``): ``time.sleep`` overshoots each injected delay by ~0.1-0.2 ms on
this machine, and the simulator's own step adds to it, in every mode alike.
Each mode also reports where one env's time goes per step (``per_step_ms``, from the env
workers' counters): ``env_step`` (the simulator, injected latency included), ``action_wait`` (one
request's round trip to a rollout server) and ``other`` (chunk building, the lock-step barrier
in sync mode, waiting for the CPU).

    python bench/async_vs_sync.py [--num-envs 16] [--latency-mean-ms 20] [--latency-sigma 1.0]
                                  [--duration-s 30] [--transport tcp|ipc] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from harness.mode_rates import measure_rates, mode_roles
from harness.provenance import write_result
from harness.report import Table, add_straggler_flags, benchmark_parser

from rlvla3.launch.redis_server import EmbeddedRedis

MODES = ("sync", "async_rollout", "async")
TABLE = Table.from_layout(
    "mode:<14 | env steps/s:>12.1f | vs sync:>8 | of bound:>9.1%"
    " | ms/step: env:>13.2f | action:>7.2f | other:>6.2f"
)


def run_config(args: argparse.Namespace, mode: str, redis_url: str) -> dict:
    per_worker = args.num_envs // args.num_workers
    cfg = {
        "run": {
            "name": f"bench_{mode}",
            "mode": mode,
            "redis_url": redis_url,
            "transport": args.transport,
            "progress_interval_s": 3600,
            "stop": {"max_wall_s": args.warmup_s + args.duration_s + 120},
        },
        "roles": mode_roles(args.num_workers, args.num_envs),
        "env": {
            "id": args.env,
            "num_envs_per_worker": per_worker,
            "envs_per_request": args.envs_per_request,
            "chunk_len": args.chunk_len,
            "kwargs": json.loads(args.env_kwargs),
            "straggler": {
                "distribution": "lognormal",
                "mean_ms": args.latency_mean_ms,
                "sigma": args.latency_sigma,
            },
        },
        "algo": {"epochs": 2, "minibatch_size": 256},
    }
    for role, cpus in args.cpus:
        cfg["roles"][role]["cpus"] = cpus
    return cfg


def role_cpus(text: str) -> tuple[str, list[int]]:
    """``--cpus`` entry ``ROLE=ID[,ID...]``, e.g. ``rollout_server=1``."""
    role, sep, ids = text.partition("=")
    if not sep or role not in ("env_worker", "rollout_server", "trainer", "weight_broadcaster"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected ROLE=ID[,ID...], e.g. rollout_server=1"
        )
    try:
        return role, [int(i) for i in ids.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: CPU ids must be integers") from None


def measure_mode(args: argparse.Namespace, mode: str, redis_url: str, workdir: Path) -> dict:
    """Launch one mode, wait for steady state, measure env steps/s over the window, stop it."""
    cfg = run_config(args, mode, redis_url)
    return measure_rates(cfg, args.num_envs, workdir, args.warmup_s, args.duration_s)


def parse_args() -> argparse.Namespace:
    parser = benchmark_parser(__doc__, smoke_help="a few seconds of each case, for CI")
    add_straggler_flags(parser, latency_mean_ms=20.0, duration_s=30.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--chunk-len", type=int, default=32)
    parser.add_argument(
        "--envs-per-request",
        type=int,
        default=1,
        help="env.envs_per_request: a group's envs step one after another, so the no-wait "
        "bound is num_envs / (envs_per_request x mean latency)",
    )
    parser.add_argument("--env", default="CartPole-v1", help="any env id make_env accepts")
    parser.add_argument("--env-kwargs", default="{}", help='JSON, e.g. \'{"obs_mode": "state"}\'')
    parser.add_argument("--transport", default="tcp", choices=("tcp", "ipc"))
    parser.add_argument(
        "--cpus",
        nargs="+",
        type=role_cpus,
        default=[],
        metavar="ROLE=IDS",
        help="pin roles to CPUs (roles.<role>.cpus), e.g. env_worker=0 rollout_server=1",
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args()
    if args.smoke:
        args.duration_s, args.warmup_s, args.num_envs = 3.0, 2.0, 4
    if args.num_envs % args.num_workers:
        parser.error("--num-envs must be a multiple of --num-workers")
    return args


def summarise(args: argparse.Namespace, results: dict[str, dict]) -> dict:
    """The JSON's results: the workload, each mode's figures, and the modes against each other
    and against the no-wait bound (configured, and as async's simulators took it)."""
    bound = args.num_envs / (args.envs_per_request * args.latency_mean_ms / 1000)
    rates = {m: r["env_steps_per_s"] for m, r in results.items()}
    measured_bound = (
        args.num_envs / (args.envs_per_request * results["async"]["per_step_ms"]["env_step"] / 1000)
        if "async" in results
        else None
    )
    return {
        "workload": {
            "env": args.env,
            "num_envs": args.num_envs,
            "num_workers": args.num_workers,
            "envs_per_request": args.envs_per_request,
            "latency_mean_ms": args.latency_mean_ms,
            "latency_sigma": args.latency_sigma,
            "duration_s": args.duration_s,
        },
        "env_steps_per_s": rates,
        "trained_samples_per_s": {m: r["trained_samples_per_s"] for m, r in results.items()},
        "per_step_ms": {m: r["per_step_ms"] for m, r in results.items()},
        "bound_env_steps_per_s": bound,
        "ratio_vs_sync": {m: rates[m] / rates["sync"] for m in rates} if "sync" in rates else {},
        "speedup_async_vs_sync": rates["async"] / rates["sync"]
        if {"async", "sync"} <= set(rates)
        else None,
        "efficiency_async": rates["async"] / bound if "async" in rates else None,
        "bound_measured_env_steps_per_s": measured_bound,
        "efficiency_async_measured": rates["async"] / measured_bound if measured_bound else None,
    }


def print_table(report: dict) -> None:
    """One line per mode, then the no-wait bounds."""
    rates, bound = report["env_steps_per_s"], report["bound_env_steps_per_s"]
    measured_bound = report["bound_measured_env_steps_per_s"]
    print(TABLE.header())
    for mode, rate in rates.items():
        vs = f"{rate / rates['sync']:.2f}x" if "sync" in rates else "-"
        ms = report["per_step_ms"][mode]
        print(
            TABLE.row(mode, rate, vs, rate / bound, ms["env_step"], ms["action_wait"], ms["other"])
        )
    print(f"{'no-wait bound':14s} {bound:12.1f}   (configured latency)")
    if measured_bound:
        print(
            f"{'no-wait bound':14s} {measured_bound:12.1f}   (async's measured simulator step:"
            f" async at {rates['async'] / measured_bound:.1%})"
        )


def main() -> None:
    args = parse_args()
    results: dict[str, dict] = {}
    with EmbeddedRedis() as redis, tempfile.TemporaryDirectory(prefix="rlvla3-bench-") as tmp:
        for mode in args.modes:
            results[mode] = measure_mode(args, mode, redis.url, Path(tmp))
            print(f"{mode:14s} {results[mode]['env_steps_per_s']:8.1f} env steps/s", flush=True)
    report = summarise(args, results)
    print()
    print_table(report)
    write_result(args.json, "async_vs_sync", report, vars(args))


if __name__ == "__main__":
    main()
