"""The evaluation rounds an eval env worker plays: the held-out episodes of the current round,
handed out to its runners, and their results."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EvalEpisode:
    """One held-out episode to play: its round, the weights it must be acted on by, its index."""

    round: int
    """The evaluation round it belongs to."""
    version: int
    """The weight version the round evaluates: every action must come from it."""
    index: int
    """Its place in the round; its reset seed is ``run.eval.seed`` plus it."""


@dataclass(frozen=True, slots=True)
class RoundResult:
    """A finished round: every episode's result, and what it evaluated."""

    round: int
    version: int
    results: list[dict[str, Any]]
    """Per episode: ``return``, ``length`` and, where the env reports it, ``success``."""


class EvalRounds:
    """The current round's episodes still to play and the results in so far; the worker's main
    loop starts rounds and collects them, its runner threads take and finish episodes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.round = 0
        """The round being evaluated (0: none yet)."""
        self.version = -1
        """The weight version it evaluates."""
        self._open = False  # the current round's result is still to be recorded
        self._todo: deque[EvalEpisode] = deque()
        self._results: dict[int, dict[str, Any]] = {}

    def start(self, round_: int, version: int, episodes: int) -> bool:
        """Make round ``round_`` of ``episodes`` episodes (0: already recorded elsewhere) the
        current one; whether this voided an unfinished one."""
        with self._lock:
            voided = self._open
            self.round, self.version = round_, version
            self._results = {}
            self._open = episodes > 0
            self._todo = deque(EvalEpisode(round_, version, k) for k in range(episodes))
        return voided

    def take(self) -> EvalEpisode | None:
        """The next episode of the current round to play, or None when there is none now."""
        with self._lock:
            return self._todo.popleft() if self._todo else None

    def still_current(self, episode: EvalEpisode) -> bool:
        """Whether ``episode``'s round is still the one being evaluated."""
        return episode.round == self.round

    def finish(self, episode: EvalEpisode, result: dict[str, Any]) -> None:
        """Keep one finished episode's result (dropped if its round is over)."""
        with self._lock:
            if episode.round == self.round:
                self._results[episode.index] = result

    def collect(self, wanted: int) -> RoundResult | None:
        """The current round's result once ``wanted`` episodes are in (once per round)."""
        with self._lock:
            if not self._open or len(self._results) < wanted:
                return None
            done = RoundResult(self.round, self.version, list(self._results.values()))
            self._results, self._open = {}, False
        return done
