"""Codec and sockets benchmark: our transport's codec + sockets against raw pyzmq sending the
same bytes.

Two payloads over PUSH/PULL on tcp loopback, sender and receiver in separate processes:
(a) ``small``: an ``ActionReply`` (one msgpack header frame, its two tiny arrays inline);
(b) ``obs``: an ``ObsRequest`` carrying an 84x84x3 uint8 image (inline too: under 64 KiB).
"ours" encodes and decodes real messages (built beforehand, 64 distinct ones sent in turn); "raw"
sends pre-built frames of the same bytes with
plain ``send_multipart``/``recv_multipart`` — the limit of the socket itself. Trials of the two
alternate (``--repeats`` each, the best kept). Besides msgs/s, each side's CPU time per message
(µs, best trial) is reported: on a shared 2-core host it moves far less than the rates do.
"curve" is "ours" with CURVE on both sockets (``transport/security.py``, as in a multi-host run):
its ratio to "ours" is what authentication and encryption cost.

    python bench/codec_sockets.py [--messages N] [--json PATH] [--smoke]
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
import zmq
from harness.provenance import write_result
from harness.report import Table, benchmark_parser

from transport import security, sockets
from transport.codec import encode
from transport.messages import ActionReply, ObsRequest

_SECRET = "bench-transport-secret-0123456789abcdef"
MODES = ("ours", "raw", "curve")


def make_message(kind: str, i: int):
    if kind == "small":
        # A discrete action, as CartPole's rollout server sends it (env_action None: the same)
        return ActionReply(
            request_id=i,
            action=np.array(i % 2, np.int64),
            log_prob=-0.69,
            value=0.5,
            policy_version=3,
        )
    image = np.full((84, 84, 3), i % 255, np.uint8)
    return ObsRequest(env_key="0/0", request_id=i, obs={"image": image})


def ours_sender(address: str, kind: str, count: int, cpu: Any, secret: str | None = None) -> None:
    if secret is not None:
        security.enable(secret)
    sock = sockets.push(hwm=1000)
    sock.connect(address)
    # Messages are built before the clock starts, as raw's bytes are: building an observation
    # is the simulator's work, not the transport's. A pool of distinct ones, sent in turn.
    pool = [make_message(kind, i) for i in range(64)]
    started = time.process_time()
    for i in range(count):
        sock.send(pool[i % 64])
    sock.raw.setsockopt(zmq.LINGER, -1)
    sock.raw.close()
    zmq.Context.instance().term()  # wait until every queued message is delivered, then exit
    cpu.send(time.process_time() - started)


def raw_sender(address: str, kind: str, count: int, cpu: Any) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(address)
    frames = [bytes(memoryview(f)) for f in encode(make_message(kind, 0))]
    started = time.process_time()
    for _ in range(count):
        sock.send_multipart(frames, copy=len(frames[-1]) < 65536)
    sock.close(linger=-1)
    zmq.Context.instance().term()
    cpu.send(time.process_time() - started)


def measure(kind: str, count: int, mode: str) -> tuple[float, float, float]:
    """Messages per second received (and, for ours, decoded) over ``count`` messages, and the
    CPU time per message, in µs, of the sending and of the receiving process (all threads,
    ZeroMQ's I/O thread included: a figure other load on the host barely moves). ``curve``
    runs in a process of its own, so that CURVE stays off for the other modes."""
    if mode == "curve":
        spawn = mp.get_context("spawn")
        result_recv, result_send = spawn.Pipe(duplex=False)
        proc = spawn.Process(target=_measure_with_curve, args=(kind, count, result_send))
        proc.start()
        result = result_recv.recv()
        proc.join()
        return result
    return _measure(kind, count, mode == "ours")


def _measure_with_curve(kind: str, count: int, result: Any) -> None:
    security.enable(_SECRET)
    result.send(_measure(kind, count, True, secret=_SECRET))


def _measure(
    kind: str, count: int, ours: bool, secret: str | None = None
) -> tuple[float, float, float]:
    if ours:
        receiver = sockets.pull(hwm=1000)
        address = receiver.bind()
    else:
        receiver = zmq.Context.instance().socket(zmq.PULL)
        receiver.setsockopt(zmq.RCVHWM, 1000)
        address = f"tcp://127.0.0.1:{receiver.bind_to_random_port('tcp://127.0.0.1')}"
    cpu_recv, cpu_send = mp.get_context("spawn").Pipe(duplex=False)
    args = (address, kind, count + 1, cpu_send)
    if ours:
        proc = mp.get_context("spawn").Process(target=ours_sender, args=(*args, secret))
    else:
        proc = mp.get_context("spawn").Process(target=raw_sender, args=args)
    proc.start()
    if ours:
        receiver.recv()  # the first message: connection is up, start the clock
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            msg = receiver.recv()
            assert msg is not None
    else:
        receiver.recv_multipart()
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            receiver.recv_multipart(copy=kind == "small")
    elapsed, receiver_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    sender_cpu = cpu_recv.recv()
    proc.join()
    (receiver.raw if ours else receiver).close(linger=0)
    return count / elapsed, sender_cpu / count * 1e6, receiver_cpu / count * 1e6


def run(messages: dict[str, int], repeats: int) -> dict[str, dict[str, Any]]:
    results = {}
    for kind, count in messages.items():
        size = sum(len(memoryview(f)) for f in encode(make_message(kind, 0)))
        trials: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
        for _ in range(repeats):  # interleaved, so a change of load hits all alike
            for mode in MODES:
                trials[mode].append(measure(kind, count, mode))
        rate = {m: max(t[0] for t in trials[m]) for m in MODES}
        cpu = {m: [min(t[i] for t in trials[m]) for i in (1, 2)] for m in MODES}
        results[kind] = {"bytes_per_msg": size}
        for m in MODES:
            results[kind][f"{m}_msgs_per_s"] = round(rate[m], 1)
            results[kind][f"{m}_gb_per_s"] = round(rate[m] * size / 1e9, 4)
            results[kind][f"{m}_cpu_us_per_msg"] = {
                "send": round(cpu[m][0], 2),
                "recv": round(cpu[m][1], 2),
            }
        results[kind]["ratio"] = round(rate["ours"] / rate["raw"], 3)
        results[kind]["curve_vs_ours"] = round(rate["curve"] / rate["ours"], 3)
    return results


TABLE = Table.from_layout(
    "payload:<8 | bytes:>7d | ours msg/s:>11.0f | raw msg/s:>11.0f | curve msg/s:>12.0f"
    " | ours/raw:>9.2f | curve/ours:>11.2f |   CPU us/msg send+recv: ours  raw  curve:<"
)


def _cpu_cells(r: dict[str, Any]) -> str:
    """Send+recv CPU µs per message of ours, raw and curve, as one cell."""
    o, w, c = (r[f"{m}_cpu_us_per_msg"] for m in ("ours", "raw", "curve"))
    return (
        f"  {o['send']:5.1f}+{o['recv']:<5.1f} {w['send']:5.1f}+{w['recv']:<5.1f} "
        f"{c['send']:5.1f}+{c['recv']:.1f}"
    )


def main() -> None:
    parser = benchmark_parser(__doc__, smoke_help="a few messages, one trial (CI)")
    parser.add_argument("--messages", type=int, default=100_000, help="small messages per trial")
    parser.add_argument("--obs-messages", type=int, default=20_000, help="obs messages per trial")
    parser.add_argument("--repeats", type=int, default=3, help="trials per case; best is kept")
    args = parser.parse_args()
    if args.smoke:
        args.messages, args.obs_messages, args.repeats = 2000, 500, 1
    results = run({"small": args.messages, "obs": args.obs_messages}, args.repeats)
    TABLE.print(
        (
            kind,
            r["bytes_per_msg"],
            r["ours_msgs_per_s"],
            r["raw_msgs_per_s"],
            r["curve_msgs_per_s"],
            r["ratio"],
            r["curve_vs_ours"],
            _cpu_cells(r),
        )
        for kind, r in results.items()
    )
    write_result(args.json, "codec_sockets", results, vars(args))


if __name__ == "__main__":
    main()
