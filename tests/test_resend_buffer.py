"""At-least-once chunk delivery, the producer's side: the resend buffer and a chunk sink that
resends over a real socket (``roles/env/resend_buffer.py``, ``roles/env/chunk_sink.py``)."""

from __future__ import annotations

import dataclasses
import threading
import time

import msgspec

from roles.env.chunk_sink import ChunkSink, ChunkStream, Transitions
from roles.env.peers import Peers
from roles.env.resend_buffer import ResendBuffer
from tests.env_fakes import RecordingCounters
from tests.test_grpo import chunk
from transport import sockets
from transport.messages import TrajectoryChunk


def numbered(chunk_id: int, producer: str = "0/0#a") -> TrajectoryChunk:
    return msgspec.structs.replace(chunk(producer, "", [0.0], ends=False), chunk_id=chunk_id)


def steps() -> Transitions:
    """One step's transitions, as an env group hands them to the sink."""
    one = numbered(0)
    return Transitions(**{f.name: getattr(one, f.name) for f in dataclasses.fields(Transitions)})


def test_the_buffer_is_bounded_and_lets_the_oldest_go() -> None:
    buffer = ResendBuffer(3)
    overflow = [buffer.add(numbered(i)) for i in range(5)]
    assert overflow == [0, 0, 0, 1, 1] and len(buffer) == 3
    buffer.request_resend()
    assert [c.chunk_id for c in buffer.take_resend()] == [2, 3, 4]


def test_nothing_is_resent_until_a_trainer_restarts_and_then_once() -> None:
    buffer = ResendBuffer(8)
    for i in range(3):
        buffer.add(numbered(i))
    assert buffer.take_resend() == []
    buffer.request_resend()
    assert [c.chunk_id for c in buffer.take_resend()] == [0, 1, 2]
    assert buffer.take_resend() == [] and len(buffer) == 3  # kept until settled


def test_settled_marks_trim_each_producer_oldest_first() -> None:
    buffer = ResendBuffer(8)
    for i in range(3):
        buffer.add(numbered(i, "0/0#a"))
        buffer.add(numbered(i, "0/1#a"))
    buffer.acknowledge({"0/0#a": 2, "0/1#a": 1, "9/9#z": 5})
    buffer.request_resend()
    kept = [(c.producer, c.chunk_id) for c in buffer.take_resend()]
    assert kept == [("0/1#a", 1), ("0/0#a", 2), ("0/1#a", 2)]


def test_a_buffer_of_zero_keeps_nothing() -> None:
    buffer = ResendBuffer(0)
    assert buffer.add(numbered(0)) == 0 and len(buffer) == 0
    assert buffer.resend_from("0/0#a", 7) == 7  # nothing older can go out again


def test_resend_from_is_each_producers_oldest_kept_chunk() -> None:
    """What a trainer may give up: below the oldest chunk kept, per producer, through
    overflow and acknowledgements; a producer with none kept resends nothing older."""
    buffer = ResendBuffer(4)
    for i in range(3):
        buffer.add(numbered(i, "0/0#a"))
        buffer.add(numbered(i, "0/1#a"))
    # 6 pushed into room for 4: chunks 0 of both producers let go
    assert buffer.resend_from("0/0#a", 3) == 1 and buffer.resend_from("0/1#a", 3) == 1
    buffer.acknowledge({"0/0#a": 3, "0/1#a": 2})
    assert buffer.resend_from("0/0#a", 3) == 3 and buffer.resend_from("0/1#a", 3) == 2
    assert buffer.resend_from("9/9#z", 5) == 5


def open_sink(
    address: str,
    kept: int,
    counters: RecordingCounters,
    worker_index: int = 0,
    tag_key=b"",
    delivery: sockets.DeliveryContext | None = None,
) -> ChunkSink:
    """An env worker's chunk sink pushing to ``address``, keeping ``kept`` chunks to resend."""
    sink = ChunkSink(
        delivery=delivery,
        worker_index=worker_index,
        trains=True,
        peers=Peers([], [address]),
        queue_hwm=100,
        resend=ResendBuffer(kept),
        tag_key=tag_key,
        counters=counters,
        stop_event=threading.Event(),
    )
    sink.open()
    return sink


def test_the_sink_pushes_kept_chunks_again_before_the_next_one() -> None:
    receiver = sockets.pull(hwm=100)
    address = receiver.bind()
    counters = RecordingCounters()
    sink = open_sink(address, 2, counters)
    try:
        stream = ChunkStream(0, "0/0#a")
        for _ in range(3):
            sink.push(stream, steps(), bootstrap_value=0.0)
        sink.resend.request_resend()
        sink.push(stream, steps(), bootstrap_value=0.0)
        got = [receiver.recv(timeout_s=5.0) for _ in range(6)]
        assert [c.chunk_id for c in got] == [0, 1, 2, 1, 2, 3]  # 0 let go (the bound is 2)
        # each its producer's oldest kept when it was pushed (resent ones keep theirs)
        assert [c.resend_from for c in got] == [0, 0, 0, 0, 0, 1]
        assert counters.counters == {
            "chunks_produced": 4,
            "chunks_resent": 2,
            "chunks_resend_overflow": 2,
        }
    finally:
        sink.close()
        receiver.close()


def test_a_resend_due_at_the_stop_is_pushed_at_exit_to_the_restarted_trainer() -> None:
    """A trainer restarted; the runner stopped (or sat paused by back-pressure) before its next
    push: what it keeps goes to the new trainer from a socket of its own, not lost with the
    process. What was queued for the dead trainer is dropped at the close, not waited for."""
    dead = sockets.pull(hwm=1)
    dead_address = dead.bind()
    dead.close()  # the killed trainer: its address takes nothing any more
    counters = RecordingCounters()
    delivery = sockets.DeliveryContext()
    sink = open_sink(dead_address, 8, counters, delivery=delivery)
    stream = ChunkStream(0, "0/0#a")
    for _ in range(3):
        sink.push(stream, steps(), bootstrap_value=0.0)
    successor = sockets.pull(hwm=100)
    try:
        sink.peers.trainers = [successor.bind()]  # the worker read the new trainer's address
        sink.resend.acknowledge({"0/0#a": 1})  # chunk 0 was settled before the kill
        sink.resend.request_resend()
        sink.stop_event.set()
        sink.close()  # the runner ends
        sink.resend_at_exit(time.monotonic() + 5.0)
        got = [successor.recv(timeout_s=5.0) for _ in range(2)]
        assert [c.chunk_id for c in got] == [1, 2]
        assert successor.recv(timeout_s=0.2) is None
        assert counters.counters["chunks_resent"] == 2
        sink.resend_at_exit(time.monotonic() + 5.0)  # nothing due any more
        assert successor.recv(timeout_s=0.2) is None
        # what was queued for the dead trainer does not hold the exit (its linger is 10 s)
        assert delivery.finish(timeout_s=2.0)
    finally:
        successor.close()


def test_nothing_is_pushed_at_exit_without_a_trainer_restart() -> None:
    receiver = sockets.pull(hwm=100)
    counters = RecordingCounters()
    sink = open_sink(receiver.bind(), 8, counters)
    try:
        sink.push(ChunkStream(0, "0/0#a"), steps(), bootstrap_value=0.0)
        assert receiver.recv(timeout_s=5.0).chunk_id == 0
        sink.stop_event.set()
        sink.close()
        sink.resend_at_exit(
            time.monotonic() + 5.0
        )  # unsettled, but in the live trainer's hands: no duplicate
        assert receiver.recv(timeout_s=0.2) is None and "chunks_resent" not in counters.counters
    finally:
        receiver.close()
