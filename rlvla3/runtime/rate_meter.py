"""Events per second over a sliding window: the rate gauges every role shows the monitor."""

from __future__ import annotations

import collections
import threading
import time


class RateMeter:
    """Events per second over a sliding window (for monitor gauges); O(1) amortised per call."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._created = time.monotonic()
        self._events: collections.deque[tuple[float, float]] = collections.deque()
        self._total = 0.0  # sum of the amounts in _events, kept as events come and go
        self._lock = threading.Lock()

    def add(self, amount: float = 1.0) -> None:
        """Record ``amount`` events now."""
        with self._lock:
            self._events.append((time.monotonic(), amount))
            self._total += amount

    def rate(self) -> float:
        """Events per second over the last window (or since creation, if shorter)."""
        now = time.monotonic()
        with self._lock:
            while self._events and now - self._events[0][0] > self.window_s:
                self._total -= self._events.popleft()[1]
            span = min(self.window_s, max(now - self._created, 1e-3))
            return self._total / span
