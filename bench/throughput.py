"""Throughput per core: the whole system's env steps/s beside the physical limits, in one run.

Every case launches the real system (``rlvla3 launch``: env workers, rollout server, and with
training on a trainer and a weight broadcaster) on CartPole-v1 with the MLP policy, waits for
steady state, and fits env steps/s (and trained samples/s) to the counters sampled every 0.1 s
over ``--duration-s``:

- **training on**, 2 env workers x 16 envs, ``env.envs_per_request`` 1 (each env its own
  request), 4 and 16; and one worker owning a vectorized CartPole of 256 envs
  (``env.vectorized``, CartPole's own numpy vector env) in 4 groups of 64. ``algo.max_staleness``
  16 with truncated importance weights, so lagging samples are trained, not dropped.
- **inference only** (no trainer: the server serves its initial policy), the same layouts.

The limits, measured in this process:

- **simulator alone**: one CartPole env stepped with random actions; the 256-env vector env.
- **bare ZeroMQ round trip of the same bytes**: a DEALER sends a pre-encoded request of one
  group's observations (1 or 64 CartPole observations) and a ROUTER echoes a pre-encoded reply
  of the same size: round trips/s x group size is the most observations per second one env
  thread could get answered with no codec, no batching and no model.

    python bench/throughput.py [--duration-s 10] [--json PATH] [--smoke]
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from harness.provenance import write_result
from harness.report import Table, benchmark_parser
from harness.run_sampler import sample_run

from rlvla3.launch.redis_server import EmbeddedRedis
from sim.env_group import VectorEnvs
from sim.envs import make_env
from transport.codec import encode
from transport.messages import ActionBatchReply, ActionReply, ObsBatchRequest, ObsRequest

_COUNTERS = (
    "env_steps",
    "samples_consumed",
    "samples_dropped",
    "chunks_produced",
    "chunks_dropped",
)


def case_config(
    name: str,
    redis_url: str,
    *,
    train: bool,
    workers: int,
    envs: int,
    per_request: int,
    vectorized: bool,
) -> dict[str, Any]:
    """The launch YAML of one case (CartPole, MLP, async)."""
    roles: dict[str, Any] = {
        "env_worker": {"count": workers, "settings": {"max_chunks_queued": 0}},
        "rollout_server": {"count": 1, "settings": {"max_batch": 256}},
    }
    if train:
        roles["trainer"] = {"count": 1}
        roles["weight_broadcaster"] = {"count": 1}
        # Back-pressure at two updates' worth of chunks: what the trainer consumes.
        chunks_per_round = workers * envs
        roles["env_worker"]["settings"]["max_chunks_queued"] = 2 * chunks_per_round
    return {
        "run": {"name": name, "redis_url": redis_url, "stop": {"max_wall_s": 600}},
        "roles": roles,
        "env": {
            "id": "CartPole-v1",
            "num_envs_per_worker": envs,
            "envs_per_request": per_request,
            "vectorized": vectorized,
            "chunk_len": 32,
        },
        "algo": {"max_staleness": 16, "minibatch_size": 256, "epochs": 4, "lr": 0.0025},
    }


def measure_case(
    cfg: dict[str, Any], workdir: Path, warmup_s: float, duration_s: float
) -> dict[str, float]:
    """Launch one case, wait for steady state, fit the counters' rates, stop it."""
    got = sample_run(cfg, workdir, _COUNTERS, warmup_s, duration_s)
    taken = got.delta("samples_consumed") + got.delta("samples_dropped")
    return {
        "env_steps_per_s": got.rate("env_steps"),
        "trained_samples_per_s": got.rate("samples_consumed"),
        "dropped_share": got.delta("samples_dropped") / taken if taken else 0.0,
    }


def sim_alone(envs: int, duration_s: float) -> float:
    """Env steps/s of CartPole stepped in this process: one env, or a vector env of ``envs``."""
    rng = np.random.default_rng(0)
    steps, started = 0, time.perf_counter()
    if envs == 1:
        env = make_env("CartPole-v1", seed=0)
        env.reset()
        actions = rng.integers(0, 2, 4096).tolist()
        while time.perf_counter() - started < duration_s:
            for a in actions:
                _, _, term, trunc, _ = env.step(a)
                if term or trunc:
                    env.reset()
            steps += len(actions)
    else:
        group = VectorEnvs("CartPole-v1", envs, seed=0)
        group.reset(0)
        actions = [int(a) for a in rng.integers(0, 2, envs)]
        while time.perf_counter() - started < duration_s:
            for _ in range(64):
                group.vec.step(np.array(actions))
            steps += 64 * envs
    return steps / (time.perf_counter() - started)


def zmq_round_trips(group: int, duration_s: float) -> float:
    """Observations/s one DEALER gets answered by a bare ROUTER echo of pre-encoded frames of
    one group's request and reply (no codec, no batching, no model)."""
    obs = np.zeros((group, 4), np.float32)
    if group == 1:
        request = encode(ObsRequest(env_key="0/0", request_id=1, obs={"state": obs[0]}))
        reply = encode(
            ActionReply(
                request_id=1, action=np.array(1), log_prob=-0.7, value=0.1, policy_version=1
            )
        )
    else:
        request = encode(ObsBatchRequest(env_key="0/0+64", request_id=1, obs={"state": obs}))
        reply = encode(
            ActionBatchReply(
                request_id=1,
                actions=np.ones(group, np.int64),
                log_probs=np.zeros(group, np.float32),
                values=np.zeros(group, np.float32),
                policy_version=1,
            )
        )
    request_frames = [bytes(f) for f in request]
    reply_frames = [bytes(f) for f in reply]
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def echo() -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(100):
                identity = router.recv_multipart()[0]
                router.send_multipart([identity, *reply_frames])

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    trips, started = 0, time.perf_counter()
    while time.perf_counter() - started < duration_s:
        for _ in range(200):
            dealer.send_multipart(request_frames)
            dealer.recv_multipart()
        trips += 200
    rate = trips * group / (time.perf_counter() - started)
    stop.set()
    thread.join()
    dealer.close(0)
    router.close(0)
    return rate


TABLE = Table.from_layout(
    "case:<26 | training on:>12,.0f | trained/s:>10,.0f | dropped:>8.1% | inference:>10,.0f"
)
CASES = {  # name: (workers, envs per worker, envs per request, vectorized)
    "1 env per request": (2, 16, 1, False),
    "4 envs per request": (2, 16, 4, False),
    "16 envs per request": (2, 16, 16, False),
    "vector 256, groups of 64": (1, 256, 64, True),
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = benchmark_parser(__doc__, smoke_help="two short cases, for CI")
    p.add_argument("--duration-s", type=float, default=10.0, help="measuring window per case")
    p.add_argument("--warmup-s", type=float, default=5.0)
    args = p.parse_args(argv)
    cases = dict(CASES)
    if args.smoke:
        args.duration_s, args.warmup_s = 1.5, 1.0
        cases = {"4 envs per request": (1, 4, 4, False), "vector 16, groups of 8": (1, 16, 8, True)}
    limits = {
        "sim_alone_1_env": sim_alone(1, min(args.duration_s, 3.0)),
        "sim_alone_vector_256": sim_alone(256, min(args.duration_s, 3.0)),
        "zmq_round_trip_1": zmq_round_trips(1, min(args.duration_s, 3.0)),
        "zmq_round_trip_64": zmq_round_trips(64, min(args.duration_s, 3.0)),
    }
    results: dict[str, Any] = {"limits": limits, "training": {}, "inference": {}}
    with EmbeddedRedis() as redis, tempfile.TemporaryDirectory(prefix="rlvla3-tp-") as tmp:
        for train in (True, False):
            kind = "training" if train else "inference"
            for i, (case, (workers, envs, per, vec)) in enumerate(cases.items()):
                cfg = case_config(
                    f"tp_{kind}_{i}",
                    redis.url,
                    train=train,
                    workers=workers,
                    envs=envs,
                    per_request=per,
                    vectorized=vec,
                )
                got = measure_case(cfg, Path(tmp), args.warmup_s, args.duration_s)
                group_limit = limits["zmq_round_trip_64"] if per >= 64 else None
                if group_limit and not train:
                    got["of_zmq_round_trip_64"] = got["env_steps_per_s"] / group_limit
                results[kind][case] = got
                print(
                    f"{kind:9s} {case:26s} {got['env_steps_per_s']:10,.0f} env steps/s", flush=True
                )
    print()
    training, inference = results["training"], results["inference"]
    TABLE.print(
        (
            case,
            training[case]["env_steps_per_s"],
            training[case]["trained_samples_per_s"],
            training[case]["dropped_share"],
            inference[case]["env_steps_per_s"],
        )
        for case in cases
    )
    print("\nlimits (this process): " + ", ".join(f"{k} {v:,.0f}/s" for k, v in limits.items()))
    for case, got in results["inference"].items():
        if "of_zmq_round_trip_64" in got:
            print(
                f"{case}, inference only: {got['of_zmq_round_trip_64']:.0%} of the bare "
                "ZeroMQ round trip of 64 observations"
            )
    write_result(args.json, "throughput", results, vars(args))
    return results


if __name__ == "__main__":
    main()
