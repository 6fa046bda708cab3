"""An env group's pushed chunks, kept until a trainer settles them, to push again to a
restarted trainer (at-least-once delivery: ``rlvla3/runtime/chunk_acks.py``), and how the
worker's main loop keeps them up to date."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from rlvla3.runtime.chunk_acks import read_acks
from rlvla3.runtime.registry import Registry
from transport.messages import TrajectoryChunk


class ResendBuffer:
    """Chunks pushed and not settled yet, oldest first, at most ``limit`` of them.

    Thread-safe: the runner thread that owns the chunk socket adds and resends; the worker's
    main loop applies the settled marks it reads from Redis and asks for a resend when a
    trainer restarts.

    Args:
        limit: chunks kept at most (0: none, delivery is at most once); beyond it the oldest is
            let go unsettled (``add`` returns how many).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._chunks: collections.deque[TrajectoryChunk] = collections.deque()
        self._kept: collections.Counter[str] = collections.Counter()
        """Chunks kept per producer: the numbers right below its next one (a producer's
        chunks are numbered in push order and let go from the oldest)."""
        self._resend_due = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._chunks)

    def resend_from(self, producer: str, chunk_id: int) -> int:
        """The lowest of ``producer``'s numbers that can still go out again once its chunk
        ``chunk_id`` (its next) is pushed: the oldest it keeps, else ``chunk_id`` itself.
        Read before the chunks are trimmed at worst, so it errs low, never high."""
        if self.limit == 0:
            return chunk_id
        with self._lock:
            return chunk_id - self._kept[producer]

    def add(self, chunk: TrajectoryChunk) -> int:
        """Keep a chunk just pushed; returns how many older ones were let go to make room."""
        if self.limit == 0:
            return 0
        with self._lock:
            self._chunks.append(chunk)
            self._kept[chunk.producer] += 1
            overflow = max(0, len(self._chunks) - self.limit)
            for _ in range(overflow):
                self._kept[self._chunks.popleft().producer] -= 1
        return overflow

    def acknowledge(self, settled: dict[str, int]) -> None:
        """Let go of every chunk below its producer's settled mark (``settled``: per producer,
        the number below which all are settled)."""
        with self._lock:
            self._chunks = collections.deque(
                c for c in self._chunks if c.chunk_id >= settled.get(c.producer, 0)
            )
            self._kept = collections.Counter(c.producer for c in self._chunks)

    def request_resend(self) -> None:
        """A trainer restarted: what is kept now goes out again before the next new chunk."""
        with self._lock:
            self._resend_due = True

    def take_resend(self) -> list[TrajectoryChunk]:
        """The chunks to push again, oldest first, if a resend is due (else none); each stays
        kept until it is settled."""
        with self._lock:
            if not self._resend_due:
                return []
            self._resend_due = False
            return list(self._chunks)


class AckFollower:
    """An env worker's side of the acknowledgements: its main loop reads the settled marks of
    its producers and the trainer starts from Redis, trims every resend buffer, and has them
    push again what they keep when a trainer restarted.

    Args:
        registry: the run's registry.
        on_trainer_restart: called before the buffers resend (the worker re-reads the trainers'
            endpoints, so the resent chunks go to the new trainer).
    """

    def __init__(self, registry: Registry, on_trainer_restart: Callable[[], None]) -> None:
        self.registry = registry
        self.on_trainer_restart = on_trainer_restart
        self.buffers: list[ResendBuffer] = []
        self.producers: list[str] = []
        self.trainer_starts = read_acks(registry, []).trainer_starts

    def follow(self, buffer: ResendBuffer, producers: list[str]) -> None:
        """Keep ``buffer`` (holding the chunks of ``producers``) up to date."""
        self.buffers.append(buffer)
        self.producers.extend(producers)

    def poll(self) -> None:
        """Read the marks once; trim the buffers; resend after a trainer restart."""
        if not any(b.limit for b in self.buffers):
            return
        acks = read_acks(self.registry, self.producers)
        for buffer in self.buffers:
            buffer.acknowledge(acks.settled)
        if acks.trainer_starts > self.trainer_starts:
            self.trainer_starts = acks.trainer_starts
            self.on_trainer_restart()
            for buffer in self.buffers:
                buffer.request_resend()
