"""Transport benchmark: our codec + sockets against raw pyzmq sending the same bytes.

Two payloads over PUSH/PULL on tcp loopback, sender and receiver in separate processes:
(a) ``small``: an ``ActionReply`` (one msgpack header frame, its two tiny arrays inline);
(b) ``obs``: an ``ObsRequest`` carrying an 84x84x3 uint8 image (inline too: under 64 KiB).
"ours" encodes and decodes real messages (built beforehand, 64 distinct ones sent in turn); "raw"
sends pre-built frames of the same bytes with
plain ``send_multipart``/``recv_multipart`` — the limit of the socket itself. Trials of the two
alternate (``--repeats`` each, the best kept). Besides msgs/s, each side's CPU time per message
(µs, best trial) is reported: on a shared 2-core host it moves far less than the rates do.

    python bench/transport.py [--messages N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, this file's directory comes first on sys.path and its name would shadow the
# `transport` package: drop that directory before importing the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from rlvla3.messages import ActionReply, ObsRequest  # noqa: E402
from transport import sockets  # noqa: E402
from transport.codec import encode  # noqa: E402


def make_message(kind: str, i: int):
    if kind == "small":
        # A discrete action, as CartPole's rollout server sends it (env_action None: the same)
        return ActionReply(request_id=i, action=np.array(i % 2, np.int64), log_prob=-0.69,
                           value=0.5, policy_version=3)  # fmt: skip
    image = np.full((84, 84, 3), i % 255, np.uint8)
    return ObsRequest(env_key="0/0", request_id=i, obs={"image": image})


def ours_sender(address: str, kind: str, count: int, cpu: Any) -> None:
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


def measure(kind: str, count: int, ours: bool) -> tuple[float, float, float]:
    """Messages per second received (and, for ours, decoded) over ``count`` messages, and the
    CPU time per message, in µs, of the sending and of the receiving process (all threads,
    ZeroMQ's I/O thread included: a figure other load on the host barely moves)."""
    if ours:
        receiver = sockets.pull(hwm=1000)
        address = receiver.bind()
    else:
        receiver = zmq.Context.instance().socket(zmq.PULL)
        receiver.setsockopt(zmq.RCVHWM, 1000)
        address = f"tcp://127.0.0.1:{receiver.bind_to_random_port('tcp://127.0.0.1')}"
    target = ours_sender if ours else raw_sender
    cpu_recv, cpu_send = mp.get_context("spawn").Pipe(duplex=False)
    proc = mp.get_context("spawn").Process(target=target, args=(address, kind, count + 1, cpu_send))
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


def run(messages: dict[str, int], repeats: int) -> dict[str, dict[str, float]]:
    results = {}
    for kind, count in messages.items():
        size = sum(len(memoryview(f)) for f in encode(make_message(kind, 0)))
        trials: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
        for _ in range(repeats):  # interleaved, so a change of load hits both alike
            for is_ours in (True, False):
                trials[is_ours].append(measure(kind, count, is_ours))
        ours, raw = (max(t[0] for t in trials[k]) for k in (True, False))
        cpu = {k: [min(t[i] for t in trials[k]) for i in (1, 2)] for k in (True, False)}
        results[kind] = {
            "bytes_per_msg": size,
            "ours_msgs_per_s": round(ours, 1),
            "raw_msgs_per_s": round(raw, 1),
            "ours_gb_per_s": round(ours * size / 1e9, 4),
            "raw_gb_per_s": round(raw * size / 1e9, 4),
            "ratio": round(ours / raw, 3),
            "ours_cpu_us_per_msg": {"send": round(cpu[True][0], 2), "recv": round(cpu[True][1], 2)},
            "raw_cpu_us_per_msg": {
                "send": round(cpu[False][0], 2),
                "recv": round(cpu[False][1], 2),
            },
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=100_000, help="small messages per trial")
    parser.add_argument("--obs-messages", type=int, default=20_000, help="obs messages per trial")
    parser.add_argument("--repeats", type=int, default=3, help="trials per case; best is kept")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    results = run({"small": args.messages, "obs": args.obs_messages}, args.repeats)
    print(f"{'payload':8} {'bytes':>7} {'ours msg/s':>12} {'raw msg/s':>12} {'ours GB/s':>10} "
          f"{'raw GB/s':>9} {'ratio':>6}   CPU us/msg send+recv: ours  raw")  # fmt: skip
    for kind, r in results.items():
        o, w = r["ours_cpu_us_per_msg"], r["raw_cpu_us_per_msg"]
        print(f"{kind:8} {r['bytes_per_msg']:7d} {r['ours_msgs_per_s']:12.0f} "
              f"{r['raw_msgs_per_s']:12.0f} {r['ours_gb_per_s']:10.3f} {r['raw_gb_per_s']:9.3f} "
              f"{r['ratio']:6.2f}   {o['send']:5.1f}+{o['recv']:<5.1f} {w['send']:5.1f}+{w['recv']:.1f}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
