"""Finished episodes on their way from the runner threads to the run's learning curve."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlvla3.runtime.registry import Registry
from roles.env.role_counters import RoleCounters


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishedEpisode:
    """One episode an env finished."""

    episode_return: float
    """Sum of its rewards."""
    length: int
    """Its transitions."""
    success: bool | None
    """The env's ``info["success"]`` at its end (None: the env does not report one)."""
    versions: tuple[int, int]
    """Oldest and newest weight version that chose its actions."""
    greedy: bool
    """Every one of its actions was the policy's mode. The end-of-run evaluation counts only
    episodes acted on entirely, and greedily, by the evaluated version."""


class EpisodeQueue:
    """Episodes the runners finished, waiting for the worker's main loop to append them to the
    run's ``episodes`` series in one call: a runner thread never waits on Redis between steps."""

    def __init__(self, worker_index: int, counters: RoleCounters) -> None:
        self.worker_index = worker_index
        self.counters = counters
        self._lock = threading.Lock()
        self._points: list[dict[str, Any]] = []
        self.on_record: Callable[[], None] | None = None
        """Called (in the runner thread) after each recorded episode."""

    def __len__(self) -> int:
        return len(self._points)

    def record(self, episode: FinishedEpisode) -> None:
        """Count a finished episode and queue it (called from runner threads)."""
        point: dict[str, Any] = {
            "return": episode.episode_return,
            "length": episode.length,
            "worker": self.worker_index,
            "t": time.time(),
            "min_version": episode.versions[0],
            "max_version": episode.versions[1],
            "greedy": episode.greedy,
        }
        if episode.success is not None:
            point["success"] = episode.success
        with self._lock:
            self._points.append(point)
        self.counters.count("episodes")
        if self.on_record is not None:
            self.on_record()

    def write(self, registry: Registry) -> None:
        """Append the queued episodes to the run's ``episodes`` series, stamped with the
        run-wide env step count (read once per write; it lags by a counter flush anyway); on a
        failure they go back in the queue, oldest first, for the next write."""
        with self._lock:
            points, self._points = self._points, []
        if not points:
            return
        try:
            env_steps = registry.counters().get("env_steps", 0)
            for point in points:
                point["env_steps"] = env_steps
            registry.append("episodes", points)
        except Exception:
            with self._lock:
                self._points[:0] = points
            raise
