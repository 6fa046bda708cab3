"""Weight broadcast over torch.distributed (gloo): every server gets identical tensors."""

from __future__ import annotations

import hashlib
import multiprocessing as mp

import torch
import torch.distributed as dist

from transport.weights import BUCKET_BYTES, Broadcaster, WeightLink, start_store

NUMEL = BUCKET_BYTES // 4 + 1000  # more than one bucket


def receiver(port: int, link_id: str, versions: int, results: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    link = WeightLink(store, link_id, 1, "cpu", timeout_s=60)
    out = torch.empty(NUMEL)
    for _ in range(versions):
        version = link.recv(out)
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
