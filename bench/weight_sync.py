"""Weight-sync benchmark: our broadcaster -> 2 rollout servers against one raw broadcast.

``--device`` picks where the weights live and the library: ``cpu`` (gloo, the default and what
the text below describes), ``cuda`` (NCCL: all three processes on GPU 0, each with its own
``NCCL_HOSTID``; a receiver timestamps after ``torch.cuda.synchronize()``) or ``cuda-gloo``
(GPU 0 without host ids: our links and the raw broadcast run gloo on CUDA tensors). The CUDA
modes measure (a) and (b) only.

For each model size (an MLP policy of width 1024 on CartPole spaces, deep enough for ``--sizes``
float32 parameters; one flat buffer of exactly that many floats everywhere):

(a) ours: ``Broadcaster.publish(version, flat)`` over our pairwise ``WeightLink``s to 2 receiver
    processes that run the rollout server's receive call (``WeightLink.recv`` into a preallocated
    flat buffer). Each receiver timestamps the moment ``recv`` returns; ``ours_s`` is the last of
    those minus the moment ``publish`` began (``time.monotonic``: CLOCK_MONOTONIC, one clock for
    all processes of a Linux host). ``ours_publish_s`` is how long ``publish`` itself took.
(b) raw: the limit of the same library: a plain ``init_process_group("gloo")`` of world size 3
    (this process rank 0, fresh TCP init method on a free port) and ONE ``dist.broadcast`` of a
    buffer of the same bytes, timed the same way. Both run between the same processes (the
    receivers hold a link and the world-3 group), each round after a barrier of all three;
    rounds of (a) and (b) alternate, the first of each is a warm-up (``--repeats`` timed rounds
    at 100M parameters, proportionally more, up to 5x, for smaller models). Ratio = ours / raw
    of the medians; the bests (``*_best_s``, ``ratio_best``) are less exposed to other load.
(c) serving gap: 2 real rollout servers (``roles.rollout_server.RolloutServer`` driven standalone
    by ``harness.server_harness.ServerHarness``: real serving loop, real weights thread, double
    buffering, this process their broadcaster) serve a client that keeps one request in flight
    per server, while new versions are published. Per sync, the window runs from the
    start of ``publish`` to the first reply carrying the new version; ``max_serving_gap_ms`` is
    the longest interval between consecutive replies of one server that overlaps the window
    (median over ``--syncs``; ``worst_serving_gap_ms`` the largest), against
    ``baseline_max_gap_ms``, the longest in a quiet ``--baseline-s`` window before the first
    sync. The servers' own records add: ``batch_ms`` (median ``_serve`` time, quiet), the
    longest batch and the longest idle stretch between batches in each window (``sync_*``)
    and in the quiet one (``baseline_*``), and, after ``publish`` began, when the weights
    thread had the version's header (``serving_received_s``: the transfer into the standby
    copy's own parameters begins), had every weight in place (``serving_loaded_s``) and when a
    reply first carried it (``serving_visible_s``).

The served model is the synced model, so one batch of the 100M MLP is a forward pass through
400 MB of weights. The servers' initial weights are not initialised (the first broadcast
overwrites them before anything is served): ``orthogonal_`` of 100M parameters takes minutes.

The JSON also records the host's CPU count and load average: on a shared host, other processes'
load shows up in every figure here, most in the serving gaps.

    python bench/weight_sync.py [--sizes 10e6 100e6] [--repeats 5] [--syncs 3]
                                [--device cpu|cuda|cuda-gloo] [--json PATH]
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import zmq
from harness.provenance import write_result
from harness.report import (
    Column,
    Table,
    benchmark_parser,
    host_line,
    host_record,
    load_average_1m,
)
from harness.server_harness import ServerHarness, policy_numel, server_config
from harness.wire_messages import HOST, obs_request

from transport import sockets
from transport.weight_fanout import Broadcaster
from transport.weights import WeightLink, start_store

WIDTH = 1024
TIMEOUT = datetime.timedelta(seconds=300)
_CTX = mp.get_context("forkserver")  # children fork from one process that imported torch


def hidden_sizes(params: float) -> tuple[int, ...]:
    """Hidden layers of width ``WIDTH`` giving the actor + critic MLP about ``params`` weights."""
    return (WIDTH,) * (max(1, round(params / (2 * WIDTH * WIDTH))) + 1)


# --- (a) ours and (b) raw: the same two idle receiver processes for both ------------------------
# --device: where the weights live, and the library of the raw world-of-3 broadcast.
DEVICES = {"cpu": ("cpu", "gloo"), "cuda": ("cuda", "nccl"), "cuda-gloo": ("cuda", "gloo")}


def _use_device(device: str, rank: int) -> str:
    """Set this process up for ``--device`` ``device``; returns the torch device. On CUDA every
    process of the benchmark shares GPU 0. ``cuda`` gives each its own ``NCCL_HOSTID`` so NCCL
    links them (over its socket transport) instead of refusing a duplicate GPU; ``cuda-gloo``
    gives none, so our links fall back to gloo on the CUDA tensors, as without
    ``run.nccl_shared_gpu``."""
    torch_device, _ = DEVICES[device]
    if device == "cuda":
        os.environ["NCCL_HOSTID"] = f"rlvla3-weight-sync-{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    else:
        os.environ.pop("NCCL_HOSTID", None)
    if torch_device == "cuda":
        torch.cuda.set_device(0)
    return torch_device


def _arrived(device: str) -> float:
    """Now, once this process's copy of the buffer is complete (NCCL returns before the GPU
    has finished)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.monotonic()


def _receiver(
    rank: int,
    device: str,
    init_method: str,
    store_port: int,
    numels: list[int],
    rounds: list[int],
    done: Any,
) -> None:
    """Process entry: per size, ``rounds[i]`` times one version over our ``WeightLink`` and then
    one plain broadcast in the world of 3 (each after a barrier), timestamping arrivals."""
    torch.set_num_threads(1)
    torch_device, world = _use_device(device, rank), DEVICES[device][1]
    store = dist.TCPStore(HOST, store_port, is_master=False)
    link = WeightLink(store, f"r{rank}", 1, torch_device, TIMEOUT.total_seconds())
    dist.init_process_group(
        world, init_method=init_method, rank=rank, world_size=3, timeout=TIMEOUT
    )
    for numel, count in zip(numels, rounds, strict=True):
        flat = torch.empty(numel, device=torch_device)
        for _ in range(count):
            dist.barrier()
            link.recv(flat)
            done.put((link.backend, _arrived(device)))
            dist.barrier()
            dist.broadcast(flat, src=0)
            done.put((world, _arrived(device)))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _last_arrival(done: Any, backends: set[str]) -> float:
    """When the later of the two receivers had the buffer; records which library carried it."""
    arrivals = [done.get(timeout=TIMEOUT.total_seconds()) for _ in range(2)]
    backends.update(backend for backend, _ in arrivals)
    return max(t for _, t in arrivals)


def timed_rounds(numel: int, repeats: int) -> int:
    """``repeats`` rounds for a 100M model, more (up to 5x) for smaller, cheaper ones."""
    return max(repeats, min(5 * repeats, round(repeats * 1e8 / numel)))


def measure_transfer(numels: list[int], repeats: int, device: str = "cpu") -> list[dict[str, Any]]:
    """Per size, median seconds until both receivers hold the buffer: ours (and ``publish()``
    alone) and raw. Rounds alternate; the first of each size is a warm-up."""
    torch_device, world = _use_device(device, 0), DEVICES[device][1]
    broadcaster = Broadcaster(start_store(HOST), torch_device, timeout_s=TIMEOUT.total_seconds())
    done, init_method = _CTX.Queue(), f"tcp://{HOST}:{_free_port()}"
    rounds = [timed_rounds(numel, repeats) + 1 for numel in numels]
    args = (device, init_method, broadcaster.store.port, numels, rounds, done)
    procs = [_CTX.Process(target=_receiver, args=(rank, *args), daemon=True) for rank in (1, 2)]
    for proc in procs:
        proc.start()
    results = []
    try:
        for rank in (1, 2):
            broadcaster.add(f"r{rank}")
        dist.init_process_group(
            world, init_method=init_method, rank=0, world_size=3, timeout=TIMEOUT
        )
        for numel, count in zip(numels, rounds, strict=True):
            flat = torch.empty(numel, device=torch_device).uniform_(-0.05, 0.05)
            times: dict[str, list[float]] = {"ours": [], "raw": [], "publish": []}
            ours, raw = set(), set()
            for version in range(count):
                dist.barrier()  # all three ready before either clock starts
                started = time.monotonic()
                broadcaster.publish(version, flat)
                times["publish"].append(time.monotonic() - started)
                times["ours"].append(_last_arrival(done, ours) - started)
                dist.barrier()
                started = time.monotonic()
                dist.broadcast(flat, src=0)
                times["raw"].append(_last_arrival(done, raw) - started)
            summary: dict[str, Any] = _transfer_summary(times)
            summary.update(ours_backend="+".join(sorted(ours)), raw_backend="+".join(sorted(raw)))
            results.append(summary)
        dist.destroy_process_group()
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return results


def _transfer_summary(times: dict[str, list[float]]) -> dict[str, float]:
    """Medians (the figures) and bests (less exposed to other load on the host) of the timed
    rounds; round 0 was a warm-up."""
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    best = {k: min(v[1:]) for k, v in times.items()}
    return {
        "ours_s": med["ours"],
        "raw_s": med["raw"],
        "ratio": med["ours"] / med["raw"],
        "ours_publish_s": med["publish"],
        "ours_best_s": best["ours"],
        "raw_best_s": best["raw"],
        "ratio_best": best["ours"] / best["raw"],
    }


# --- (c) serving while syncing --------------------------------------------------------------------
def _gap_client(addresses: list[str], ready: Any, stop: Any, results: Any) -> None:
    """Process entry: one request in flight per server; log ``(server, reply time, version)``."""
    socks = [sockets.dealer() for _ in addresses]
    poller = zmq.Poller()
    for sock, address in zip(socks, addresses, strict=True):
        sock.connect(address)
        poller.register(sock.raw, zmq.POLLIN)
        sock.send(obs_request(0))
    which = {sock.raw: i for i, sock in enumerate(socks)}
    log: list[tuple[int, float, int]] = []
    while not stop.is_set():
        for raw, _ in poller.poll(100):
            i = which[raw]
            reply = socks[i].recv(timeout_s=0)
            log.append((i, time.monotonic(), reply.policy_version))
            socks[i].send(obs_request(len(log)))
            if len({s for s, _, _ in log}) == len(socks) and not ready.is_set():
                ready.set()
    results.put(np.array(log, float).reshape(-1, 3))


def _serve_while_syncing(harness: ServerHarness, syncs: int, baseline_s: float) -> tuple:
    """Run the client, a quiet baseline, then ``syncs`` publishes; return the client's log,
    the baseline window and the ``(version, start, end)`` of every sync."""
    ready, stop, results = _CTX.Event(), _CTX.Event(), _CTX.Queue()
    client = _CTX.Process(target=_gap_client, args=(harness.addresses, ready, stop, results))
    client.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the servers did not answer the client")
        time.sleep(1.0)  # let both servers settle into steady serving
        baseline = (time.monotonic(), time.monotonic() + baseline_s)
        time.sleep(baseline_s)
        done = []
        for version in range(1, syncs + 1):
            started, ended = harness.publish(version)
            done.append((version, started, ended))
            time.sleep(1.0 + 2 * (ended - started))  # load + swap, then some quiet serving
        stop.set()
        log = results.get(timeout=60)
    finally:
        client.join(timeout=10)
        if client.is_alive():
            client.kill()
    return log, baseline, done


def _max_gap(times: np.ndarray, start: float, end: float, inside: bool) -> float:
    """Longest interval between consecutive ``times`` overlapping [start, end] (``inside``:
    lying within it)."""
    a, b = times[:-1], times[1:]
    keep = (a >= start) & (b <= end) if inside else (b > start) & (a < end)
    return float((b - a)[keep].max()) if keep.any() else float("nan")


def _sync_stats(log: np.ndarray, server: int, version: int, started: float) -> dict[str, float]:
    """Gap and visibility of one sync as one server's replies show it."""
    mine = log[log[:, 0] == server]
    times, served = mine[:, 1], mine[:, 2] >= version
    if not served.any():
        raise RuntimeError(f"server {server} never served weights v{version}")
    visible = float(times[np.argmax(served)])
    return {"gap": _max_gap(times, started, visible, inside=False), "visible": visible - started}


def _server_stats(records: dict, window: tuple[float, float], started: float | None) -> dict:
    """From one server's own records: longest batch and longest idle stretch in ``window``,
    median batch time, and (for a sync) when its weights thread had the new buffer."""
    batches, loads = records["batches"], records["loads"]
    a, b = window
    inside = batches[(batches[:, 1] > a) & (batches[:, 0] < b)]
    idle = inside[1:, 0] - inside[:-1, 1]
    out = {
        "batch_max": float((inside[:, 1] - inside[:, 0]).max()),
        "batch_median": float(np.median(inside[:, 1] - inside[:, 0])),
        "idle_max": float(idle.max()) if len(idle) else float("nan"),
    }
    after = loads[loads[:, 0] >= started] if started is not None and len(loads) else loads[:0]
    if len(after):
        out["received"], out["loaded"] = after[0, 0] - started, after[0, 1] - started
    return out


def measure_serving(hidden: tuple, syncs: int, baseline_s: float) -> dict[str, float]:
    """Serving gaps during and outside syncs, with 2 real rollout servers (see docstring)."""
    with ServerHarness(f"bench_ws_{len(hidden)}", 2, hidden, skip_init=True) as harness:
        log, baseline, done = _serve_while_syncing(harness, syncs, baseline_s)
    servers = sorted(harness.records)
    base = [_max_gap(log[log[:, 0] == s, 1], *baseline, inside=True) for s in servers]
    base_srv = [_server_stats(harness.records[s], baseline, None) for s in servers]
    per_sync = []
    for version, started, ended in done:
        stats = [_sync_stats(log, s, version, started) for s in servers]
        window = (started, started + max(st["visible"] for st in stats))
        srv = [_server_stats(harness.records[s], window, started) for s in servers]
        per_sync.append(
            {
                "gap": max(st["gap"] for st in stats),
                "visible": max(st["visible"] for st in stats),
                "publish": ended - started,
                "received": max(st.get("received", float("nan")) for st in srv),
                "loaded": max(st.get("loaded", float("nan")) for st in srv),
                "batch_max": max(st["batch_max"] for st in srv),
                "idle_max": max(st["idle_max"] for st in srv),
            }
        )
    med = {k: statistics.median(p[k] for p in per_sync) for k in per_sync[0]}
    ms = 1000.0
    return {
        "max_serving_gap_ms": med["gap"] * ms,
        "worst_serving_gap_ms": max(p["gap"] for p in per_sync) * ms,
        "baseline_max_gap_ms": max(base) * ms,
        "batch_ms": statistics.median(st["batch_median"] for st in base_srv) * ms,
        "baseline_batch_max_ms": max(st["batch_max"] for st in base_srv) * ms,
        "sync_batch_max_ms": med["batch_max"] * ms,
        "baseline_idle_max_ms": max(st["idle_max"] for st in base_srv) * ms,
        "sync_idle_max_ms": med["idle_max"] * ms,
        "serving_publish_s": med["publish"],
        "serving_received_s": med["received"],
        "serving_loaded_s": med["loaded"],
        "serving_visible_s": med["visible"],
    }


# --- report ----------------------------------------------------------------------------------
def run(
    sizes: list[float], repeats: int, syncs: int, baseline_s: float, device: str = "cpu"
) -> dict[str, dict]:
    """Every measurement for every size, one after the other (on CUDA: the transfers only;
    the serving measurement (c) runs the CPU rollout servers of ``ServerHarness``)."""
    hidden = [hidden_sizes(size) for size in sizes]
    numels = [policy_numel(server_config("sizing", "unix:///unused", 1, h, {})) for h in hidden]
    started = time.monotonic()
    transfers = measure_transfer(numels, repeats, device)
    _progress(f"transfers measured ({time.monotonic() - started:.0f} s)")
    results = {}
    for size, h, numel, transfer in zip(sizes, hidden, numels, transfers, strict=True):
        entry: dict[str, Any] = {"params": numel, "mb": round(numel * 4 / 1e6, 1), **transfer}
        name = f"{size / 1e6:g}M"
        if device == "cpu":
            started = time.monotonic()
            entry.update(measure_serving(h, syncs, baseline_s))
            _progress(f"{name}: serving measured ({time.monotonic() - started:.0f} s)")
        results[name] = {k: _rounded(v) for k, v in entry.items()}
    return results


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _rounded(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


_GAP_KEYS = (
    "max_serving_gap_ms",
    "worst_serving_gap_ms",
    "baseline_max_gap_ms",
    "batch_ms",
    "sync_batch_max_ms",
    "baseline_batch_max_ms",
    "sync_idle_max_ms",
    "baseline_idle_max_ms",
)
"""The result keys the serving-gap table shows, in its columns' order."""
TRANSFER = Table.from_layout(
    "size:>5 | MB:>7.1f | ours s:>8.3f | raw s:>8.3f | ratio:>6.2f | publish s:>10.3f"
    " | best: ours:>11.3f | raw:>6.3f | ratio:>6.2f"
)
SERVING_GAPS = Table(
    (
        Column("serving, ms", 16, header_align="<"),
        *Table.from_layout(
            "gap: sync:>10.1f | worst:>7.1f | outside:>8.1f | batch: median:>14.1f"
            " | sync max:>9.1f | outside:>8.1f | idle: sync:>11.1f | outside:>8.1f"
        ).columns,
    )
)
SYNC_WHILE_SERVING = Table.from_layout(
    "sync while serving, s:>21 | publish:>8.3f | received:>9.3f | loaded:>7.3f | visible:>8.3f"
)


def print_table(results: dict[str, dict]) -> None:
    """The figures as three small tables: transfer, serving gaps, sync while serving."""
    print(TRANSFER.header())
    for name, r in results.items():
        figures = [r[k] for k in ("mb", "ours_s", "raw_s", "ratio", "ours_publish_s")]
        figures += [r[k] for k in ("ours_best_s", "raw_best_s", "ratio_best")]
        backends = f"(ours over {r['ours_backend']}, raw over {r['raw_backend']})"
        print(f"{TRANSFER.row(name, *figures)}  {backends}")
    if not all("max_serving_gap_ms" in r for r in results.values()):
        return
    print()
    SERVING_GAPS.print((name, *(r[k] for k in _GAP_KEYS)) for name, r in results.items())
    print()
    SYNC_WHILE_SERVING.print(
        (name, *(r[f"serving_{k}_s"] for k in ("publish", "received", "loaded", "visible")))
        for name, r in results.items()
    )


def main() -> None:
    parser = benchmark_parser(__doc__, smoke_help="a few seconds of each case, for CI")
    parser.add_argument(
        "--sizes", type=float, nargs="+", default=[10e6, 100e6], help="float32 parameters per model"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed rounds of (a) and (b) at 100M"
    )
    parser.add_argument("--syncs", type=int, default=3, help="syncs while serving, for (c)")
    parser.add_argument("--baseline-s", type=float, default=2.0, help="quiet serving, for (c)")
    parser.add_argument(
        "--device",
        choices=list(DEVICES),
        default="cpu",
        help="where the weights live: cpu (gloo), cuda (NCCL; every process on GPU 0, each "
        "with its own NCCL_HOSTID) or cuda-gloo (GPU 0, no host ids: gloo on CUDA tensors); "
        "the CUDA ones measure the transfers (a) and (b) only",
    )
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.repeats, args.syncs, args.baseline_s = [1e6], 2, 1, 0.5
    torch.set_num_threads(1)
    load_before = load_average_1m()
    results = run(args.sizes, args.repeats, args.syncs, args.baseline_s, args.device)
    print_table(results)
    results["host"] = host_record(load_before)
    print(f"\n{host_line(results['host'])}")
    write_result(args.json, "weight_sync", results, vars(args))


if __name__ == "__main__":
    main()
