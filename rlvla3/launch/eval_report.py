"""The results of a protocol evaluation (``rlvla3 eval``): the finished episodes kept as they
arrive (``episodes.jsonl``), per task and overall success with a 95% Wilson interval, the JSON
report (``eval.json``) and the printed table."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sim.protocols import Protocol, ProtocolEpisode

Z95 = 1.959963984540054
"""The standard normal quantile of a two-sided 95% interval."""
EPISODES_FILE = "episodes.jsonl"
REPORT_FILE = "eval.json"


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a success rate of ``successes`` in ``n`` (``(0, 1)`` for
    ``n == 0``): unlike the normal approximation it stays inside [0, 1] and is not empty at 0
    or ``n`` successes."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # (at 0 or n successes the bound is exactly 0 or 1; rounding would leave 1e-17)
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def read_episodes(path: Path) -> dict[str, dict[str, Any]]:
    """The episodes recorded in ``path`` (a JSONL file) by key; a torn last line (the writer
    was killed mid-line) is skipped."""
    done: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return done
    for line in path.read_text().splitlines():
        if _is_record(line):
            result = json.loads(line)
            done.setdefault(result["key"], result)
    return done


def failed_result(episode: ProtocolEpisode, error: str) -> dict[str, Any]:
    """The record of ``episode`` when it could not be played (``error`` says why): it counts,
    unsuccessful, so the evaluation goes on without it."""
    return {
        **episode.identity(),
        "success": False,
        "success_at_end": False,
        "length": 0,
        "return": 0.0,
        "sim_fault": False,
        "error": error,
    }


def drop_torn_lines(path: Path) -> None:
    """Rewrite ``path`` (a JSONL file) without its unreadable lines (a killed writer's torn
    last line), every record kept as written; untouched when every line reads."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _is_record(line)]
    if len(kept) == len(lines) and all(line.endswith("\n") for line in kept):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line.rstrip("\n") + "\n" for line in kept))
    tmp.rename(path)


def _is_record(line: str) -> bool:
    try:
        result = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(result, dict) and isinstance(result.get("key"), str)


def stats(results: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Episodes, successes, success rate with its 95% interval, mean return and length."""
    results = list(results)
    n = len(results)
    scored = [r for r in results if r.get("success") is not None]
    out: dict[str, Any] = {
        "episodes": n,
        "mean_return": sum(r["return"] for r in results) / n if n else None,
        "mean_length": sum(r["length"] for r in results) / n if n else None,
    }
    if scored:
        k = sum(bool(r["success"]) for r in scored)
        out["successes"] = k
        out["success_rate"] = k / len(scored)
        out["success_ci95"] = list(wilson_interval(k, len(scored)))
        at_end = [r for r in scored if r.get("success_at_end") is not None]
        out["success_at_end_rate"] = (
            sum(bool(r["success_at_end"]) for r in at_end) / len(at_end) if at_end else None
        )
    return out


def build_report(
    protocol: Protocol, done: dict[str, dict[str, Any]], meta: dict[str, Any]
) -> dict[str, Any]:
    """The ``eval.json`` report of ``protocol`` from the episodes ``done`` so far."""
    keys = [e.key for e in protocol.episodes]
    results = [done[k] for k in keys if k in done]
    tasks: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        tasks.setdefault(r["task"], []).append(r)
    return {
        **meta,
        "protocol": protocol.describe(),
        "complete": len(results) == len(keys),
        "overall": stats(results),
        "tasks": {task: stats(rs) for task, rs in tasks.items()},
        "episodes": results,
    }


def write_report(run_dir: Path, report: dict[str, Any]) -> Path:
    """Write ``report`` as ``RUN_DIR/eval.json`` (whole or not at all)."""
    path = run_dir / REPORT_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.rename(path)
    return path


def table(report: dict[str, Any]) -> str:
    """The report as a text table: one row per task, then the overall row."""
    rows = [("task", "episodes", "success", "95% interval", "mean return")]
    for task, s in [*report["tasks"].items(), ("overall", report["overall"])]:
        rows.append((task[:60], str(s["episodes"]), *_rate_cells(s), _number(s["mean_return"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    return "\n".join(lines)


def _rate_cells(s: dict[str, Any]) -> tuple[str, str]:
    if "success_rate" not in s:
        return "n/a", "n/a"
    lo, hi = s["success_ci95"]
    return f"{s['success_rate']:.3f}", f"[{lo:.3f}, {hi:.3f}]"


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
