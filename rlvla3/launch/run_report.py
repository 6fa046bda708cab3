"""What the launcher reads from Redis while a run goes and writes when it ends.

- ``stop_condition``: the run's stop rules (``run.stop``) checked against live counters.
- ``ProgressTracker``: the launcher's progress line for the terminal.
- ``write_report``: ``summary.json`` and ``learning_curve.png`` in the run dir.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rlvla3.config.run_config import Config
from rlvla3.runtime.chunk_ledger import balance
from rlvla3.runtime.registry import Registry


def mean_recent(registry: Registry, key: str, window: int) -> float | None:
    """Mean of ``key`` over the newest ``window`` episodes, None before there are that many."""
    recent = registry.series("episodes", last=window)
    if len(recent) < window or not recent:
        return None
    return sum(float(e.get(key, 0.0)) for e in recent) / len(recent)


SOLVED = "solved: "
"""How ``stop_condition`` begins a reason that is a reached target (``write_report`` reads it)."""


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
            return f"{SOLVED}mean return {mean:.1f} over {stop.return_window} episodes"
    if stop.target_success_rate is not None:
        rate = mean_recent(registry, "success", stop.return_window)
        if rate is not None and rate >= stop.target_success_rate:
            return f"{SOLVED}success rate {rate:.2f} over {stop.return_window} episodes"
    if stop.target_eval_success_rate is not None:
        return _eval_target_reached(registry, stop.target_eval_success_rate, stop.eval_window)
    return None


# Each evaluated rate is a fraction of episodes, so the float mean of rates that exactly meet a
# target can land a rounding error below it (three evaluations of 0.95 average 0.94999...).
_MEAN_ROUNDING = 1e-9


def _eval_target_reached(registry: Registry, target: float, window: int) -> str | None:
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
        return (
            f"{SOLVED}evaluated success rate {rate:.2f} of weights v{newest['version']} "
            f"on {newest['episodes']} held-out episodes"
        )
    return (
        f"{SOLVED}evaluated success rate {rate:.2f}, the mean of {window} evaluations up to "
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


_NO_PROGRESS_S = 20.0  # the progress line flags a run whose env steps and weights stand still


class ProgressTracker:
    """The launcher's progress line. Rates are over the time since the previous line, not the
    average since the start (a run that stopped moving shows 0/s at once), roles whose
    heartbeat expired are named, and a run whose env steps and weight version stand still says
    so instead of only counting live roles."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._last: tuple[float, int, int] | None = None  # (elapsed_s, env steps, version)
        self._moved_at = 0.0
        self._updates = 0
        self._learned_at = 0.0  # when the trainers' update count last moved
        self._learns = cfg.num_processes("trainer") > 0

    def line(self, registry: Registry, elapsed_s: float, restarts: int) -> str:
        """E.g. ``[  30s] env_steps=41200 (1373/s) episodes=310 mean_return=212.5 version=57
        roles=5/5 alive restarts=0``."""
        counters = registry.counters()
        steps = counters.get("env_steps", 0)
        version = registry.weight_version()
        prev_s, prev_steps, prev_version = self._last or (0.0, 0, -1)
        rate = (steps - prev_steps) / max(elapsed_s - prev_s, 1e-9)
        if self._last is None or (steps, version) != (prev_steps, prev_version):
            self._moved_at = elapsed_s
        updates = counters.get("updates", 0)
        if self._last is None or updates != self._updates:
            self._learned_at, self._updates = elapsed_s, updates
        self._last = (elapsed_s, steps, version)
        mean = mean_recent(registry, "return", min(self.cfg.run.stop.return_window, 20))
        roles = registry.roles()
        expected = max(len(roles), sum(rc.count for rc in self.cfg.roles.values()))
        parts = [
            f"[{elapsed_s:5.0f}s]",
            f"env_steps={steps} ({rate:.0f}/s)",
            f"episodes={counters.get('episodes', 0)}",
            f"mean_return={'-' if mean is None else f'{mean:.1f}'}",
            f"version={version}",
            f"roles={sum(r.alive for r in roles)}/{expected} alive",
            f"restarts={restarts}",
        ]
        lost = [
            f"{r.role}/{r.index}@{r.node}"
            for r in roles
            if not r.alive and r.status in ("starting", "running")
        ]
        if lost:
            parts.append(f"LOST={','.join(lost)}")
        stalled = [f"{r.role}/{r.index}@{r.node}" for r in roles if r.alive and r.stalled_for_s > 0]
        if stalled:
            parts.append(f"STALLED={','.join(stalled)}")
        for counter in (
            "bad_frames",
            "bad_chunks",
            "bad_requests",
            "weights_rejected",
            "auth_refused",
        ):
            if counters.get(counter):
                parts.append(f"{counter}={counters[counter]}")
        still_s = elapsed_s - self._moved_at
        if still_s >= _NO_PROGRESS_S:
            what = (
                "no weights have reached the rollout servers"
                if version < 0
                else "env steps and weight version have not moved"
            )
            parts.append(f"NO PROGRESS for {still_s:.0f}s: {what}")
        elif self._learns and elapsed_s - self._learned_at >= _NO_PROGRESS_S:
            parts.append(
                f"NO LEARNING for {elapsed_s - self._learned_at:.0f}s: env steps go on but no "
                f"trainer update ran (chunks_dropped={counters.get('chunks_dropped', 0)}; see "
                "the trainer's log)"
            )
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
        # The stop rule's verdict stands: episodes that finish while the roles are stopping
        # come after it and must not undo it.
        "solved": reason.startswith(SOLVED)
        or (full_window and meets_target(cfg.run.stop, final_mean, recent_rate)),
        "env_steps": counters.get("env_steps", 0),
        "wall_s": round(wall_s, 3),
        "final_mean_return": final_mean,
        "episodes": len(episodes),
        "weight_version": registry.weight_version(),
        "counters": counters,
        "finished_at": time.time(),
    }
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
    # Where every chunk went, exact across crashes (rlvla3/runtime/chunk_ledger.py): lost are those a
    # node, a killed worker's queue or a killed trainer took with it.
    chunks = balance(registry.chunk_ledger(), counters)
    summary["chunk_accounting"] = chunks.as_dict()
    summary["chunks_lost"] = chunks.lost
    summary["roles"] = [
        {
            "role": r.role,
            "index": r.index,
            "node": r.node,
            "host": r.host,
            "status": r.status,
            "restarts": r.restarts,
            "stats": r.stats,
        }
        for r in registry.roles()
    ]
    summary["nodes"] = [
        {"node": n.node, "address": n.address, "hostname": n.hostname, "status": n.status}
        for n in registry.launchers()
    ]
    last = registry.series("metrics", last=1)
    if last and "loss" in last[-1]:
        summary["final_loss"] = last[-1]["loss"]
    evaluations = registry.series("evaluations")
    if evaluations:
        summary["evaluations"] = [
            {k: e[k] for k in _EVALUATION_KEYS if k in e} for e in evaluations
        ]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if episodes:
        plot_learning_curve(episodes, run_dir / "learning_curve.png", window, evaluations)
    return summary


_EVALUATION_KEYS = ("version", "env_steps", "episodes", "success_rate", "mean_return")


def _moving_mean(ys: list[float], window: int) -> list[float]:
    return [
        sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1])
        for i in range(len(ys))
    ]


def plot_learning_curve(
    episodes: list[dict[str, Any]],
    path: Path,
    window: int,
    evaluations: list[dict[str, Any]] | None = None,
) -> None:
    """Episode return against env steps, with a moving average over ``window`` episodes, and
    the periodic evaluations' mean returns. Where the env reports success, a second panel
    shows the training (sampled) episodes' success rate over ``window`` episodes beside the
    evaluated (greedy, held-out) success rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluations = evaluations or []
    window = max(window, len(episodes) // 200)  # a long run's curve stays readable
    xs = [e.get("env_steps", i) for i, e in enumerate(episodes)]
    ys = [e["return"] for e in episodes]
    has_success = any("success" in e for e in episodes)
    fig, axes = plt.subplots(1, 2 if has_success else 1, figsize=(12 if has_success else 7, 4))
    ax = axes[0] if has_success else axes
    ax.plot(xs, ys, ".", alpha=0.3, label="episode return")
    ax.plot(xs, _moving_mean(ys, window), "-", label=f"mean of last {window}")
    _finish_panel(ax, "return", evaluations, "mean_return")
    if has_success:
        ax = axes[1]
        wins = [float(bool(e.get("success"))) for e in episodes]
        ax.plot(xs, _moving_mean(wins, window), "-", label=f"training episodes, last {window}")
        ax.set_ylim(-0.02, 1.02)
        _finish_panel(ax, "success rate", evaluations, "success_rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _finish_panel(ax: Any, ylabel: str, evaluations: list[dict[str, Any]], key: str) -> None:
    """Add the periodic evaluations' ``key`` (where they have it), labels, legend and grid."""
    rated = [e for e in evaluations if key in e]
    if rated:
        ax.plot(
            [e["env_steps"] for e in rated],
            [e[key] for e in rated],
            "o-",
            label="evaluation (greedy, held-out)",
        )
    ax.set_xlabel("env steps")
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
