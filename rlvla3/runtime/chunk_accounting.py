"""The RL trainer's side of the chunk accounting: every chunk it takes off its queue is counted
and settled as consumed, dropped, in flight at exit, or lost (``chunk_ledger.py`` explains the
balance these figures make).

The trainer reports what happens to each chunk; this component turns that into counters and
chunk ledger entries (the highest sequence number received per producer, the chunks held in
the trainer's buffer), and writes off what no trainer will ever see: a killed predecessor's
buffer, and chunks counted as pushed that never arrived.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

import numpy as np

from rlvla3.runtime.chunk_ledger import buffered_field, received_field
from rlvla3.runtime.role import Role
from transport.messages import TrajectoryChunk
from transport.sockets import MessageSocket

_WRITE_OFF_AFTER_S = 1.0  # an empty queue this long while chunks count as queued: they are lost
_DRAIN_S = 5.0  # the longest a stopping trainer takes chunks off its queue

_STALENESS_COUNTERS = (
    "trained_staleness_0",
    "trained_staleness_1",
    "trained_staleness_2",
    "trained_staleness_3plus",
)


MAX_NAME_LEN = 128
"""Longest ``producer`` or ``group`` a chunk may carry (env workers' are under 40)."""
_NAME = re.compile(r"[A-Za-z0-9_.:/#+-]*")
"""What a ``producer`` or ``group`` is made of (``worker/env#incarnation``, ``...:round``)."""


def producer_problem(chunk: TrajectoryChunk) -> str | None:
    """Why the chunk's producer, group and number cannot go into the chunk ledger, where the
    producer becomes a Redis field name (None: they can)."""
    if not chunk.producer:
        return "producer: empty (the chunk accounting needs it)"
    for field in ("producer", "group"):
        problem = name_problem(getattr(chunk, field))
        if problem is not None:
            return f"{field}: {problem}"
    if not 0 <= chunk.chunk_id < 2**53:
        return f"chunk_id: {chunk.chunk_id}, expected a sequence number from 0"
    return None


def name_problem(name: str) -> str | None:
    """Why ``name`` is no producer or group name: too long, or a character outside
    ``[A-Za-z0-9_.:/#+-]`` (None: it is one)."""
    if len(name) > MAX_NAME_LEN:
        return f"{len(name)} characters, over {MAX_NAME_LEN}"
    if _NAME.fullmatch(name) is None:
        return f"{name!r:.40} has characters outside [A-Za-z0-9_.:/#+-]"
    return None


class ChunkAccounting:
    """Counts and ledger entries of one trainer's chunks.

    Args:
        role: the trainer; its counters and ledger entries carry the accounting.
        flush_counters: sends the role's pending counters to Redis now (a write-off reads the
            backlog there, which must not lag behind this trainer's own counts).
    """

    def __init__(self, role: Role, flush_counters: Callable[[], None]) -> None:
        self.role = role
        self.me = f"{role.name}/{role.index}"
        self._flush_counters = flush_counters
        self._last_arrival = time.monotonic()

    # --- at start ------------------------------------------------------------------------------
    def write_off_dead_buffer(self) -> None:
        """Chunks an earlier process of this trainer held in its buffer when it was killed are
        lost: say so in the accounting (``chunks_lost_in_trainer``)."""
        held = self.role.registry.chunk_ledger().get(buffered_field(self.me), 0)
        if held > 0:
            self.role.count("chunks_lost_in_trainer", held)
            self.role.ledger_add(buffered_field(self.me), -held)
            self._flush_counters()
            self.role.log.warning(
                "%d chunks died in the buffer of the trainer before this one", held
            )

    def write_off_lost_chunks(self) -> None:
        """Chunks counted as pushed that no trainer will ever receive stop counting as queued,
        so the env workers' back-pressure (``max_chunks_queued``) cannot wait for them forever.

        Called at start (a killed trainer's queue died with it) and whenever nothing arrived
        for a second: an empty socket while Redis says chunks are queued means they are lost
        (or their counters lag; writing those off only relaxes the back-pressure a little).
        """
        self._flush_counters()  # our own chunks_received must not lag behind
        backlog = self.role.registry.chunk_backlog()
        if backlog > 0:
            self.role.count("chunks_written_off", backlog)
            self.role.log.info(
                "%d chunks counted as pushed were never received: written off", backlog
            )

    # --- receiving -----------------------------------------------------------------------------
    def receive(self, message: object | None) -> TrajectoryChunk | None:
        """Count what the chunk queue gave (None: nothing within the wait); returns it if it is
        a chunk. After a second of nothing, what still counts as queued is written off."""
        now = time.monotonic()
        if message is None:
            if now - self._last_arrival >= _WRITE_OFF_AFTER_S:
                self.write_off_lost_chunks()
                self._last_arrival = time.monotonic()
            return None
        self._last_arrival = now
        if not isinstance(message, TrajectoryChunk):
            self.role.drop("bad_frames", f"dropped a {type(message).__name__} on the chunk queue")
            return None
        self.role.count("chunks_received")  # env workers' back-pressure reads this
        return message

    def refuse(self, chunk: TrajectoryChunk, problem: str) -> None:
        """A received chunk failed the checks: dropped, and counted as such, so the chunk
        accounting adds up (not in the ledger: its producer and number are not trusted)."""
        self.role.drop(
            "chunks_dropped",
            f"dropped chunk {chunk.chunk_id} of env worker {chunk.worker_index}: {problem}",
        )
        self.role.count("bad_chunks")
        self.role.count("samples_dropped", int(np.size(chunk.rewards)))

    def record(self, chunk: TrajectoryChunk) -> None:
        """Note a checked chunk's sequence number in the ledger (received from its producer)."""
        self.role.ledger_high(received_field(chunk.producer, self.me), chunk.chunk_id)

    def drop_received(self, chunk: TrajectoryChunk, reason: str) -> None:
        """A recorded chunk is not held (too stale): dropped, with its samples."""
        self.role.drop("chunks_dropped", reason)
        self.role.count("samples_dropped", len(chunk.rewards))

    def hold(self) -> None:
        """A recorded chunk goes to the learner: one more in this trainer's buffer."""
        self.role.ledger_add(buffered_field(self.me), 1)

    # --- settling held chunks ------------------------------------------------------------------
    def drop_held(self, chunks: Sequence[TrajectoryChunk], reason: str) -> None:
        """Drop chunks the trainer holds (buffered, or waiting for their group), counted."""
        self.role.drop("chunks_dropped", reason)
        if len(chunks) > 1:
            self.role.count("chunks_dropped", len(chunks) - 1)
        self.role.count("samples_dropped", sum(len(c.rewards) for c in chunks))
        self.role.ledger_add(buffered_field(self.me), -len(chunks))

    def trained(
        self, chunks: Sequence[TrajectoryChunk], samples: int, left_out: int, lags: np.ndarray
    ) -> None:
        """An update consumed ``chunks``: ``samples`` env steps trained, ``left_out`` left out
        as too stale, ``lags`` the trained steps' versions behind the trainer (the monitor's
        staleness distribution)."""
        if left_out:
            self.role.count("samples_dropped", left_out)
        for lag, name in enumerate(_STALENESS_COUNTERS):
            n = int((lags == lag).sum()) if lag < 3 else int((lags >= 3).sum())
            if n:
                self.role.count(name, n)
        self.role.count("chunks_consumed", len(chunks))
        self.role.ledger_add(buffered_field(self.me), -len(chunks))
        self.role.count("samples_consumed", samples)

    # --- at exit -------------------------------------------------------------------------------
    def drain(self, queue: MessageSocket, held: int) -> None:
        """Take the chunks still queued at exit and count them with the ``held`` ones as in
        flight, so produced = consumed + dropped + these (+ lost). Bounded in time: a trainer
        that stops alone (it failed) has env workers still pushing, and what it leaves
        queued its successor writes off."""
        queued = 0
        deadline = time.monotonic() + _DRAIN_S
        while time.monotonic() < deadline and (chunk := queue.recv(timeout_s=0.5)) is not None:
            if not isinstance(chunk, TrajectoryChunk):
                continue
            queued += 1
            # received now, so a restarted trainer does not write them off a second time
            self.role.count("chunks_received")
            if producer_problem(chunk) is None:
                self.record(chunk)
        self.role.ledger_add(buffered_field(self.me), -held)
        self.role.count("chunks_in_flight_at_exit", held + queued)
