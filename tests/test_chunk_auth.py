"""Chunk tags (transport/chunk_auth.py): in a multi-host run a trainer counts a chunk for the
producer it names only when the chunk carries that env worker's tag, so a peer holding the
run's CURVE keys cannot move another producer's settled mark (docs/reliability.md)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from rlvla3.runtime import run_secret
from rlvla3.runtime.chunk_accounting import ChunkAccounting
from rlvla3.runtime.chunk_ledger import balance, pushed_field, settled_field
from rlvla3.runtime.role_keys import keys_for
from roles.env.chunk_sink import ChunkStream
from tests.env_fakes import RecordingCounters
from tests.test_learners import FakeTrainer, numbered
from tests.test_resend_buffer import open_sink, steps
from transport import sockets
from transport.chunk_auth import ChunkTagCheck, chunk_check_key, chunk_tag, header_of
from transport.messages import TrajectoryChunk


def tagged(chunk: TrajectoryChunk, key: bytes) -> TrajectoryChunk:
    """``chunk`` with the tag of the producer key ``key`` over its names and numbers."""
    return msgspec.structs.replace(chunk, tag=chunk_tag(key, header_of(chunk)))


@pytest.fixture
def secret() -> str:
    return run_secret.new_secret()


def test_a_chunk_passes_only_with_its_own_workers_tag_over_its_own_names(secret) -> None:
    check = ChunkTagCheck(keys_for("trainer", secret, index=0).chunk_check)
    worker_0 = keys_for("env_worker", secret, index=0).chunk_sign
    worker_1 = keys_for("env_worker", secret, index=1).chunk_sign
    genuine = tagged(numbered(5, producer="0/2#abc"), worker_0)
    assert check.problem(genuine) is None
    assert check.problem(tagged(numbered(5, producer="0/2#abc"), worker_1)) == (
        "tag: not the key of env worker 0, which the chunk claims"
    )
    for change in (
        {"chunk_id": 2**40},
        {"resend_from": 5, "chunk_id": 6},
        {"producer": "0/3#abc"},
        {"env_index": 3},
        {"group": "0/2#abc:7"},
    ):
        altered = msgspec.structs.replace(genuine, **change)
        assert (
            check.problem(altered) == "tag: not the key of env worker 0, which the chunk claims"
        ), change
    untagged = msgspec.structs.replace(genuine, tag=b"")
    assert (
        check.problem(untagged) == "tag: 0 bytes, expected 32 (every chunk of this run is tagged)"
    )
    # worker 1 tags a chunk as itself but under worker 0's producer name: not its name
    posing = tagged(msgspec.structs.replace(genuine, worker_index=1), worker_1)
    assert check.problem(posing) == "producer: '0/2#abc' is not env worker 1's"
    grouped = tagged(msgspec.structs.replace(genuine, group="1/0#abc:3"), worker_0)
    assert check.problem(grouped) == "group: '1/0#abc:3' is not env worker 0's"


def _trainer_accounting(chunk_key: bytes) -> tuple[FakeTrainer, ChunkAccounting]:
    role = FakeTrainer()
    role.chunk_key = chunk_key  # what main sets from the role's keys (b"": a one-host run)
    return role, ChunkAccounting(role, flush_counters=role.flush)  # type: ignore[arg-type]


def _far_chunk(key: bytes) -> TrajectoryChunk:
    """Env worker 0's producer name, number and ``resend_from`` 2**40, tagged with ``key``."""
    return tagged(msgspec.structs.replace(numbered(0), chunk_id=2**40, resend_from=2**40), key)


def test_without_tags_a_far_numbered_chunk_lifts_a_producers_mark() -> None:
    """The attack the tags stop, as a one-host run's accounting (no keys) takes it: a chunk
    recorded with ``resend_from`` 2**40 gives up every number below it, and the producer's
    own next chunks are dropped as duplicates."""
    role, accounting = _trainer_accounting(b"")
    forged = accounting.receive(_far_chunk(b"any key"))
    assert forged is not None
    accounting.record(forged)
    assert accounting.receive(numbered(0)) is None and role.counters["chunks_duplicate"] == 1


def test_a_forged_chunk_moves_no_genuine_producers_mark(secret) -> None:
    """A peer with the run's CURVE keys (here env worker 1's bundle) sends a chunk under env
    worker 0's producer name, number 2**40 and ``resend_from`` 2**40: the trainer's accounting
    refuses it as it arrives, as a bad chunk no producer is charged with; the producer's mark
    stays, its own chunks after it are received, not dropped as duplicates, and the balance
    adds up."""
    role, accounting = _trainer_accounting(keys_for("trainer", secret, index=0).chunk_check)
    worker_0 = keys_for("env_worker", secret, index=0).chunk_sign
    assert (
        accounting.receive(_far_chunk(keys_for("env_worker", secret, index=1).chunk_sign)) is None
    )
    assert role.counters["bad_chunks_unattributed"] == 1 and role.counters["chunks_dropped"] == 1
    assert not role.highs and role.counters["chunks_received"] == 1
    genuine = [accounting.receive(tagged(numbered(i), worker_0)) for i in range(3)]
    assert all(c is not None for c in genuine) and role.counters["chunks_duplicate"] == 0
    for chunk in genuine:
        accounting.record(chunk)
    accounting.trained(genuine, samples=3, left_out=0, lags=np.array([0]))
    assert role.highs[settled_field("0/0#x")] == 3
    role.flush()
    result = balance({**role.ledger, **role.highs, pushed_field("0/0#x"): 2}, role.counters)
    assert (result.produced, result.consumed, result.dropped, result.lost) == (4, 3, 1, 0)
    assert result.balanced, result


def test_a_one_host_run_tags_nothing_and_checks_nothing() -> None:
    _, accounting = _trainer_accounting(b"")
    chunk = accounting.receive(numbered(0))
    assert chunk is not None and chunk.tag == b"" and accounting.attribution_problem(chunk) is None
    with pytest.raises(ValueError, match="check_key: empty"):
        ChunkTagCheck(b"")


def test_each_worker_key_is_its_own_and_reveals_no_other(secret) -> None:
    check = chunk_check_key(secret)
    keys = {keys_for("env_worker", secret, index=i).chunk_sign for i in range(8)}
    assert len(keys) == 8 and check not in keys
    assert keys_for("env_worker", run_secret.new_secret(), index=0).chunk_sign not in keys


def test_a_workers_sink_tags_every_chunk_it_pushes_and_resends(secret) -> None:
    """The env worker's side: each chunk (resent ones with the tag they were pushed with)
    passes the trainer's check over the socket."""
    receiver = sockets.pull(hwm=100)
    address = receiver.bind()
    worker_3 = keys_for("env_worker", secret, index=3).chunk_sign
    sink = open_sink(address, 4, RecordingCounters(), worker_index=3, tag_key=worker_3)
    try:
        stream = ChunkStream(1, "3/1#a")
        for _ in range(2):
            sink.push(stream, steps(), bootstrap_value=0.0)
        sink.resend.request_resend()
        sink.push(stream, steps(), bootstrap_value=0.0)
        got = [receiver.recv(timeout_s=5.0) for _ in range(5)]
        assert [c.chunk_id for c in got] == [0, 1, 0, 1, 2]
        check = ChunkTagCheck(keys_for("trainer", secret, index=0).chunk_check)
        assert [check.problem(c) for c in got] == [None] * 5
    finally:
        sink.close()
        receiver.close()
