"""The floor under ``bench/async_vs_sync.py``'s async figure: the same envs against a bare server.

``async_vs_sync.py`` compares async mode with the no-wait bound (envs / mean step latency), which
no real system reaches: each step also pays an action round trip. This script measures what is
left of the bound when the round trip does nothing but cross ZeroMQ, on this host, with the same
workload: ``--num-envs`` env threads over ``--num-workers`` processes, each sleeping a lognormal
straggler delay (``sim.straggler``'s distribution and timer slack) and then asking a server for
an action with our codec and DEALER/ROUTER sockets. No simulator, no trainer, no bookkeeping.

Servers (``--server``, several run one after another, alternating over ``--repeats``):

- ``echo``: replies at once with a fixed ``ActionReply`` (ZeroMQ and the codec only);
- ``mlp``: batches what is waiting and acts with the CartPole MLP's numpy path, as the rollout
  server does;
- ``mlp+load``: as ``mlp``, with one more process keeping a core ``--load-duty`` busy in torch,
  like a trainer that trains continuously on the same two cores.

Reports env steps/s, the fraction of the bound and the mean round trip per server; ``--json``
writes them under ``servers`` with the workload.

    python bench/round_trip_floor.py [--latency-mean-ms 10] [--duration-s 15] [--json PATH]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import threading
import time

import numpy as np
from harness.provenance import write_result
from harness.report import Table, add_straggler_flags, benchmark_parser

SERVERS = ("echo", "mlp", "mlp+load")
TABLE = Table.from_layout("server:<10 | env steps/s:>12.1f | of bound:>9.1% | round trip ms:>14.3f")


def serve(kind: str, address_out: mp.Queue, stop: mp.Event) -> None:
    """A ROUTER that answers every ``ObsRequest`` (``echo``: a fixed reply; else the MLP)."""
    import gymnasium as gym
    import torch

    from rlvla3.policy.mlp import MLPPolicy
    from transport.messages import ActionReply
    from transport.sockets import RouterSocket

    torch.set_num_threads(1)
    policy = MLPPolicy(4, gym.spaces.Discrete(2), (64, 64)).eval()
    rng = np.random.default_rng(0)
    router = RouterSocket(hwm=10_000)
    address_out.put(router.bind())
    zero = np.asarray(0)
    while not stop.is_set():
        first = router.recv_from(timeout_s=0.1)
        if first is None:
            continue
        batch = [first]
        while (item := router.recv_from(timeout_s=0.0)) is not None:
            batch.append(item)
        if kind == "echo":
            for identity, req in batch:
                router.send_to(
                    identity,
                    ActionReply(
                        request_id=req.request_id,
                        action=zero,
                        env_action=None,
                        log_prob=0.0,
                        value=0.0,
                        policy_version=0,
                    ),
                )
            continue
        state = np.array([req.obs["state"] for _, req in batch])
        out = policy.act_numpy({"state": state}, False, rng)
        log_probs, values = out.log_prob.tolist(), out.value.tolist()
        for i, (identity, req) in enumerate(batch):
            router.send_to(
                identity,
                ActionReply(
                    request_id=req.request_id,
                    action=np.asarray(out.action[i]),
                    env_action=None,
                    log_prob=log_probs[i],
                    value=values[i],
                    policy_version=0,
                ),
            )


def envs(address: str, args: argparse.Namespace, worker: int, results: mp.Queue) -> None:
    """``num_envs / num_workers`` env threads: sleep a straggler delay, then one round trip."""
    from sim.straggler import lognormal_mu, tighten_timer_slack
    from transport import sockets
    from transport.messages import ActionReply, ObsRequest

    per_env: list[tuple[int, float, float]] = []
    lock = threading.Lock()

    def run(env_index: int) -> None:
        tighten_timer_slack()
        rng = np.random.default_rng([worker, env_index])
        mu = lognormal_mu(args.latency_mean_ms, args.latency_sigma) - math.log(1000)
        dealer = sockets.dealer(hwm=100)
        dealer.connect(address)
        obs = {"state": np.zeros(4, np.float32)}
        steps, waited, request_id = 0, 0.0, 0
        started = time.monotonic()
        end = started + args.duration_s
        while time.monotonic() < end:
            time.sleep(rng.lognormal(mu, args.latency_sigma))
            request_id += 1
            asked = time.perf_counter()
            dealer.send(ObsRequest(env_key=f"{worker}/{env_index}", request_id=request_id, obs=obs))
            reply = dealer.recv(timeout_s=5.0)
            if not isinstance(reply, ActionReply):
                raise RuntimeError(f"env {worker}/{env_index}: no reply in 5 s")
            waited += time.perf_counter() - asked
            steps += 1
        dealer.close()
        with lock:
            per_env.append((steps, time.monotonic() - started, waited))

    threads = [
        threading.Thread(target=run, args=(i,)) for i in range(args.num_envs // args.num_workers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(per_env)


def load(duty: float, stop: mp.Event) -> None:
    """Keep a core ``duty`` busy with small torch matmuls, in 10 ms periods (a trainer's load)."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    while not stop.is_set():
        busy_until = time.monotonic() + 0.010 * duty
        while time.monotonic() < busy_until:
            a = torch.tanh(a @ a * 0.01)
        stop.wait(0.010 * (1 - duty))


def measure(kind: str, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    addresses, results, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(kind.removesuffix("+load"), addresses, stop))
    server.start()
    helpers = [ctx.Process(target=load, args=(args.load_duty, stop))] if "+load" in kind else []
    for helper in helpers:
        helper.start()
    address = addresses.get(timeout=120)
    workers = [
        ctx.Process(target=envs, args=(address, args, w, results)) for w in range(args.num_workers)
    ]
    for w in workers:
        w.start()
    per_env = [e for _ in workers for e in results.get(timeout=args.duration_s + 120)]
    for w in workers:
        w.join()
    stop.set()
    for p in [server, *helpers]:
        p.join(timeout=30)
    steps_per_s = sum(steps / elapsed for steps, elapsed, _ in per_env)
    round_trip_ms = 1000 * sum(w for _, _, w in per_env) / sum(s for s, _, _ in per_env)
    return {"env_steps_per_s": steps_per_s, "round_trip_ms": round_trip_ms}


def main() -> None:
    parser = benchmark_parser(__doc__, smoke_help="a few seconds of each case, for CI")
    add_straggler_flags(parser, latency_mean_ms=10.0, duration_s=15.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--load-duty", type=float, default=0.5, help="mlp+load: busy fraction")
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    args = parser.parse_args()
    if args.smoke:
        args.duration_s, args.repeats, args.num_envs = 2.0, 1, 4
    bound = args.num_envs / (args.latency_mean_ms / 1000)
    runs: dict[str, list[dict]] = {kind: [] for kind in args.servers}
    for _ in range(args.repeats):  # alternate, so a change of load on the host hits all alike
        for kind in args.servers:
            runs[kind].append(measure(kind, args))
    print(TABLE.header())
    servers = {}
    for kind, trials in runs.items():
        rate = float(np.median([t["env_steps_per_s"] for t in trials]))
        trip = float(np.median([t["round_trip_ms"] for t in trials]))
        servers[kind] = {
            "env_steps_per_s": rate,
            "of_bound": rate / bound,
            "round_trip_ms": trip,
            "trials": trials,
        }
        print(TABLE.row(kind, rate, rate / bound, trip))
    print(f"{'bound':<10} {bound:>12.1f}   ({args.num_envs} envs / {args.latency_mean_ms} ms)")
    write_result(
        args.json,
        "round_trip_floor",
        {"bound_env_steps_per_s": bound, "servers": servers},
        vars(args),
    )


if __name__ == "__main__":
    main()
