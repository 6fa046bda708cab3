"""When an env worker's runners may go on: sync mode's lock-step and weight rounds, and the
async modes' back-pressure."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

R = TypeVar("R")


class Pacing:
    """The pauses one env worker imposes on its runners. In ``sync`` mode its groups step in
    lock-step (a barrier after every step) and after ``chunk_len`` steps wait for the next
    weight version (one round per version); in the async modes back-pressure pauses them while
    too many chunks wait for the trainers. The worker's main loop feeds it (``see_version``,
    ``pause``, ``resume``); the runner threads wait on it."""

    def __init__(self, stop_event: threading.Event, groups: int, lock_step: bool, version: int):
        self.stop_event = stop_event
        self.barrier = threading.Barrier(groups) if lock_step else None
        """Sync mode: met by every group of the worker after each step (None: async)."""
        self.latest_version = version
        """Newest weight version the worker has seen published (sync mode keeps it current)."""
        self._version_seen = threading.Condition()
        self._may_produce = threading.Event()  # cleared while too many chunks are in flight
        self._may_produce.set()

    @property
    def lock_step(self) -> bool:
        return self.barrier is not None

    def after_step(self) -> None:
        """Sync mode: wait until every group of the worker finished this step."""
        if self.barrier is not None:
            self.barrier.wait()

    def round_over(self, round_steps: int, chunk_len: int) -> bool:
        """Sync mode: a round of ``round_steps`` steps is complete."""
        return self.barrier is not None and round_steps >= chunk_len

    def abort(self) -> None:
        """Release every runner waiting at the barrier (they stop: ``BrokenBarrierError``)."""
        if self.barrier is not None:
            self.barrier.abort()

    def see_version(self, version: int) -> None:
        """The main loop read ``version`` as published; wake the runners waiting for it."""
        if version > self.latest_version:
            with self._version_seen:
                self.latest_version = version
                self._version_seen.notify_all()

    def pause(self) -> bool:
        """Back-pressure: hold the runners at their next ``wait_for_credit``; whether this
        started a pause (they were producing)."""
        if not self._may_produce.is_set():
            return False
        self._may_produce.clear()
        return True

    def resume(self) -> None:
        self._may_produce.set()

    @property
    def paused(self) -> bool:
        """The runners are held (``pause``) until ``resume``."""
        return not self._may_produce.is_set()

    def wait_for_credit(self) -> bool:
        """Block while back-pressure pauses the runners; return whether it did."""
        if self._may_produce.is_set():
            return False
        while not self._may_produce.wait(0.1):
            if self.stop_event.is_set():
                raise InterruptedError
        return True

    def wait_for_version_after(self, version: int) -> bool:
        """Sync mode: block until a weight version newer than ``version`` is published; False
        if stopped first."""
        with self._version_seen:
            while self.latest_version <= version:
                if self.stop_event.is_set():
                    return False
                self._version_seen.wait(0.1)
        return True

    def hold(
        self, reply: R, round_over: bool, ask: Callable[[], R], version_of: Callable[[R], int]
    ) -> R | None:
        """Between two group steps: wait out a back-pressure pause and, when a sync round is
        over, the next weight version. Returns the actions to take then (``ask``ed again: those
        in hand, ``reply``, came from weights that have aged since), or None if it did not wait."""
        fresh = ask() if self.wait_for_credit() else None
        if round_over:
            current = reply if fresh is None else fresh
            fresh = self._next_round(version_of(current), ask, version_of)
        return fresh

    def _next_round(self, version: int, ask: Callable[[], R], version_of: Callable[[R], int]) -> R:
        """Sync mode: wait for a weight version newer than ``version``, then ask with it."""
        if not self.wait_for_version_after(version):
            raise InterruptedError
        reply = ask()
        while version_of(reply) < self.latest_version:  # the server swaps in between batches
            if self.stop_event.wait(0.002):
                raise InterruptedError
            reply = ask()
        return reply


class EpisodeBudget:
    """Live evaluation's pacing in a run without an RL trainer (an SFT run): ``per_version``
    episodes on each new weight version, then the runners pause until the next version; the
    end-of-run evaluation plays unpaused. Runner threads count episodes as they end, so the
    pause comes at the next step, not at the main loop's next pass.

    Nothing published yet (version -1) is the first published version's budget (0, or a
    resumed trainer's version): rollout servers serve nothing before the first weights, so
    every episode played before the worker reads a version was played on that one, and a
    budget of its own would give it a second one."""

    def __init__(self, pacing: Pacing, per_version: int, version: int) -> None:
        self.pacing = pacing
        self.per_version = per_version
        self._lock = threading.Lock()
        self._version = version
        self._left = per_version
        self._evaluating = False

    def episode_ended(self) -> None:
        """A runner thread finished an episode."""
        with self._lock:
            self._left -= 1
            if self._left <= 0 and not self._evaluating:
                self.pacing.pause()

    def see(self, version: int, evaluating: bool) -> None:
        """The main loop read the published ``version`` and whether the end-of-run evaluation
        has begun."""
        with self._lock:
            self._evaluating = evaluating
            if self._version < 0:  # the first published version: what was played was on it
                self._version = version
            elif version != self._version:
                self._version, self._left = version, self.per_version
            if evaluating or self._left > 0:
                self.pacing.resume()
