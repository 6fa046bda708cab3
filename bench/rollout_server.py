"""Rollout-server benchmark: the real ``RolloutServer`` against the raw ZeroMQ request-reply limit.

The server side is the real role, not a copy: ``harness.server_harness.ServerHarness`` runs
``roles.rollout_server``'s ``RolloutServer`` class in child processes (``Role.run()``: Redis
registration, heartbeats, ``setup()``, the ``step()`` loop with dynamic batching, the weights
thread), against a private embedded Redis, with this process acting as their weight broadcaster
(real ``Broadcaster`` and ``WeightLink``). The only instrumentation wraps ``_serve`` (and
``_receive_into_standby``) to record when each batch ran, how big it was and which weight
version served it.

(a) batch 1: one client doing strict request-reply (``ObsRequest`` -> ``ActionReply`` through our
    codec and DEALER/ROUTER; CartPole-sized MLP policy, 64x64) against the raw limit: a plain
    pyzmq ROUTER echoing pre-built reply bytes of the same sizes to a DEALER sending pre-built
    request bytes (no codec, no model). Between the two, to show where the gap is, two echo
    servers of our own in the same client's hands: ``codec echo`` (our socket and codec both
    ways, a constant action) and ``codec + policy echo`` (the same, acting with the policy's
    numpy path as ``_serve`` does). For each server, its process's CPU time per request (all
    threads, ZeroMQ's I/O thread included; from /proc).
(b) batched: one client process keeps 64 requests in flight on one DEALER (64 concurrent envs);
    obs/s, the mean batch the server actually formed and the fraction of the time it spent in
    ``_serve`` (from its own records; well below 1 means the client, not the server, limits).
    The headline client sends pre-encoded request bytes and only counts replies, so the server
    is what limits; a second client encodes and decodes every message (``batched_codec_*``),
    i.e. all 64 envs' codec work in one Python process. Their windows are interleaved.

Each figure is the median of ``--repeats`` windows of ``--duration-s`` seconds; the batch-1
cases run side by side (idle servers cost nothing) and their windows are interleaved, so a change
of load on the host hits them all alike. The server's own records split each batch-1 request into
``serve`` (``_serve``: stack, policy forward, replies) and ``between`` (the rest of the loop:
bookkeeping, ``_collect`` with its ``max_wait_ms``, and the client's round trip). Both are means,
so 1 / (serve + between) is about the request rate. The model part of ``serve`` is timed
separately in this process (``batch1_policy_act_ms``).

    python bench/rollout_server.py [--duration-s 3] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import harness.one_blas_thread  # noqa: F401  (first: numpy in this process on one BLAS thread)
import numpy as np
import torch
from harness.clients import batched_client, raw_client, strict_client
from harness.echo_servers import (
    CARTPOLE_HIDDEN,
    cartpole_policy,
    codec_echo_server,
    echo_server,
    raw_echo_server,
)
from harness.proc_stats import cpu_seconds, placed_apart
from harness.provenance import write_result
from harness.report import Table, benchmark_parser, host_line, host_record, load_average_1m
from harness.server_harness import ServerHarness, in_windows
from harness.wire_messages import obs_request

from rlvla3.config.run_config import config_from_dict


def _with_cpu(pid: int, window: Any) -> tuple[float, float, float, float]:
    """``window()``'s ``(rate, start, end)`` and server ``pid``'s CPU µs per request in it."""
    before = cpu_seconds(pid)
    rate, start, end = window()
    return rate, start, end, (cpu_seconds(pid) - before) / (rate * (end - start)) * 1e6


BATCH1_CASES = ("ours", "codec_policy_echo", "codec_echo", "raw")
"""The batch-1 servers, from the real role to the raw limit."""


def measure_batch1(duration_s: float, repeats: int, pin: bool) -> dict[str, Any]:
    """Median req/s and server CPU µs per request at batch 1 for each of ``BATCH1_CASES``,
    windows interleaved; how the real server's time splits (``_serve`` / the rest); and how
    the processes were placed (``placed_apart``)."""
    with (
        ServerHarness("bench_rs_b1", 1, CARTPOLE_HIDDEN) as ours,
        echo_server(codec_echo_server, True) as (policy_address, policy_pid),
        echo_server(codec_echo_server, False) as (codec_address, codec_pid),
        echo_server(raw_echo_server) as (raw_address, raw_pid),
        placed_apart([ours.procs[0].pid, policy_pid, codec_pid, raw_pid], pin) as placement,
    ):

        def raw_window() -> tuple[float, float, float]:
            start = time.monotonic()
            return raw_client(raw_address, duration_s), start, time.monotonic()

        cases = {
            "ours": (ours.procs[0].pid, lambda: strict_client(ours.addresses[0], duration_s)),
            "codec_policy_echo": (policy_pid, lambda: strict_client(policy_address, duration_s)),
            "codec_echo": (codec_pid, lambda: strict_client(codec_address, duration_s)),
            "raw": (raw_pid, raw_window),
        }
        runs: dict[str, list] = {key: [] for key in BATCH1_CASES}
        for _ in range(repeats):  # interleaved, so load changes on the host hit all alike
            for key in BATCH1_CASES:
                runs[key].append(_with_cpu(*cases[key]))
    result: dict[str, Any] = {"placement": placement}
    for key, found in runs.items():
        result[key] = statistics.median(rate for rate, *_ in found)
        result[f"{key}_cpu_us"] = statistics.median(cpu for *_, cpu in found)
    b = in_windows(ours.records[0]["batches"], [(s, e) for _, s, e, _ in runs["ours"]])
    gaps = b[1:, 0] - b[:-1, 1]
    gaps = gaps[gaps < 0.5]  # not across the windows of the other cases
    result["ours_serve_ms"] = float(np.mean(b[:, 1] - b[:, 0]) * 1000)
    result["ours_between_ms"] = float(np.mean(gaps) * 1000)
    return result


def measure_policy_act(seconds: float = 1.0) -> float:
    """Mean ms of the model part of one batch-1 ``_serve``, in this process: stack the obs and
    run the policy's numpy path (``act_numpy``, what a CPU server runs), values to floats (what
    a raw echo does not do)."""
    policy = cartpole_policy()
    obs = [obs_request(0).obs]
    rng = np.random.default_rng(0)
    count, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        out = policy.act_numpy({"state": np.array([o["state"] for o in obs])}, False, rng)
        out.log_prob.tolist(), out.value.tolist()
        count += 1
    return (time.monotonic() - started) / count * 1000


def measure_batched(inflight: int, duration_s: float, repeats: int) -> dict[str, dict]:
    """Median obs/s with ``inflight`` outstanding requests, and what the server did meanwhile
    (mean batch, median batch time, fraction of the time in ``_serve``); for a pre-encoding
    client (``raw``) and a codec client (``codec``), windows interleaved. Left unpinned: the
    server's throughput is the figure, and one core for the server and its I/O thread both
    costs it (about 69k obs/s against 81k on the 2-core machine)."""
    with ServerHarness("bench_rs_batched", 1, CARTPOLE_HIDDEN, {"max_batch": inflight}) as h:
        runs: dict[str, list] = {"raw": [], "codec": []}
        for _ in range(repeats):
            for kind, found in runs.items():
                found.append(batched_client(h.addresses[0], inflight, duration_s, kind == "codec"))
    results = {}
    for kind, found in runs.items():
        batches = in_windows(h.records[0]["batches"], [(start, end) for _, start, end in found])
        serving = (batches[:, 1] - batches[:, 0]).sum() / sum(
            end - start for _, start, end in found
        )
        results[kind] = {
            "obs_per_s": statistics.median(rate for rate, _, _ in found),
            "mean_batch": float(batches[:, 2].mean()),
            "batch_ms": float(np.median(batches[:, 1] - batches[:, 0]) * 1000),
            "busy": float(serving),
        }
    return results


def run(duration_s: float, repeats: int, inflight: int, pin: bool) -> dict[str, Any]:
    """Every measurement, one after the other (never two clients at once)."""
    b1 = measure_batch1(duration_s, repeats, pin)
    act_ms = measure_policy_act()
    batched = measure_batched(inflight, duration_s, repeats)
    return {
        "placement": b1["placement"],
        **{f"batch1_{key}_req_per_s": round(b1[key], 1) for key in BATCH1_CASES},
        **{f"batch1_{key}_server_cpu_us": round(b1[f"{key}_cpu_us"], 1) for key in BATCH1_CASES},
        "batch1_ratio": round(b1["ours"] / b1["raw"], 3),
        "batch1_codec_policy_echo_ratio": round(b1["codec_policy_echo"] / b1["raw"], 3),
        "batch1_codec_echo_ratio": round(b1["codec_echo"] / b1["raw"], 3),
        "batch1_server_serve_ms": round(b1["ours_serve_ms"], 3),
        "batch1_server_between_batches_ms": round(b1["ours_between_ms"], 3),
        "batch1_policy_act_ms": round(act_ms, 3),
        "batched_inflight": inflight,
        "batched_obs_per_s": round(batched["raw"]["obs_per_s"], 1),
        "batched_mean_batch": round(batched["raw"]["mean_batch"], 2),
        "batched_median_batch_ms": round(batched["raw"]["batch_ms"], 3),
        "batched_server_busy_fraction": round(batched["raw"]["busy"], 3),
        "batched_codec_client_obs_per_s": round(batched["codec"]["obs_per_s"], 1),
        "batched_codec_client_mean_batch": round(batched["codec"]["mean_batch"], 2),
        "batched_codec_client_server_busy_fraction": round(batched["codec"]["busy"], 3),
    }


def print_table(r: dict[str, Any], inflight: int) -> None:
    """The figures, one line per case."""
    wait_ms = config_from_dict({}).role_settings("rollout_server").max_wait_ms
    labels = {
        "ours": f"RolloutServer (max_wait_ms {wait_ms:g})",
        "codec_policy_echo": "codec + policy echo",
        "codec_echo": "codec echo",
        "raw": "raw ZeroMQ echo",
    }
    batch1 = Table.from_layout(
        "batch 1 (one strict client):<34 | req/s:>9.0f | / raw:>6.2f | server CPU/req:>15"
    )
    batch1.print(
        (
            labels[key],
            r[f"batch1_{key}_req_per_s"],
            r[f"batch1_{key}_req_per_s"] / r["batch1_raw_req_per_s"],
            f"{r[f'batch1_{key}_server_cpu_us']:.1f} us",
        )
        for key in BATCH1_CASES
    )
    print(
        f"{'':34} RolloutServer per request: _serve {r['batch1_server_serve_ms']:.3f} ms "
        f"(the policy alone, in-process: {r['batch1_policy_act_ms']:.3f}), the rest of the "
        f"loop {r['batch1_server_between_batches_ms']:.3f} ms"
    )
    print(f"{'':34} {'obs/s':>9}")
    for label, key in (("", ""), (", codec client", "_codec_client")):
        case = f"{inflight} in flight{label}, obs/s"
        print(
            f"{case:34} {r[f'batched{key}_obs_per_s']:9.0f}  "
            f"mean batch {r[f'batched{key}_mean_batch']:.1f}, "
            f"server busy {r[f'batched{key}_server_busy_fraction']:.0%}"
        )
    print(f"batch 1 placement: {r['placement']}")
    print(host_line(r["host"]))


def main() -> None:
    parser = benchmark_parser(__doc__, smoke_help="a few seconds of each case, for CI")
    parser.add_argument("--duration-s", type=float, default=3.0, help="seconds per window")
    parser.add_argument("--repeats", type=int, default=3, help="windows per case; median kept")
    parser.add_argument("--inflight", type=int, default=64, help="concurrent envs for (b)")
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="leave the client and servers to the scheduler (default: client and servers on "
        "CPUs of their own, every case alike)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.duration_s, args.repeats, args.inflight = 0.5, 1, 8
    torch.set_num_threads(1)
    load_before = load_average_1m()
    r: dict[str, Any] = run(args.duration_s, args.repeats, args.inflight, not args.no_pin)
    r["host"] = host_record(load_before)
    print_table(r, args.inflight)
    write_result(args.json, "rollout_server", r, vars(args))


if __name__ == "__main__":
    main()
