"""Feature statistics as LeRobot stores them: per episode, and aggregated over a dataset.

Per feature: ``min``, ``max``, ``mean``, ``std`` and ``count`` (frames); LeRobot v3.0 adds the
quantiles ``q01``, ``q10``, ``q50``, ``q90``, ``q99`` (its quantile normalisation reads
``q01``/``q99``). Camera images are summarised per channel, shape ``[C, 1, 1]``, in [0, 1];
other features per entry, in the feature's shape.

The dataset's ``meta/stats.json`` aggregates the episodes the way LeRobot does: counts add,
means are count-weighted, variances pool (within plus between episodes), min and max are
extremes, and a quantile (which episode summaries cannot give exactly) is the envelope of the
episodes' values: the lowest for ``q01``..``q50``, the highest above.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sft.lerobot_format import IMAGE, Feature

QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
Stats = dict[str, dict[str, np.ndarray]]  # feature -> stat name -> array


def episode_stats(
    cols: Mapping[str, np.ndarray], features: Mapping[str, Feature], *, quantiles: bool
) -> Stats:
    """Per-feature statistics of one episode's ``[T, ...]`` columns (``quantiles``: add the
    ``qNN`` entries, as v3.0 does)."""
    stats: Stats = {}
    for key, feature in features.items():
        arr = np.asarray(cols[key])
        if feature.dtype == IMAGE:  # per channel: frames and pixels reduced together
            values = arr.astype(np.float64).reshape(-1, arr.shape[-1]) / 255.0
            out_shape: tuple[int, ...] = (-1, 1, 1)
        else:
            values = arr.astype(np.float64).reshape(len(arr), *feature.shape)
            out_shape = feature.shape
        entry = {
            "min": values.min(axis=0),
            "max": values.max(axis=0),
            "mean": values.mean(axis=0),
            "std": values.std(axis=0),
        }
        if quantiles:
            levels = np.quantile(values, list(QUANTILES.values()), axis=0)
            entry.update(zip(QUANTILES, levels, strict=True))
        stats[key] = {name: v.reshape(out_shape) for name, v in entry.items()}
        stats[key]["count"] = np.array([len(arr)], np.int64)
    return stats


def aggregate_stats(episodes: Sequence[Stats]) -> Stats:
    """The dataset's statistics from its episodes' (see the module docstring)."""
    if not episodes:
        return {}
    out: Stats = {}
    for key in episodes[0]:
        parts = [e[key] for e in episodes]
        counts = np.array([int(p["count"][0]) for p in parts], np.float64)
        total = counts.sum()
        weights = counts.reshape(-1, *([1] * parts[0]["mean"].ndim)) / total
        means = np.stack([p["mean"] for p in parts])
        mean = (weights * means).sum(axis=0)
        spread = np.stack([p["std"] ** 2 for p in parts]) + (means - mean) ** 2
        entry = {
            "min": np.min([p["min"] for p in parts], axis=0),
            "max": np.max([p["max"] for p in parts], axis=0),
            "mean": mean,
            "std": np.sqrt((weights * spread).sum(axis=0)),
            "count": np.array([int(total)], np.int64),
        }
        for name, level in QUANTILES.items():
            if all(name in p for p in parts):
                envelope = np.min if level <= 0.5 else np.max
                entry[name] = envelope([p[name] for p in parts], axis=0)
        out[key] = entry
    return out


def stats_to_json(stats: Stats) -> dict[str, dict[str, Any]]:
    """Nested lists (JSON and parquet list columns), ``count`` as integers."""
    return {key: {name: v.tolist() for name, v in entry.items()} for key, entry in stats.items()}
