"""Time inside one runner's simulators: what the stall check and the env step metrics see."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rlvla3.runtime.rate_meter import RateMeter
from roles.env.role_counters import RoleCounters

A = TypeVar("A")
T = TypeVar("T")


class SimMeter:
    """When a runner's envs entered a simulator call (the worker reports an env stuck there as
    stalled work), how long group steps take (``env_step_us``) and how many transitions they
    make (``env_steps``, the worker's step rate)."""

    def __init__(self, counters: RoleCounters, step_rate: RateMeter) -> None:
        self.counters = counters
        self.step_rate = step_rate
        """The worker's steps-per-second meter, shared by its runners."""
        self.since = 0.0
        """Wall time its envs entered their simulators' step or reset; 0: not inside one."""

    @contextmanager
    def inside(self) -> Iterator[None]:
        """Around one simulator call (step or reset): a call that never returns shows as the
        worker's stuck work."""
        self.since = time.time()
        try:
            yield
        finally:
            self.since = 0.0

    def step(self, step: Callable[[A], T], actions: A) -> T:
        """Run one group step (``step(actions)``) inside the simulators and count its time."""
        started = time.perf_counter()
        with self.inside():
            stepped = step(actions)
        self.counters.count("env_step_us", round((time.perf_counter() - started) * 1e6))
        return stepped

    def transitions(self, steps: int) -> None:
        """Count ``steps`` transitions made by one group step."""
        self.counters.count("env_steps", steps)
        self.step_rate.add(steps)
