"""The run's stop rules (``run.stop``) read against live counters in Redis, and the episodes
that make up the end-of-run evaluation.

``stop_condition`` is what the head's launcher asks on every tick; ``meets_target`` and
``evaluation_episodes`` are the same rules as ``summary.json`` applies them at the end.
"""

from __future__ import annotations

from typing import Any

from rlvla3.config.run_config import Config
from rlvla3.launch.stop_reason import StopKind, StopReason
from rlvla3.runtime.registry import Registry

SOLVED = "solved: "
"""How the text of a reached target begins (what people read; the code reads the kind)."""

# Each evaluated rate is a fraction of episodes, so the float mean of rates that exactly meet a
# target can land a rounding error below it (three evaluations of 0.95 average 0.94999...).
_MEAN_ROUNDING = 1e-9


def mean_recent(registry: Registry, key: str, window: int) -> float | None:
    """Mean of ``key`` over the newest ``window`` episodes, None before there are that many."""
    recent = registry.series("episodes", last=window)
    if len(recent) < window or not recent:
        return None
    return sum(float(e.get(key, 0.0)) for e in recent) / len(recent)


def stop_condition(registry: Registry, cfg: Config, elapsed_s: float) -> StopReason | None:
    """The reason to end the run now, or None to go on."""
    stop = cfg.run.stop
    requested = registry.stop_reason()
    if requested:
        return StopReason(StopKind.STOP_REQUESTED, f"stop requested: {requested}")
    if stop.max_wall_s and elapsed_s >= stop.max_wall_s:
        return StopReason(
            StopKind.MAX_WALL_S, f"wall time {elapsed_s:.0f}s reached run.stop.max_wall_s"
        )
    if stop.max_env_steps:
        steps = registry.counters().get("env_steps", 0)
        if steps >= stop.max_env_steps:
            return StopReason(
                StopKind.MAX_ENV_STEPS, f"{steps} env steps reached run.stop.max_env_steps"
            )
    if stop.target_mean_return is not None:
        mean = mean_recent(registry, "return", stop.return_window)
        if mean is not None and mean >= stop.target_mean_return:
            return _solved(f"mean return {mean:.1f} over {stop.return_window} episodes")
    if stop.target_success_rate is not None:
        rate = mean_recent(registry, "success", stop.return_window)
        if rate is not None and rate >= stop.target_success_rate:
            return _solved(f"success rate {rate:.2f} over {stop.return_window} episodes")
    if stop.target_eval_success_rate is not None:
        return _eval_target_reached(registry, stop.target_eval_success_rate, stop.eval_window)
    return None


def _solved(what: str) -> StopReason:
    return StopReason(StopKind.TARGET_REACHED, f"{SOLVED}{what}")


def _eval_target_reached(registry: Registry, target: float, window: int) -> StopReason | None:
    """The stop reason once the mean success rate of the newest ``window`` evaluations reaches
    ``target``, else None."""
    last = registry.series("evaluations", last=window)
    rates = [e.get("success_rate") for e in last]
    if len(rates) < window or any(r is None for r in rates):
        return None
    rate = sum(rates) / window
    if rate < target - _MEAN_ROUNDING:
        return None
    newest = last[-1]
    if window == 1:
        return _solved(
            f"evaluated success rate {rate:.2f} of weights v{newest['version']} "
            f"on {newest['episodes']} held-out episodes"
        )
    return _solved(
        f"evaluated success rate {rate:.2f}, the mean of {window} evaluations up to "
        f"weights v{newest['version']}, each on {newest['episodes']} held-out episodes"
    )


def meets_target(stop: Any, mean_return: float | None, success_rate: float | None) -> bool:
    """Whether a mean return or success rate reaches ``run.stop``'s target (None: unmeasured)."""
    return (
        stop.target_mean_return is not None
        and mean_return is not None
        and mean_return >= stop.target_mean_return
    ) or (
        stop.target_success_rate is not None
        and success_rate is not None
        and success_rate >= stop.target_success_rate
    )


def evaluation_episodes(registry: Registry, version: int) -> list[dict[str, Any]]:
    """Episodes acted on entirely, and greedily, by weights of ``version`` or newer (fresh since
    evaluation). Episodes of ``version`` that the rollout servers played by sampling, before
    they saw the evaluation start, do not count: they measured the exploring policy."""
    return [
        e
        for e in registry.series("episodes", last=5000)
        if e.get("min_version", -1) >= version and e.get("greedy", False)
    ]
