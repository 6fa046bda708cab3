"""Rollout-server benchmark: the real ``RolloutServer`` against the raw ZeroMQ request-reply limit.

The server side is the real role, not a copy: ``ServerHarness`` runs ``roles.rollout_server``'s
``RolloutServer`` class in child processes (``Role.run()``: Redis registration, heartbeats,
``setup()``, the ``step()`` loop with dynamic batching, the weights thread), against a private
embedded Redis, with this process acting as their weight broadcaster (real ``Broadcaster`` and
``WeightLink``). The only instrumentation wraps ``_serve`` (and ``_receive_into_standby``) to
record when each batch ran, how big it was and which weight version served it.

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

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Run as a script, this file's directory comes first on sys.path, and bench/transport.py would
# shadow the `transport` package: drop that directory, and put the repo root there instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
# One OpenBLAS thread, as the launcher gives every role (rlvla3/launch/processes.py).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402
from harness.provenance import write_result  # noqa: E402

from rlvla3.config.run_config import config_from_dict  # noqa: E402
from rlvla3.launch.redis_server import EmbeddedRedis  # noqa: E402
from rlvla3.runtime.registry import Registry  # noqa: E402
from roles.rollout_server import RolloutServer  # noqa: E402  (imported once, in the forkserver)
from transport import sockets  # noqa: E402
from transport.codec import encode  # noqa: E402
from transport.messages import ActionReply, ObsRequest  # noqa: E402
from transport.weights import Broadcaster, FlatLayout, start_store  # noqa: E402

HOST = "127.0.0.1"
CARTPOLE_HIDDEN = (64, 64)
_CTX = mp.get_context("forkserver")  # children fork from one process that imported torch


# --- the real rollout server, instrumented, in its own process --------------------------------
def _timed(fn: Any, calls: list[tuple[float, float]]) -> Any:
    """``fn``, appending ``(start, end)`` of every call to ``calls``."""

    def timed(*args: Any) -> Any:
        started = time.monotonic()
        try:
            return fn(*args)
        finally:
            calls.append((started, time.monotonic()))

    return timed


def _instrument(role: Any) -> dict[str, list[tuple]]:
    """Record, in the server: ``batches`` ``(start, end, batch size, version)`` per ``_serve``,
    ``loads`` ``(start, end)`` per weights receive into the standby copy (start: the version's
    header arrived; end: every weight is in place)."""
    records: dict[str, list[tuple]] = {"batches": [], "loads": []}
    serve, setup = role._serve, role.setup

    def timed_serve(batch: list) -> int:
        started = time.monotonic()
        served = serve(batch)  # how many were answered: the role counts them
        records["batches"].append((started, time.monotonic(), len(batch), role.version))
        return served

    def timed_setup() -> None:
        setup()  # returns once the first weights are in; later receives are timed
        role._receive_into_standby = _timed(role._receive_into_standby, records["loads"])

    role._serve, role.setup = timed_serve, timed_setup
    return records


def _skip_weight_init() -> None:
    """Make parameter init free: the first broadcast overwrites every weight before serving.

    (Orthogonal init of a 100M-parameter MLP takes about a minute on one thread.)
    """
    for name in ("kaiming_uniform_", "uniform_", "orthogonal_", "normal_", "zeros_"):
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)


def _server_main(raw_cfg: dict, index: int, run_dir: str, results: Any, skip_init: bool) -> None:
    """Process entry: run one real ``RolloutServer`` until SIGTERM, then report its records."""
    torch.set_num_threads(1)
    if skip_init:
        _skip_weight_init()
    logging.basicConfig(level=logging.WARNING, filename=f"{run_dir}/rollout_server-{index}.log")
    role = RolloutServer(config_from_dict(raw_cfg), index, node="local", run_dir=Path(run_dir))
    records = _instrument(role)
    code = role.run()
    width = {"batches": 4, "loads": 2}
    results.put(
        (index, code, {k: np.array(v, float).reshape(-1, width[k]) for k, v in records.items()})
    )


def server_config(name: str, redis_url: str, count: int, hidden: tuple, settings: dict) -> dict:
    """The run config the rollout servers load (CartPole spaces, an MLP of ``hidden`` sizes)."""
    return {
        "run": {"name": name, "mode": "async", "redis_url": redis_url},
        # (this process plays the weight broadcaster: the servers link to it for their weights)
        "roles": {
            "rollout_server": {"count": count, "settings": settings},
            "weight_broadcaster": {"count": 1},
        },
        "env": {"id": "CartPole-v1"},
        "policy": {"kind": "mlp", "hidden_sizes": list(hidden)},
    }


def policy_numel(raw_cfg: dict) -> int:
    """Length of the servers' flat weight buffer (the policy is built on the meta device)."""
    from rlvla3.policy.factory import build_policy

    with torch.device("meta"):
        return FlatLayout.of(build_policy(config_from_dict(raw_cfg))).numel


class ServerHarness:
    """``count`` real rollout servers, this process their weight broadcaster.

    Use as a context manager. Inside: ``addresses`` (each server's request endpoint, by index),
    ``publish(version)`` (a timed sync of ``flat``), and after exit ``records`` (index -> name ->
    array, see ``_instrument``).
    """

    def __init__(
        self,
        name: str,
        count: int,
        hidden: tuple,
        settings: dict | None = None,
        skip_init: bool = False,
    ) -> None:
        self.name, self.count, self.hidden = name, count, hidden
        self.settings, self.skip_init = settings or {}, skip_init
        self.records: dict[int, dict[str, np.ndarray]] = {}
        self.procs: list[Any] = []

    def __enter__(self) -> ServerHarness:
        self._redis = EmbeddedRedis().start()
        self._tmp = tempfile.TemporaryDirectory(prefix="rlvla3-bench-")
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        raw_cfg = server_config(self.name, self._redis.url, self.count, self.hidden, self.settings)
        self.registry = Registry(self._redis.url, self.name)
        self.store = start_store(HOST)
        self.broadcaster = Broadcaster(self.store)
        self.registry.register("weight_broadcaster", 0, node="local", host=HOST, pid=os.getpid())
        self.registry.heartbeat("weight_broadcaster", 0, 24 * 3600.0, {})
        self.registry.publish_endpoint(
            "weight_broadcaster", 0, "store", f"{HOST}:{self.store.port}"
        )
        self._results = _CTX.Queue()
        for i in range(self.count):
            args = (raw_cfg, i, self._tmp.name, self._results, self.skip_init)
            proc = _CTX.Process(target=_server_main, args=args, daemon=True)
            proc.start()
            self.procs.append(proc)
        self.flat = torch.empty(policy_numel(raw_cfg)).uniform_(-0.05, 0.05)
        for link_id in self._wait_endpoints("weights_link"):
            self.broadcaster.add(link_id)
        self.publish(0)
        self.addresses = self._wait_endpoints("requests")

    def _wait_endpoints(self, endpoint: str, timeout_s: float = 180.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while len(found := self.registry.endpoints("rollout_server", endpoint)) < self.count:
            if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs):
                raise RuntimeError(f"rollout servers did not start; logs in {self._tmp.name}")
            time.sleep(0.05)  # polling Redis for other processes' registrations
        return found

    def publish(self, version: int) -> tuple[float, float]:
        """Broadcast ``flat`` as ``version`` to every server; returns (start, end) monotonic."""
        self.flat[0] = version * 1e-6  # a new version differs in content, as a real one would
        started = time.monotonic()
        failed = self.broadcaster.publish(version, self.flat)
        ended = time.monotonic()
        if failed:
            raise RuntimeError(f"weight links failed: {failed}")
        return started, ended

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()  # SIGTERM: the role stops after its current step
        for _ in self.procs:
            try:
                index, _code, records = self._results.get(timeout=30)
                self.records[index] = records
            except Exception:
                break
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._redis.stop()
        self._tmp.cleanup()


# --- clients --------------------------------------------------------------------------------------
def obs_request(i: int) -> ObsRequest:
    """A CartPole observation request."""
    state = np.full(4, (i % 100) * 0.01, np.float32)
    return ObsRequest(env_key=f"0/{i % 64}", request_id=i, obs={"state": state})


def strict_client(address: str, duration_s: float) -> tuple[float, float, float]:
    """(req/s, window start, window end) of one DEALER doing strict request-reply through our
    codec and sockets."""
    sock = sockets.dealer()
    sock.connect(address)
    _roundtrips(sock, 200)  # warm-up: connection up, server loop hot
    started = time.monotonic()
    count = 0
    while (now := time.monotonic()) - started < duration_s:
        count += _roundtrips(sock, 100)
    sock.close()
    return count / (now - started), started, now


def _roundtrips(sock: sockets.MessageSocket, n: int) -> int:
    for i in range(n):
        sock.send(obs_request(i))
        reply = sock.recv(timeout_s=30)
        if not isinstance(reply, ActionReply):
            raise RuntimeError(f"no reply from the rollout server (got {reply!r})")
    return n


def batched_client(
    address: str, inflight: int, duration_s: float, codec: bool
) -> tuple[float, float, float]:
    """(obs/s, window start, window end) with ``inflight`` requests always outstanding.

    ``codec``: encode every request and decode every reply, as one env worker would; else send
    pre-encoded request bytes and only count replies, so the client costs little beside the
    server (64 envs are normally spread over several env-worker processes).
    """
    sock = sockets.dealer(hwm=10_000)
    sock.connect(address)
    frames = _frames(obs_request(0))

    def send(i: int) -> None:
        if codec:
            sock.send(obs_request(i))
        else:
            sock.raw.send_multipart(frames)

    def receive() -> None:
        reply = sock.recv(timeout_s=30) if codec else sock.poll(30) and sock.raw.recv_multipart()
        if not reply or (codec and not isinstance(reply, ActionReply)):
            raise RuntimeError("no reply from the rollout server")

    for i in range(inflight):
        send(i)
    for i in range(10 * inflight):  # warm-up
        receive()
        send(i)
    started, count = time.monotonic(), 0
    while (now := time.monotonic()) - started < duration_s:
        receive()
        send(count)
        count += 1
    sock.close()
    return count / (now - started), started, now


# --- the raw limit --------------------------------------------------------------------------------
def _frames(msg: Any) -> list[bytes]:
    return [bytes(memoryview(f)) for f in encode(msg)]


def _reply_frames() -> list[bytes]:
    return _frames(
        ActionReply(
            request_id=7,
            action=np.array(1, np.int64),
            env_action=np.array(1, np.int64),
            log_prob=-0.69,
            value=0.5,
            policy_version=3,
        )
    )


def _raw_echo_server(addresses: Any) -> None:
    """Process entry: a plain ROUTER answering every request with pre-built reply bytes."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    addresses.put(f"tcp://{HOST}:{sock.bind_to_random_port(f'tcp://{HOST}')}")
    reply = _reply_frames()
    while True:
        identity, *_ = sock.recv_multipart()
        sock.send_multipart([identity, *reply])


def _codec_echo_server(addresses: Any, with_policy: bool) -> None:
    """Process entry: our ROUTER socket and codec answering every ``ObsRequest``; with
    ``with_policy``, acting as ``_serve`` does (stack, the policy's numpy path, floats)."""
    torch.set_num_threads(1)
    sock = sockets.RouterSocket()
    addresses.put(sock.bind(HOST))
    policy = _cartpole_policy() if with_policy else None
    rng = np.random.default_rng(0)
    action, log_prob, value = np.array(1, np.int64), -0.69, 0.5
    while True:
        got = sock.recv_from(timeout_s=0.1)
        if got is None:
            continue
        identity, req = got
        if policy is not None:
            out = policy.act_numpy({"state": np.array([req.obs["state"]])}, False, rng)
            action, log_prob, value = out.action[0], out.log_prob.tolist()[0], out.value.tolist()[0]
        reply = ActionReply(
            request_id=req.request_id,
            action=np.asarray(action),
            env_action=None,
            log_prob=log_prob,
            value=value,
            policy_version=0,
        )
        sock.send_to(identity, reply)


def _cartpole_policy() -> Any:
    from rlvla3.policy.factory import build_policy

    return build_policy(config_from_dict({"policy": {"hidden_sizes": list(CARTPOLE_HIDDEN)}}))


def raw_client(address: str, duration_s: float) -> float:
    """Requests/s of a plain DEALER doing strict request-reply with pre-built request bytes."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    request = _frames(obs_request(0))
    for _ in range(200):
        sock.send_multipart(request)
        sock.recv_multipart()
    started = time.monotonic()
    count = 0
    while (elapsed := time.monotonic() - started) < duration_s:
        for _ in range(100):
            sock.send_multipart(request)
            sock.recv_multipart()
        count += 100
    sock.close()
    return count / elapsed


# --- measurements ---------------------------------------------------------------------------------
@contextlib.contextmanager
def echo_server(target: Any, *args: Any) -> Iterator[tuple[str, int]]:
    """An echo server (``target(addresses, *args)``) in its own process; yields its address
    and pid."""
    addresses = _CTX.Queue()
    server = _CTX.Process(target=target, args=(addresses, *args), daemon=True)
    server.start()
    try:
        yield addresses.get(timeout=60), server.pid
    finally:
        server.terminate()
        server.join(timeout=10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid``, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Run every thread of process ``pid`` on ``cpus`` only (threads it starts later inherit
    the affinity of the thread that starts them). Linux."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def placed_apart(server_pids: list[int], pin: bool) -> Iterator[str]:
    """With ``pin`` and at least two usable CPUs: this process (the client) on the first, the
    servers on the second, until the block ends; yields how the processes were placed.

    Ping-pong at batch 1 is mostly wake-ups: client, server and their ZeroMQ I/O threads hand
    each message on. Left to the scheduler, whether a server shares a core with its I/O thread
    or with the client changes from one process to the next, and with it the rate (the same
    server measured from about 5,700 to 11,500 req/s on the 2-core machine). Every case is
    placed alike, so the ratios compare servers, not placements.
    """
    usable = sorted(os.sched_getaffinity(0))
    if not pin or len(usable) < 2:
        yield "unpinned (left to the scheduler)"
        return
    for pid in server_pids:
        pin_threads(pid, {usable[1]})
    pin_threads(os.getpid(), {usable[0]})
    try:
        yield f"pinned: client on CPU {usable[0]}, servers on CPU {usable[1]}"
    finally:
        pin_threads(os.getpid(), set(usable))


def _with_cpu(pid: int, window: Any) -> tuple[float, float, float, float]:
    """``window()``'s ``(rate, start, end)`` and server ``pid``'s CPU µs per request in it."""
    before = cpu_seconds(pid)
    rate, start, end = window()
    return rate, start, end, (cpu_seconds(pid) - before) / (rate * (end - start)) * 1e6


def _in_windows(records: np.ndarray, windows: list[tuple[float, float]]) -> np.ndarray:
    """The ``(start, end, ...)`` records that started and ended inside one of the ``windows``."""
    inside = np.zeros(len(records), bool)
    for start, end in windows:
        inside |= (records[:, 0] >= start) & (records[:, 1] <= end)
    return records[inside]


BATCH1_CASES = ("ours", "codec_policy_echo", "codec_echo", "raw")
"""The batch-1 servers, from the real role to the raw limit."""


def measure_batch1(duration_s: float, repeats: int, pin: bool) -> dict[str, Any]:
    """Median req/s and server CPU µs per request at batch 1 for each of ``BATCH1_CASES``,
    windows interleaved; how the real server's time splits (``_serve`` / the rest); and how
    the processes were placed (``placed_apart``)."""
    with (
        ServerHarness("bench_rs_b1", 1, CARTPOLE_HIDDEN) as ours,
        echo_server(_codec_echo_server, True) as (policy_address, policy_pid),
        echo_server(_codec_echo_server, False) as (codec_address, codec_pid),
        echo_server(_raw_echo_server) as (raw_address, raw_pid),
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
    b = _in_windows(ours.records[0]["batches"], [(s, e) for _, s, e, _ in runs["ours"]])
    gaps = b[1:, 0] - b[:-1, 1]
    gaps = gaps[gaps < 0.5]  # not across the windows of the other cases
    result["ours_serve_ms"] = float(np.mean(b[:, 1] - b[:, 0]) * 1000)
    result["ours_between_ms"] = float(np.mean(gaps) * 1000)
    return result


def measure_policy_act(seconds: float = 1.0) -> float:
    """Mean ms of the model part of one batch-1 ``_serve``, in this process: stack the obs and
    run the policy's numpy path (``act_numpy``, what a CPU server runs), values to floats (what
    a raw echo does not do)."""
    policy = _cartpole_policy()
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
        batches = _in_windows(h.records[0]["batches"], [(start, end) for _, start, end in found])
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
    print(f"{'batch 1 (one strict client)':34} {'req/s':>9} {'/ raw':>6} {'server CPU/req':>15}")
    for key in BATCH1_CASES:
        print(
            f"{labels[key]:34} {r[f'batch1_{key}_req_per_s']:9.0f} "
            f"{r[f'batch1_{key}_req_per_s'] / r['batch1_raw_req_per_s']:6.2f} "
            f"{r[f'batch1_{key}_server_cpu_us']:12.1f} us"
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
    host = r["host"]
    print(
        f"host: {host['cpus']} CPUs, 1-min load average {host['load_avg_1m_before']:.1f} "
        f"before, {host['load_avg_1m_after']:.1f} after"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=3.0, help="seconds per window")
    parser.add_argument("--repeats", type=int, default=3, help="windows per case; median kept")
    parser.add_argument("--inflight", type=int, default=64, help="concurrent envs for (b)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="a few seconds of each case, for CI")
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
    load_before = os.getloadavg()[0]
    r: dict[str, Any] = run(args.duration_s, args.repeats, args.inflight, not args.no_pin)
    r["host"] = {
        "cpus": os.cpu_count(),
        "load_avg_1m_before": load_before,
        "load_avg_1m_after": os.getloadavg()[0],
    }
    print_table(r, args.inflight)
    write_result(args.json, "rollout_server", r, vars(args))


if __name__ == "__main__":
    main()
