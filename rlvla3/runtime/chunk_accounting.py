"""The RL trainer's side of the chunk accounting: every chunk it takes off its queue is counted
and settled as consumed, dropped, in flight at exit, or lost (``chunk_ledger.py`` explains the
balance these figures make).

The trainer reports what happens to each chunk; this component turns that into counters and
chunk ledger entries (the highest sequence number received per producer, the chunks held in
the trainer's buffer, the settled mark that acknowledges chunks to their producers:
``rlvla3/runtime/chunk_acks.py``), drops resent chunks it already has as duplicates, hands a
killed or failed predecessor's buffer back to the producers that resend it, and writes off
chunks counted as pushed that never arrived.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

import numpy as np

from rlvla3.runtime.chunk_acks import SettledMarks, count_trainer_start, hand_back_chunks
from rlvla3.runtime.chunk_ledger import (
    buffered_field,
    received_field,
    refused_field,
    settled_field,
)
from rlvla3.runtime.counter_batch import DropReports
from rlvla3.runtime.log_text import loggable
from rlvla3.runtime.role import Role
from transport.chunk_auth import ChunkTagCheck
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
        resent: env workers keep resend buffers (``resend_buffer_chunks`` > 0), so a killed
            trainer's buffer is delivered again rather than lost.
    What settles or receives a chunk is counted in one ``role.counting_together()`` block, so
    that a flush from the heartbeat thread never takes half of it.
    """

    def __init__(
        self,
        role: Role,
        flush_counters: Callable[[], None],
        *,
        resent: bool = True,
    ) -> None:
        self.role = role
        self.me = f"{role.name}/{role.index}"
        self._flush_counters = flush_counters
        self._together = role.counting_together
        self._last_arrival = time.monotonic()
        self.resent = resent
        # a multi-host run's trainer checks every chunk's tag; a one-host run's carry none
        self.tags = ChunkTagCheck(role.chunk_key) if role.chunk_key else None
        self.marks: SettledMarks[str] = SettledMarks.from_ledger(role.registry.chunk_ledger())
        self._drop_reports = DropReports()

    def attribution_problem(self, chunk: TrajectoryChunk) -> str | None:
        """Why the chunk cannot be counted for the producer it names (None: it can): a name
        or number the ledger cannot hold (``producer_problem``), or, in a multi-host run, a
        tag that is not its env worker's (``transport/chunk_auth.py``). Such a chunk never
        enters the settled marks, so it cannot move a genuine producer's."""
        problem = producer_problem(chunk)
        if problem is None and self.tags is not None:
            problem = self.tags.problem(chunk)
        return problem

    # --- at start ------------------------------------------------------------------------------
    def write_off_dead_buffer(self) -> None:
        """Chunks an earlier process of this trainer held in its buffer when it was killed (or
        failed: ``hand_back``) go back to their producers, which resend them
        (``chunks_returned``: they count as received again when they arrive); without resend
        buffers they are lost (``chunks_lost_in_trainer``)."""
        held = self.role.registry.chunk_ledger().get(buffered_field(self.me), 0)
        if held > 0:
            fate = "chunks_returned" if self.resent else "chunks_lost_in_trainer"
            with self._together():
                self.role.count(fate, held)
                self.role.ledger_add(buffered_field(self.me), -held)
            self._flush_counters()
            self.role.log.warning(
                "%d chunks were in the buffer of the trainer before this one: %s",
                held,
                "their producers resend them" if self.resent else "lost",
            )

    def start_taking_chunks(self) -> None:
        """The chunk socket is bound and published: write off what a killed predecessor's queue
        held, then tell the env workers to resend what no trainer settled."""
        self.write_off_lost_chunks()
        count_trainer_start(self.role.registry)

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
        a chunk received for the first time from the producer it names. A chunk that cannot be
        counted for that producer (``attribution_problem``) is refused here, before it can
        touch the marks. After a second of nothing, what still counts as queued is written
        off."""
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
        problem = self.attribution_problem(message)
        with self._together():  # received and in the buffer's count: one flush
            if problem is None and self._duplicate(message):
                return None
            self.role.count("chunks_received")  # env workers' back-pressure reads this
        if problem is not None:
            self.refuse(message, problem)
            return None
        return message

    def _duplicate(self, chunk: TrajectoryChunk) -> bool:
        """Whether ``chunk`` (attributable) was received before (then counted as a duplicate).
        A chunk that was not is in this trainer's buffer (the ledger's count) until it is
        settled."""
        if self.marks.is_duplicate(chunk.producer, chunk.chunk_id):
            self.role.count("chunks_duplicate")
            return True
        self.marks.receive(chunk.producer, chunk.chunk_id)
        self.role.ledger_add(buffered_field(self.me), 1)
        return False

    def _settle(self, chunks: Sequence[TrajectoryChunk], fate: str) -> None:
        """Chunks trained on or dropped (``fate``: the counter that says which)."""
        for chunk in chunks:
            self._settle_number(chunk.producer, chunk.chunk_id, fate)

    def _settle_number(self, producer: str, chunk_id: int, fate: str) -> None:
        """Settle one chunk: once its producer's mark passes it, its fate is counted and it
        leaves the buffer, in the same flush as the raised mark that acknowledges it."""
        with self._together():
            below, released = self.marks.settle(producer, chunk_id, fate)
            self._raised(producer, below, released)

    def _raised(self, producer: str, below: int | None, released: Sequence[str]) -> None:
        """Count the fates a raised mark released and flush the mark with them (``below``:
        the producer's new mark, None if it did not rise)."""
        self._count_fates(released)
        if below is not None:
            self.role.ledger_high(settled_field(producer), below)

    def _count_fates(self, fates: Sequence[str]) -> None:
        for fate in fates:
            self.role.count(fate)
        if fates:
            self.role.ledger_add(buffered_field(self.me), -len(fates))

    def _report(self, reason: str) -> None:
        """Log why chunks were dropped (at most every 10 s; they are counted as they settle)."""
        suppressed = self._drop_reports.due("chunks_dropped")
        if suppressed is not None:
            more = f" ({suppressed} more dropped since the last report)" if suppressed else ""
            self.role.log.warning("%s%s", loggable(reason), more)

    def refuse(self, chunk: TrajectoryChunk, problem: str) -> None:
        """A received chunk failed the checks: dropped, and counted as such, so the chunk
        accounting adds up. A chunk whose producer or number cannot go into the ledger, or
        whose tag is not its env worker's, is not in it (counted in
        ``bad_chunks_unattributed`` as produced); any other is settled, not
        resent, and counted for its producer (``refused_field``: produced by the producer's
        own record where an env worker made one, else by this count)."""
        attributed = self.attribution_problem(chunk) is None
        sender = "of" if attributed else "claiming"  # (the claim is not the sender's word)
        self._report(
            f"dropped chunk {chunk.chunk_id} {sender} env worker {chunk.worker_index}: {problem}"
        )
        with self._together():
            self.role.count("bad_chunks")
            self.role.count("samples_dropped", int(np.size(chunk.rewards)))
            if attributed:
                self._settle([chunk], "chunks_dropped")
                self.role.ledger_add(refused_field(chunk.producer), 1)
            else:
                self.role.count("chunks_dropped")
                self.role.count("bad_chunks_unattributed")

    def record(self, chunk: TrajectoryChunk) -> None:
        """Note a checked chunk's sequence number in the ledger (received from its producer).
        The numbers below its ``resend_from`` (below its own number without resend buffers)
        that did not arrive never will (``rlvla3/runtime/chunk_acks.py``): its producer's mark
        passes them."""
        with self._together():
            self.role.ledger_high(received_field(chunk.producer, self.me), chunk.chunk_id)
            never_again = chunk.resend_from if self.resent else chunk.chunk_id
            # the exit drain records chunks the checks never saw: never past the chunk itself
            never_again = min(never_again, chunk.chunk_id)
            if never_again > 0:
                below, released = self.marks.give_up_below(chunk.producer, never_again)
                self._raised(chunk.producer, below, released)

    def drop_received(self, chunk: TrajectoryChunk, reason: str) -> None:
        """A recorded chunk is not held (too stale): dropped, with its samples."""
        self._report(reason)
        with self._together():
            self.role.count("samples_dropped", len(chunk.rewards))
            self._settle([chunk], "chunks_dropped")

    def hold(self) -> None:
        """A recorded chunk goes to the learner (it stays in the buffer's count, which every
        chunk received joins, until it is settled)."""

    # --- settling held chunks ------------------------------------------------------------------
    def drop_held(self, chunks: Sequence[TrajectoryChunk], reason: str) -> None:
        """Drop chunks the trainer holds (buffered, or waiting for their group), counted."""
        self._report(reason)
        with self._together():
            self.role.count("samples_dropped", sum(len(c.rewards) for c in chunks))
            self._settle(chunks, "chunks_dropped")

    def trained(
        self, chunks: Sequence[TrajectoryChunk], samples: int, left_out: int, lags: np.ndarray
    ) -> None:
        """An update consumed ``chunks``: ``samples`` env steps trained, ``left_out`` left out
        as too stale, ``lags`` the trained steps' versions behind the trainer (the monitor's
        staleness distribution)."""
        with self._together():
            if left_out:
                self.role.count("samples_dropped", left_out)
            for lag, name in enumerate(_STALENESS_COUNTERS):
                n = int((lags == lag).sum()) if lag < 3 else int((lags >= 3).sum())
                if n:
                    self.role.count(name, n)
            self.role.count("samples_consumed", samples)
            self._settle(chunks, "chunks_consumed")

    # --- at exit -------------------------------------------------------------------------------
    def hand_back(self) -> None:
        """A trainer that failed (a successor takes over) leaves the chunks it holds unsettled,
        as a killed one does: its successor counts them returned (``write_off_dead_buffer``)
        and their producers resend them, with what was still queued here (that dies with this
        process). A chunk that a failed trainer handed back before is settled as in flight at
        exit instead: it may be what makes trainers fail, and handed back again it would fail
        each successor in turn until the launcher gives the run up."""
        held = self.marks.held()
        again = hand_back_chunks(self.role.registry, held)
        with self._together():
            for producer, chunk_id in held:
                if (producer, chunk_id) in again:
                    self._settle_number(producer, chunk_id, "chunks_in_flight_at_exit")
        self.role.log.warning(
            "failed holding %d chunks: %d go back to their producers, which resend them to "
            "the next trainer; %d were handed back by a failed trainer before, counted in "
            "flight at exit",
            len(held),
            len(held) - len(again),
            len(again),
        )

    def drain(self, queue: MessageSocket, held: int) -> None:
        """Take the chunks still queued at exit and count them with the ``held`` ones as in
        flight, so produced = consumed + dropped + these (+ lost); they are settled, so no
        producer resends them (a failed trainer without resend buffers, or one that failed
        stopping, drains too: ``hand_back`` is for a failure a successor takes over). Bounded
        in time: a trainer that stops alone has env workers still pushing, and what it leaves
        queued its successor writes off."""
        deadline = time.monotonic() + _DRAIN_S
        while time.monotonic() < deadline and (chunk := queue.recv(timeout_s=0.5)) is not None:
            if not isinstance(chunk, TrajectoryChunk):
                continue
            problem = self.attribution_problem(chunk)
            with self._together():
                if problem is None and self._duplicate(chunk):
                    continue
                # received now, so a restarted trainer does not write them off a second time
                self.role.count("chunks_received")
                if problem is None:
                    self.record(chunk)
            if problem is not None:
                self.refuse(chunk, problem)  # produced and dropped by its own count
        still_held = self.marks.held()
        if len(still_held) < held:
            self.role.log.warning("the learner holds %d chunks the marks miss", held)
        with self._together():
            for producer, chunk_id in still_held:
                self._settle_number(producer, chunk_id, "chunks_in_flight_at_exit")
            self._count_fates(self.marks.release_all())
