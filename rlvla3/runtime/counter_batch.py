"""A role's counting: counter increments and chunk-ledger changes gathered between flushes,
and how often a dropped message is worth a log line.

Roles count events by the thousand per second (env steps, requests served); Redis sees them as
one transaction every half second (``Role``'s heartbeat thread flushes), so the counters and
the chunk ledger (``rlvla3/runtime/chunk_ledger.py``) always move together.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rlvla3.runtime.registry import Registry


@dataclass(frozen=True, slots=True)
class _Flush:
    """One numbered flush: what it adds and sets."""

    number: int
    counts: dict[str, int]
    highs: dict[str, int]
    ledger: dict[str, int]


class CounterBatch:
    """What a role counted since the last flush. Thread-safe: env threads count concurrently.

    Args:
        flusher: this process's name for its flushes in Redis (unique per process start):
            a flush that failed is sent again under its number, and Redis applies each
            number once (``rlvla3/runtime/flush_once.py``).
    """

    def __init__(self, flusher: str) -> None:
        self.flusher = flusher
        # reentrant: ``together`` holds it while the counting calls inside take it again
        self._lock = threading.RLock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._highs: dict[str, int] = {}  # chunk ledger high-water marks
        self._ledger: collections.Counter[str] = collections.Counter()
        self._next_number = 0
        self._unsent: _Flush | None = None  # a failed flush: it may or may not have landed
        self._flushing = threading.Lock()  # one flush at a time, in number order

    def add(self, counter: str, amount: int) -> None:
        """Add ``amount`` to run-wide counter ``counter``."""
        with self._lock:
            self._counts[counter] += amount

    def raise_high(self, field: str, value: int) -> None:
        """Raise chunk ledger high-water mark ``field`` to ``value`` (never lower it)."""
        with self._lock:
            if value > self._highs.get(field, -1):
                self._highs[field] = value

    def add_to_ledger(self, field: str, amount: int) -> None:
        """Add ``amount`` to chunk ledger field ``field``."""
        with self._lock:
            self._ledger[field] += amount

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Counts and ledger changes made inside go into the same flush (a flush in another
        thread waits for the block to end): a chunk's fate and the settled mark that releases
        it, say, must not land in two flushes with a kill between them. Never flush inside
        (the flush would wait for its own thread's block in the other lock order)."""
        with self._lock:
            yield

    def flush(self, registry: Registry, log: logging.Logger) -> None:
        """Send everything gathered, in one atomic step. A flush that failed is sent again,
        under its number, before anything newer: Redis skips it if the first try had landed
        (its reply lost), so nothing is counted twice or lost."""
        with self._flushing:
            if self._unsent is not None and not self._send(self._unsent, registry, log):
                return  # still down: what is gathered meanwhile waits for its turn
            self._unsent = None
            with self._lock:
                counts, self._counts = self._counts, collections.Counter()
                highs, self._highs = self._highs, {}
                ledger, self._ledger = self._ledger, collections.Counter()
            if not (counts or highs or ledger):
                return
            flush = _Flush(self._next_number, dict(counts), highs, dict(ledger))
            self._next_number += 1
            if not self._send(flush, registry, log):
                self._unsent = flush

    def _send(self, flush: _Flush, registry: Registry, log: logging.Logger) -> bool:
        try:
            registry.flush(
                flush.counts,
                flush.highs,
                flush.ledger,
                flusher=self.flusher,
                number=flush.number,
            )
        except Exception as err:
            log.warning("counter flush failed, will retry: %s", err)
            return False
        return True


class DropReports:
    """When a dropped message is logged: at most once per ``every_s`` per counter, with how many
    were dropped since, so that a flood of bad input cannot flood the log. Thread-safe: env
    threads drop concurrently."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock  # tests pass a fake one
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # counter -> (last logged, suppressed)

    def due(self, counter: str) -> int | None:
        """None: stay quiet about this drop of ``counter``; else log it, saying how many were
        dropped unreported since the last report."""
        now = self._clock()
        with self._lock:
            last, suppressed = self._last.get(counter, (-self.every_s, 0))
            report = now - last >= self.every_s
            self._last[counter] = (now, 0) if report else (last, suppressed + 1)
        return suppressed if report else None
