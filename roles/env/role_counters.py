"""What the runner parts report to their role: counters, dropped messages, chunk ledger marks."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from transport.codec import CodecError


class RoleCounters(Protocol):
    """The counting side of a role (``rlvla3.runtime.role.Role`` has it): the runner parts count
    through it from their threads; the role flushes to Redis."""

    def count(self, name: str, amount: int = 1) -> None:
        """Add to a run-wide counter (``rlvla3/runtime/metric_names.py``)."""
        ...

    def drop(self, counter: str, reason: str) -> None:
        """Count something dropped in ``counter`` and log why (rate-limited)."""
        ...

    def count_bad_frame(self, err: CodecError) -> None:
        """Count and log a message that failed to decode."""
        ...

    def ledger_high(self, field: str, value: int) -> None:
        """Raise a chunk ledger high-water mark (``rlvla3/runtime/chunk_ledger.py``)."""
        ...

    def counting_together(self) -> AbstractContextManager[None]:
        """A block whose counts and ledger marks land in one flush (never flush inside)."""
        ...
