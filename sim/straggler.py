"""Straggler simulation: a wrapper that makes every ``step`` of a simulator slow, heavy-tailed.

Used by the benchmark to show what the asynchronous modes buy: in lock-step (``sync``) mode every
vector step waits for the slowest env; in async modes a slow env costs only its own time.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from sim.adapter import Obs, SimAdapter, StepResult

DISTRIBUTIONS = ("lognormal", "constant", "none")


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerConfig:
    """Extra latency added to every simulator step.

    Attributes:
        distribution: ``"lognormal"`` (heavy tail), ``"constant"`` (always ``mean_ms``) or
            ``"none"`` (no delay).
        mean_ms: mean delay per step in milliseconds (the lognormal is parameterised by its
            MEAN: ``mu = ln(mean_ms) - sigma**2 / 2``).
        sigma: lognormal shape (std of the underlying normal); larger means heavier tail.
        seed: seed of the delay stream; None lets :func:`sim.envs.make_env` use the env seed.
    """

    distribution: str = "lognormal"
    mean_ms: float = 20.0
    sigma: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"distribution must be one of {DISTRIBUTIONS}, got {self.distribution!r}"
            )
        if not self.mean_ms >= 0.0:
            raise ValueError(f"mean_ms must be >= 0, got {self.mean_ms}")
        if not self.sigma >= 0.0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")

    @property
    def expected_delay_s(self) -> float:
        """Mean added delay per step, seconds."""
        if self.distribution == "none":
            return 0.0
        return self.mean_ms / 1000.0


_PR_SET_TIMERSLACK = 29  # prctl option (linux/prctl.h)


def tighten_timer_slack() -> bool:
    """Make the calling thread's timed sleeps end on time (Linux timer slack of 1 ns).

    By default Linux may fire a sleeping thread's timer up to 50 µs late, to batch wake-ups;
    on a 10 ms simulated step that alone adds 0.5% to every step, so the simulated simulator
    would be slower than configured. Returns False where this is not possible (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def lognormal_mu(mean: float, sigma: float) -> float:
    """``mu`` of a lognormal whose mean is ``mean``: ``ln(mean) - sigma**2 / 2``."""
    return math.log(mean) - 0.5 * sigma * sigma


class StragglerAdapter(SimAdapter):
    """Wraps a :class:`SimAdapter` and blocks the calling thread for a random delay each step.

    The delay is sampled per step from ``cfg`` and slept with ``sleep`` (``time.sleep`` by
    default: this simulates a slow simulator, it is not synchronisation). With ``time.sleep``,
    the stepping thread's timer slack is tightened first (``tighten_timer_slack``) so the
    delays last what they were sampled as. Tests inject a fake ``sleep`` to record delays
    without spending the time. ``info["straggler_delay_s"]`` reports the delay of each step.

    Args:
        inner: the simulator to slow down.
        cfg: the delay distribution.
        default_seed: used when ``cfg.seed`` is None.
        sleep: ``sleep(seconds)``; blocks the caller.
    """

    def __init__(
        self,
        inner: SimAdapter,
        cfg: StragglerConfig,
        *,
        default_seed: int | None = None,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> None:
        self.inner = inner
        self.cfg = cfg
        seed = cfg.seed if cfg.seed is not None else default_seed
        self._rng = np.random.default_rng(seed)
        self._sleep = sleep
        self._precise_thread: int | None = None  # the thread whose timer slack was tightened
        self._mu = (
            lognormal_mu(cfg.mean_ms, cfg.sigma)
            if cfg.distribution == "lognormal" and cfg.mean_ms > 0
            else 0.0
        )

    @property
    def observation_space(self) -> spaces.Dict:  # type: ignore[override]
        return self.inner.observation_space

    @property
    def action_space(self) -> spaces.Space:  # type: ignore[override]
        return self.inner.action_space

    @property
    def instruction(self) -> str | None:
        return self.inner.instruction

    @property
    def max_episode_steps(self) -> int | None:
        return self.inner.max_episode_steps

    def sample_delay_s(self) -> float:
        """Draw one step delay in seconds (advances the delay stream)."""
        cfg = self.cfg
        if cfg.distribution == "none" or cfg.mean_ms <= 0.0:
            return 0.0
        if cfg.distribution == "constant":
            return cfg.mean_ms / 1000.0
        return float(self._rng.lognormal(self._mu, cfg.sigma)) / 1000.0

    def reset(self, seed: int | None = None) -> tuple[Obs, dict[str, Any]]:
        return self.inner.reset(seed=seed)

    def step(self, action: Any) -> StepResult:
        obs, reward, terminated, truncated, info = self.inner.step(action)
        delay_s = self.sample_delay_s()
        if delay_s > 0.0:
            if self._sleep is time.sleep and self._precise_thread != threading.get_ident():
                tighten_timer_slack()
                self._precise_thread = threading.get_ident()
            self._sleep(delay_s)
        info["straggler_delay_s"] = delay_s
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # Task-specific extras (e.g. ``privileged_state``) pass through to the inner env.
        if name in ("inner", "cfg"):
            raise AttributeError(name)
        return getattr(self.inner, name)
