"""What the launcher reads from Redis while a run goes and writes when it ends.

- ``stop_condition``: the run's stop rules (``run.stop``) checked against live counters.
- ``progress_line``: one line of progress for the terminal.
- ``write_report``: ``summary.json`` and ``learning_curve.png`` in the run dir.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rlvla3.config import Config
from rlvla3.registry import Registry


def mean_recent(registry: Registry, key: str, window: int) -> float | None:
    """Mean of ``key`` over the newest ``window`` episodes, None before there are that many."""
    recent = registry.series("episodes", last=window)
    if len(recent) < window or not recent:
        return None
    return sum(float(e.get(key, 0.0)) for e in recent) / len(recent)


def stop_condition(registry: Registry, cfg: Config, elapsed_s: float) -> str | None:
    """The reason to end the run now, or None to go on."""
    stop = cfg.run.stop
    requested = registry.stop_reason()
    if requested:
        return f"stop requested: {requested}"
    if stop.max_wall_s and elapsed_s >= stop.max_wall_s:
        return f"wall time {elapsed_s:.0f}s reached run.stop.max_wall_s"
    if stop.max_env_steps:
        steps = registry.counters().get("env_steps", 0)
        if steps >= stop.max_env_steps:
            return f"{steps} env steps reached run.stop.max_env_steps"
    if stop.target_mean_return is not None:
        mean = mean_recent(registry, "return", stop.return_window)
        if mean is not None and mean >= stop.target_mean_return:
            return f"solved: mean return {mean:.1f} over {stop.return_window} episodes"
    if stop.target_success_rate is not None:
        rate = mean_recent(registry, "success", stop.return_window)
        if rate is not None and rate >= stop.target_success_rate:
            return f"solved: success rate {rate:.2f} over {stop.return_window} episodes"
    return None


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
    """Episodes acted on entirely by weights of ``version`` or newer (fresh since evaluation)."""
    return [
        e for e in registry.series("episodes", last=5000) if e.get("min_version", -1) >= version
    ]


def evaluation_summary(registry: Registry) -> dict[str, Any] | None:
    """Success rate and mean return of the end-of-run evaluation, if one ran."""
    version = registry.evaluation_version()
    if version is None:
        return None
    episodes = evaluation_episodes(registry, version)
    result: dict[str, Any] = {"version": version, "episodes": len(episodes)}
    if episodes:
        result["mean_return"] = sum(e["return"] for e in episodes) / len(episodes)
        if "success" in episodes[0]:
            result["success_rate"] = sum(bool(e.get("success")) for e in episodes) / len(episodes)
    return result


def progress_line(registry: Registry, cfg: Config, elapsed_s: float, restarts: int) -> str:
    """E.g. ``[  30s] env_steps=41200 (1373/s) episodes=310 mean_return=212.5 version=57 ...``."""
    counters = registry.counters()
    steps = counters.get("env_steps", 0)
    mean = mean_recent(registry, "return", min(cfg.run.stop.return_window, 20))
    roles = registry.roles()
    alive = sum(r.alive for r in roles)
    expected = max(len(roles), sum(rc.count for rc in cfg.roles.values()))  # not yet registered too
    parts = [
        f"[{elapsed_s:5.0f}s]",
        f"env_steps={steps} ({steps / max(elapsed_s, 1e-9):.0f}/s)",
        f"episodes={counters.get('episodes', 0)}",
        f"mean_return={'-' if mean is None else f'{mean:.1f}'}",
        f"version={registry.weight_version()}",
        f"roles={alive}/{expected} alive",
        f"restarts={restarts}",
    ]
    for counter in ("bad_frames", "bad_chunks", "bad_requests", "weights_rejected"):
        if counters.get(counter):
            parts.append(f"{counter}={counters[counter]}")
    return " ".join(parts)


def write_report(
    registry: Registry, cfg: Config, run_dir: Path, wall_s: float, reason: str
) -> dict[str, Any]:
    """Write ``summary.json`` (and a learning-curve PNG when episodes exist); return the summary."""
    counters = registry.counters()
    episodes = registry.series("episodes")
    window = cfg.run.stop.return_window
    recent = episodes[-window:]
    final_mean = sum(e["return"] for e in recent) / len(recent) if recent else None
    recent_rate = (
        sum(bool(e.get("success")) for e in recent) / len(recent)
        if recent and "success" in recent[-1]
        else None
    )
    full_window = len(recent) >= window
    summary = {
        "run_id": cfg.run.name,
        "mode": cfg.run.mode,
        "stop_reason": reason,
        # Either target reached over a full window of the last episodes (what stops the run).
        "solved": full_window and meets_target(cfg.run.stop, final_mean, recent_rate),
        "env_steps": counters.get("env_steps", 0),
        "wall_s": round(wall_s, 3),
        "final_mean_return": final_mean,
        "episodes": len(episodes),
        "weight_version": registry.weight_version(),
        "counters": counters,
        "finished_at": time.time(),
    }  # fmt: skip
    if recent_rate is not None:
        summary["success_rate"] = recent_rate
    evaluation = evaluation_summary(registry)
    if evaluation is not None:
        summary["evaluation"] = evaluation
    if evaluation is not None and evaluation["episodes"]:
        # Measured on fresh episodes of the final weights: it decides, over all of them (the
        # last-window rule would judge only the last return_window of them).
        if "success_rate" in evaluation:
            summary["success_rate"] = evaluation["success_rate"]
        summary["solved"] = meets_target(
            cfg.run.stop, evaluation["mean_return"], evaluation.get("success_rate")
        )
    last = registry.series("metrics", last=1)
    if last and "loss" in last[-1]:
        summary["final_loss"] = last[-1]["loss"]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if episodes:
        plot_learning_curve(episodes, run_dir / "learning_curve.png", window)
    return summary


def plot_learning_curve(episodes: list[dict[str, Any]], path: Path, window: int) -> None:
    """Episode return against env steps, with a moving average over ``window`` episodes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [e.get("env_steps", i) for i, e in enumerate(episodes)]
    ys = [e["return"] for e in episodes]
    smooth = [sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1])
              for i in range(len(ys))]  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, ".", alpha=0.3, label="episode return")
    ax.plot(xs, smooth, "-", label=f"mean of last {window}")
    ax.set_xlabel("env steps")
    ax.set_ylabel("return")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
