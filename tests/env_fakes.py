"""Stand-ins for what env runner parts report to (tests of ``roles/env/``)."""

from __future__ import annotations

import contextlib


class RecordingCounters:
    """A role's counting side (``roles.env.role_counters.RoleCounters``) that keeps the counts
    in ``counters`` and logs nothing."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}

    def count(self, name: str, amount: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount

    def drop(self, counter: str, reason: str) -> None:
        self.count(counter)

    def count_bad_frame(self, err: Exception) -> None:
        self.count("bad_frames")

    def ledger_high(self, field: str, value: int) -> None:
        pass

    def counting_together(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()
