"""One run's env steps/s and where one env's time goes per step, from its Redis counters.

The asynchrony benchmarks (``bench/async_vs_sync.py``, ``bench/async_vs_sync_sim.py``) measure
each mode this way: launch the run, sample its counters over a steady window (``run_sampler``),
and split an env's step into ``env_step`` (the simulator), ``action_wait`` (one request's round
trip to a rollout server) and ``other`` (chunk building, the lock-step barrier in sync mode,
waiting for the CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .run_sampler import sample_run

COUNTERS = ("env_steps", "samples_consumed", "env_step_us", "action_wait_us", "action_requests")
"""The run counters the figures come from."""


def mode_roles(num_workers: int, num_envs: int) -> dict[str, Any]:
    """The roles of a mode comparison: ``num_workers`` env workers, one rollout server that
    answers each batch at once (up to every env's request), one trainer and one broadcaster."""
    return {
        "env_worker": {"count": num_workers},
        "rollout_server": {"count": 1, "settings": {"max_batch": num_envs, "max_wait_ms": 0.0}},
        "trainer": {"count": 1},
        "weight_broadcaster": {"count": 1},
    }


def measure_rates(
    cfg: dict[str, Any],
    num_envs: int,
    workdir: Path,
    warmup_s: float,
    duration_s: float,
    started_by: str = "env_steps",
) -> dict[str, Any]:
    """Launch ``cfg`` (``num_envs`` envs in all), wait for steady state (``sample_run``'s
    ``started_by``), measure over ``duration_s``, stop it: env and trained steps/s, and
    per-step milliseconds."""
    got = sample_run(cfg, workdir, COUNTERS, warmup_s, duration_s, started_by=started_by)
    d = {k: got.delta(k) for k in COUNTERS}
    rate = {k: got.rate(k) for k in COUNTERS}
    steps = max(d["env_steps"], 1)
    per_step_ms = num_envs / max(rate["env_steps"], 1e-9) * 1000
    env_step_ms = d["env_step_us"] / steps / 1000
    action_wait_ms = d["action_wait_us"] / max(d["action_requests"], 1) / 1000
    return {
        "env_steps_per_s": rate["env_steps"],
        "trained_samples_per_s": rate["samples_consumed"],
        "per_step_ms": {
            "env_step": env_step_ms,
            "action_wait": action_wait_ms,
            "other": per_step_ms - env_step_ms - action_wait_ms * d["action_requests"] / steps,
        },
    }
