"""``learning_curve.png`` in the run dir: episode returns (and success rates) against env
steps, with the periodic evaluations beside them."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
