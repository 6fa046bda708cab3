"""Weight broadcast over torch.distributed (gloo): every server gets identical tensors."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.conftest import wait_until
from transport.weight_fanout import Broadcaster
from transport.weights import BUCKET_BYTES, WeightLink, nccl_accepts, start_store

NUMEL = BUCKET_BYTES // 4 + 1000  # more than one bucket


def receiver(port: int, link_id: str, versions: int, results: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    link = WeightLink(store, link_id, 1, "cpu", timeout_s=60)
    out = torch.empty(NUMEL)
    for _ in range(versions):
        counter = out._version
        version = link.recv(out)
        # counted as an in-place write, so caches of the weights (act_numpy's) see it
        assert out._version > counter
        results.put((link_id, version, digest(out)))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def expected(version: int) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) * 1e-6 + version


def test_broadcast_identical_to_every_server_and_late_joiner_gets_current() -> None:
    ctx = mp.get_context("spawn")
    store = start_store("127.0.0.1", timeout_s=60)
    broadcaster = Broadcaster(store, timeout_s=60)
    results: mp.Queue = ctx.Queue()
    early = [ctx.Process(target=receiver, args=(store.port, f"s{i}", 3, results)) for i in range(2)]
    for p in early:
        p.start()
    try:
        for p_id in ("s0", "s1"):
            broadcaster.add(p_id)
        assert broadcaster.publish(0, expected(0)) == []
        late = ctx.Process(target=receiver, args=(store.port, "late", 3, results))
        late.start()
        broadcaster.add("late")  # gets version 0 at once
        for version in (1, 2):
            assert broadcaster.publish(version, expected(version)) == []
        got = [results.get(timeout=120) for _ in range(3 * 3)]
    finally:
        for p in [*early, late]:
            p.join(timeout=60)
    by_link: dict[str, list[int]] = {}
    for link_id, version, received in got:
        assert received == digest(expected(version))  # bit-identical to what was sent
        by_link.setdefault(link_id, []).append(version)
    assert by_link == {"s0": [0, 1, 2], "s1": [0, 1, 2], "late": [0, 1, 2]}


def test_a_broadcaster_without_weights_has_nothing_late_to_rejoin() -> None:
    """Before the trainer's first version, the link scan's rejoin finds nothing to do."""
    broadcaster = Broadcaster(start_store("127.0.0.1", timeout_s=10), timeout_s=10)
    assert broadcaster.rejoin_late(deadline_s=1.0) == ([], [])
    assert broadcaster.publish(0, expected(0), deadline_s=1.0) == []  # no links: sent to none


def test_a_link_no_server_joins_stalls_nothing_and_is_not_retried() -> None:
    """A link id whose server never joins here (a stale record, or a server linked to another
    store) forms on a worker thread: starting it returns at once, a linked server meanwhile
    gets every version, and after the link's timeout the id is reported failed, once."""
    ctx = mp.get_context("spawn")
    store = start_store("127.0.0.1", timeout_s=60)
    broadcaster = Broadcaster(store, timeout_s=6)  # the forming deadline
    results: mp.Queue = ctx.Queue()
    server = ctx.Process(target=receiver, args=(store.port, "real", 2, results))
    keys_before = store.num_keys()
    server.start()
    try:  # (the server's end of its link waits in the store: the deadline is for this end)
        wait_until(lambda: store.num_keys() > keys_before, 60, "the server at the store")
        started = time.monotonic()
        broadcaster.start_link("nobody")
        broadcaster.start_link("real")
        assert time.monotonic() - started < 0.5  # nothing waited for a server
        linked: list[str] = []
        wait_until(lambda: linked.extend(broadcaster.take_formed()[0]) or linked, 60, "link")
        # linked before "nobody" gave up: a link waiting for its server blocks no other's
        assert time.monotonic() - started < 3
        assert linked == ["real"] and "nobody" in broadcaster.linking
        for version in (0, 1):
            assert broadcaster.publish(version, expected(version), deadline_s=30) == []
        got = [results.get(timeout=60)[1] for _ in range(2)]
        failed: dict[str, str] = {}
        wait_until(lambda: failed.update(broadcaster.take_formed()[1]) or failed, 20, "timeout")
        assert time.monotonic() - started < 15
    finally:
        server.join(timeout=60)
    assert got == [0, 1]
    assert list(failed) == ["nobody"] and "timeout" in failed["nobody"]
    assert broadcaster.linking == {} and set(broadcaster.links) == {"real"}


def test_a_broadcaster_that_leaves_breaks_its_servers_pending_receive() -> None:
    """``close`` drops the connections (gloo's abort leaves them open): the server's wait for
    the next version fails at once, so it relinks."""
    ctx = mp.get_context("spawn")
    store = start_store("127.0.0.1", timeout_s=60)
    broadcaster = Broadcaster(store, timeout_s=60)
    results: mp.Queue = ctx.Queue()
    server = ctx.Process(target=_receive_until_broken, args=(store.port, results))
    server.start()
    try:
        broadcaster.add("s")
        broadcaster.publish(0, torch.zeros(3))
        assert results.get(timeout=60) == 0
        broadcaster.close()
        error = results.get(timeout=20)  # the version's number had it not failed
        assert isinstance(error, str) and ("closed" in error.lower() or "reset" in error.lower())
    finally:
        server.join(timeout=60)


def _receive_until_broken(port: int, results: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    link = WeightLink(store, "s", 1, "cpu", timeout_s=600)
    out = torch.empty(3)
    try:
        while True:
            results.put(link.recv(out))
    except RuntimeError as err:
        results.put(str(err))


@pytest.mark.slow  # 64 MB versions over gloo: about 25 s on 2 cores
def test_a_frozen_server_delays_no_broadcast_and_rejoins_when_it_comes_back() -> None:
    """A broadcast waits for a stopped server at most its deadline: the healthy server gets
    every version on time; the stopped one's link waits aside, and once it runs again it gets
    the late version and then the current one."""
    ctx = mp.get_context("spawn")
    store = start_store("127.0.0.1", timeout_s=60)
    broadcaster = Broadcaster(store, timeout_s=60)
    results: mp.Queue = ctx.Queue()
    servers = {i: ctx.Process(target=receiver, args=(store.port, i, 3, results)) for i in "ab"}
    for p in servers.values():
        p.start()
    try:
        for link_id in servers:
            broadcaster.add(link_id)
        assert broadcaster.publish(0, expected(0)) == []
        assert sorted(results.get(timeout=60)[0] for _ in servers) == ["a", "b"]
        os.kill(servers["b"].pid, signal.SIGSTOP)  # frozen: its socket buffers fill
        for version in (1, 2):
            started = time.monotonic()
            assert broadcaster.publish(version, expected(version), deadline_s=1.0) == []
            assert time.monotonic() - started < 10  # not the link's 60 s timeout
            assert results.get(timeout=60)[:2] == ("a", version)
        assert set(broadcaster.late) == {"b"} and set(broadcaster.links) == {"a"}
        os.kill(servers["b"].pid, signal.SIGCONT)
        rejoined: list[str] = []
        wait_until(
            lambda: rejoined.extend(broadcaster.rejoin_late(deadline_s=30)[0]) or rejoined,
            60,
            "the server to come back",
        )
        assert rejoined == ["b"] and set(broadcaster.links) == {"a", "b"}
        got = [results.get(timeout=60) for _ in range(2)]
    finally:
        for p in servers.values():
            os.kill(p.pid, signal.SIGCONT)
            p.join(timeout=60)
    assert [(link, version) for link, version, _ in got] == [("b", 1), ("b", 2)]
    assert all(received == digest(expected(version)) for _, version, received in got)


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def test_the_weight_store_listens_on_its_host_only() -> None:
    store = start_store("127.0.0.1", timeout_s=10)
    assert _listening_addresses(store.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_publisher_resends_the_last_version_unchanged_and_follows_a_moved_broadcaster(
    monkeypatch,
) -> None:
    """A version whose send found no room is sent again later, same number and weights (never a
    new version without training), without blocking; a broadcaster at a new address gets it."""
    import transport.weight_publisher as publisher_mod
    from transport import sockets
    from transport.messages import WeightsUpdate
    from transport.weight_publisher import WeightPublisher

    monkeypatch.setattr(publisher_mod, "_SEND_TIMEOUT_S", 0.05)
    monkeypatch.setattr(publisher_mod, "_RETRY_S", 0.0)
    monkeypatch.setattr(publisher_mod, "_LOOKUP_EVERY_S", 0.0)
    model = torch.nn.Linear(3, 2)
    address = {"now": "tcp://127.0.0.1:9"}  # nobody listens: the queue fills
    announced: list[int] = []
    publisher = WeightPublisher(model, lambda: address["now"], announce=announced.append)
    while publisher.last_sent:
        publisher.publish(model)
    last = publisher.version
    assert not publisher.resend_if_due()  # still no room: nothing sent, nothing new
    assert publisher.version == last and announced[-1] == last

    receiver = sockets.pull(hwm=16)
    port = receiver.raw.bind_to_random_port("tcp://127.0.0.1")
    address["now"] = f"tcp://127.0.0.1:{port}"  # the broadcaster restarted elsewhere
    with torch.no_grad():
        model.weight.add_(1.0)  # trained since: the resend must still carry the old weights
    assert publisher.resend_if_due()
    update = receiver.recv(timeout_s=5)
    assert isinstance(update, WeightsUpdate) and update.version == last
    assert publisher.version == last and announced[-1] == last
    assert not np.allclose(update.flat[:6], model.weight.detach().numpy().ravel())
    publisher.close()
    receiver.close()


def test_a_trainer_publishing_back_to_back_follows_a_restarted_broadcaster(monkeypatch) -> None:
    """A trainer that trains without pause never calls ``resend_if_due`` in time: its next
    publish after a failed one finds the broadcaster's new address itself, and publishing
    does not wait for room while the broadcaster is away."""
    import transport.weight_publisher as publisher_mod
    from transport import sockets
    from transport.messages import WeightsUpdate
    from transport.weight_publisher import WeightPublisher

    monkeypatch.setattr(publisher_mod, "_SEND_TIMEOUT_S", 0.2)
    model = torch.nn.Linear(3, 2)
    address = {"now": "tcp://127.0.0.1:9"}  # the broadcaster died: nobody listens
    publisher = WeightPublisher(model, lambda: address["now"])
    while publisher.last_sent:
        publisher.publish(model)
    started = time.monotonic()
    for _ in range(5):
        publisher.publish(model)
    assert time.monotonic() - started < 0.2  # no publish waited for room
    receiver = sockets.pull(hwm=16)
    port = receiver.raw.bind_to_random_port("tcp://127.0.0.1")
    address["now"] = f"tcp://127.0.0.1:{port}"  # its successor
    version = publisher.publish(model)
    update = receiver.recv(timeout_s=5)
    assert isinstance(update, WeightsUpdate) and update.version == version
    assert publisher.last_sent
    publisher.close()
    receiver.close()


def test_nccl_links_two_gpus_or_one_gpu_shared_under_distinct_host_ids():
    assert nccl_accepts(("GPU-a", ""), ("GPU-b", ""))
    assert not nccl_accepts(("GPU-a", ""), ("GPU-a", ""))  # NCCL: "Duplicate GPU detected"
    assert not nccl_accepts(("GPU-a", "h1"), ("GPU-a", ""))  # the other end is still the host
    assert not nccl_accepts(("GPU-a", "h1"), ("GPU-a", "h1"))
    assert nccl_accepts(("GPU-a", "h1"), ("GPU-a", "h2"))


@pytest.mark.parametrize("shared_gpu", [False, True])
def test_roles_get_their_own_nccl_host_id_only_when_asked(monkeypatch, tmp_path, shared_gpu):
    """``run.nccl_shared_gpu`` gives each role process a distinct ``NCCL_HOSTID``; a value the
    user set wins; off, none is set (NCCL keeps NVLink and shared memory between GPUs)."""
    import subprocess

    from rlvla3.launch import processes

    envs: list[dict] = []

    class FakePopen:
        def __init__(self, args, env, **kwargs):
            envs.append(env)

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    ctx = processes.SpawnContext(
        config_path=tmp_path / "config.yaml",
        run_dir=tmp_path,
        address="127.0.0.1",
        nccl_host_ids=shared_gpu,
    )
    for role, index in (("weight_broadcaster", 0), ("rollout_server", 0), ("rollout_server", 1)):
        proc = processes.RoleProcess(role, index, "gpu-0", tmp_path / f"{role}{index}.log")
        processes.spawn(proc, ctx)
    ids = [env.get("NCCL_HOSTID") for env in envs]
    if shared_gpu:
        assert len(set(ids)) == 3 and all(ids)
    else:
        assert ids == [None, None, None]
    monkeypatch.setenv("NCCL_HOSTID", "mine")
    processes.spawn(processes.RoleProcess("trainer", 0, "gpu-0", tmp_path / "t.log"), ctx)
    assert envs[-1]["NCCL_HOSTID"] == "mine"


def test_the_send_deadline_grows_with_a_version_too_large_for_it() -> None:
    from roles.weight_broadcaster import SLOW_LINK_MB_PER_S, send_deadline_s

    assert send_deadline_s(2.0, 1_000_000) == 2.0  # 4 MB: the setting
    seven_b = 7_000_000_000  # a 7B model's float32 version: 28 GB
    assert send_deadline_s(2.0, seven_b) == pytest.approx(28_000 / SLOW_LINK_MB_PER_S)
