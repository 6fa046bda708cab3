"""At-least-once chunk delivery: which chunks a trainer has settled, and how env workers learn it.

An env worker keeps every chunk it pushed in a resend buffer (``roles/env/resend_buffer.py``)
until a trainer has *settled* it: trained on it, or dropped it (too stale, refused, or in flight
when the trainer stopped). Settling is what acknowledges a chunk, not receiving it, so the
chunks in a killed trainer's buffer are delivered again to its successor.

The acknowledgement is a mark per producer in the chunk ledger (``settled_field``): every chunk
numbered below it is settled. A trainer raises it in sequence order (a chunk settled ahead of
earlier ones still held waits for them) and flushes it in the same Redis transaction as the
counters that settle those chunks, so a trainer killed at any moment leaves marks and counts
that agree. Each trainer start adds one to ``TRAINER_STARTS``; an env worker that sees it grow
pushes every chunk it still keeps again, oldest first. The successor reads the marks and drops
what it receives below them, and anything it received twice itself, as duplicates.

Why the ledger and not a socket: the marks must survive the trainer (its successor reads them
to drop duplicates), and env workers already read Redis every 0.2 s for back-pressure; one
pipelined read of their producers' marks costs less than a socket per worker, its CURVE keys
and its size limits.

The marks assume that one trainer receives each producer's chunks (the run's one trainer).

A chunk that its producer can no longer push again, and that did not arrive, never will: each
chunk says the lowest number its producer could still push again (``resend_from``: the oldest
chunk its resend buffer keeps, or the chunk's own number when it keeps none: without resend
buffers, ``resend_buffer_chunks`` 0, or after the buffer let the older ones go). A producer's
chunks reach a trainer in the order they were pushed (one ZeroMQ pipe, first in first out), so
when a trainer records a chunk, the numbers below its ``resend_from`` that the trainer neither
holds nor settled died elsewhere (in a killed predecessor's buffer or queue, counted as lost
there) and the mark passes them (``give_up_below``): otherwise it would wait for them for the
rest of the run, every later chunk's fate uncounted until exit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from rlvla3.runtime import keys
from rlvla3.runtime.chunk_ledger import TRAINER_STARTS, settled_field, settled_marks
from rlvla3.runtime.registry import Registry

FateT = TypeVar("FateT")


@dataclass(slots=True)
class _ProducerMarks(Generic[FateT]):
    """One producer's chunks in a trainer: the settled mark and what lies above it."""

    below: int = 0
    """Every chunk numbered below this is settled."""
    held: set[int] = field(default_factory=set)
    """Received, not settled yet."""
    settled_above: dict[int, FateT] = field(default_factory=dict)
    """Settled above ``below`` (earlier chunks are still held or on their way), with what
    became of each: counted only once the mark passes it, so that a trainer killed before then
    has counted nothing its successor counts again."""
    given_up_below: int = 0
    """Numbers below this that are neither held nor settled will never arrive: the mark
    passes them."""

    def advance(self) -> list[FateT]:
        """Raise ``below`` past every settled or given-up number; the fates it passes."""
        released = []
        while True:
            if self.below in self.settled_above:
                released.append(self.settled_above.pop(self.below))
                self.below += 1
            elif self.below < self.given_up_below and self.below not in self.held:
                # jump the gap in one step (it may span thousands of numbers)
                waiting = [n for n in (*self.held, *self.settled_above) if n > self.below]
                self.below = min([self.given_up_below, *waiting])
            else:
                return released


class SettledMarks(Generic[FateT]):
    """A trainer's view of what is settled, per producer; starts from the ledger's marks, so a
    successor recognises what its predecessor settled. A chunk's fate (trained, dropped...)
    is released, to be counted, when the producer's mark passes the chunk."""

    def __init__(self, marks: dict[str, int] | None = None) -> None:
        self._producers: dict[str, _ProducerMarks[FateT]] = {
            producer: _ProducerMarks(below) for producer, below in (marks or {}).items()
        }

    @classmethod
    def from_ledger(cls, ledger: dict[str, int]) -> SettledMarks[FateT]:
        """The marks the chunk ledger holds (``Registry.chunk_ledger``)."""
        return cls(settled_marks(ledger))

    def _of(self, producer: str) -> _ProducerMarks[FateT]:
        marks = self._producers.get(producer)
        if marks is None:
            marks = self._producers[producer] = _ProducerMarks()
        return marks

    def is_duplicate(self, producer: str, chunk_id: int) -> bool:
        """Whether this chunk was received before: settled, or held now."""
        marks = self._producers.get(producer)
        if marks is None:
            return False
        return chunk_id < marks.below or chunk_id in marks.held or chunk_id in marks.settled_above

    def receive(self, producer: str, chunk_id: int) -> None:
        """A chunk arrived (not a duplicate): held until settled."""
        self._of(producer).held.add(chunk_id)

    def settle(self, producer: str, chunk_id: int, fate: FateT) -> tuple[int | None, list[FateT]]:
        """A chunk is settled with ``fate``; returns the producer's new mark if it rose (None:
        it did not) and the fates released by it, in sequence order."""
        marks = self._of(producer)
        marks.held.discard(chunk_id)
        if chunk_id < marks.below:
            return None, [fate]
        marks.settled_above[chunk_id] = fate
        start = marks.below
        released = marks.advance()
        return (marks.below if marks.below > start else None), released

    def give_up_below(self, producer: str, chunk_id: int) -> tuple[int | None, list[FateT]]:
        """Chunks of ``producer`` numbered below ``chunk_id`` that are neither held nor settled
        will never arrive (its producer cannot push them again: see the module doc). Returns,
        as ``settle`` does, the producer's new mark if it rose and the fates of the settled
        chunks it passed (what it passes without a fate was counted where it died)."""
        marks = self._of(producer)
        marks.given_up_below = max(marks.given_up_below, chunk_id)
        start = marks.below
        released = marks.advance()
        return (marks.below if marks.below > start else None), released

    def release_all(self) -> list[FateT]:
        """Every fate still waiting for an earlier chunk (the trainer stops: count them all)."""
        fates = [f for marks in self._producers.values() for f in marks.settled_above.values()]
        for marks in self._producers.values():
            marks.settled_above.clear()
        return fates

    def held(self) -> list[tuple[str, int]]:
        """Every (producer, chunk number) received and not settled yet."""
        return [(p, c) for p, marks in self._producers.items() for c in sorted(marks.held)]


@dataclass(frozen=True, slots=True)
class Acks:
    """What an env worker reads: trainer starts so far, and its producers' settled marks."""

    trainer_starts: int
    """Trainer process starts in the run (it grows: resend what is not settled)."""
    settled: dict[str, int]
    """Per producer, the number below which every chunk is settled (absent: none yet)."""


def read_acks(registry: Registry, producers: Iterable[str]) -> Acks:
    """The trainer starts and ``producers``' settled marks, in one round trip."""
    ledger = keys.chunk_ledger(registry.run_id)
    names = list(producers)
    pipe = registry.redis.pipeline(transaction=False)
    pipe.hget(ledger, TRAINER_STARTS)
    for producer in names:
        pipe.hget(ledger, settled_field(producer))
    starts, *marks = pipe.execute()
    settled = {p: int(m) for p, m in zip(names, marks, strict=True) if m is not None}
    return Acks(int(starts or 0), settled)


def count_trainer_start(registry: Registry) -> None:
    """Say that a trainer started and can take chunks (its endpoint is published)."""
    registry.redis.hincrby(keys.chunk_ledger(registry.run_id), TRAINER_STARTS, 1)


def hand_back_chunks(registry: Registry, chunks: Sequence[tuple[str, int]]) -> set[tuple[str, int]]:
    """Record ``chunks`` (producer, number) as handed back by a failed trainer, in one round
    trip; returns those a failed trainer had handed back before (``keys.handed_back_chunks``)."""
    if not chunks:
        return set()
    key = keys.handed_back_chunks(registry.run_id)
    pipe = registry.redis.pipeline(transaction=True)
    for producer, chunk_id in chunks:
        pipe.sadd(key, f"{producer} {chunk_id}")
    added = pipe.execute()
    return {chunk for chunk, new in zip(chunks, added, strict=True) if not new}
