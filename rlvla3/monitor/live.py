"""``rlvla3 monitor``: a live terminal view of a run, or one JSON snapshot for scripts.

Read-only: it finds the run's Redis through ``run.json`` in the run dir and reads the registry,
counters, weight version and the roles' own gauges. It works from any node of a multi-node run:
every node's run dir has ``run.json`` and the run secret (``secret``, mode 0600).
"""

from __future__ import annotations

import dataclasses
import io
import json
import threading
import time
from pathlib import Path
from typing import Any

import redis
from rich.console import Console, Group
from rich.live import Live

from rlvla3.monitor.rates import RunHistory
from rlvla3.monitor.view import render
from rlvla3.runtime.chunk_ledger import balance
from rlvla3.runtime.registry import Registry
from rlvla3.runtime.registry_records import LauncherRecord, RoleRecord

_RECENT_EPISODES = 400  # the learning curve's sparkline reaches this far back


class RunNotFound(RuntimeError):
    """No run dir (with a ``run.json``) matches what the user asked for."""


def find_run(run: str | None, runs_root: str = "runs") -> dict[str, Any]:
    """The ``run.json`` of ``run`` (a run dir, or a run name under ``runs_root``; newest if None)."""
    candidates: list[Path]
    if run is not None:
        candidates = [Path(run) / "run.json", Path(runs_root) / run / "run.json"]
    else:
        candidates = sorted(Path(runs_root).glob("*/run.json"), key=lambda p: p.stat().st_mtime)
        candidates = candidates[-1:]
    for path in candidates:
        if path.is_file():
            try:
                info = json.loads(path.read_text())
            except ValueError as err:
                raise RunNotFound(f"{path}: not valid JSON ({err})") from None
            return {**info, "run_dir": str(path.parent)}
    where = run if run is not None else f"{runs_root}/*"
    raise RunNotFound(f"--run {where}: no run.json found (is the run dir right? try --run PATH)")


def snapshot(registry: Registry) -> dict[str, Any]:
    """Everything the monitor shows, as plain data (what ``--json`` prints)."""
    counters = registry.counters()
    roles = registry.roles()
    chunks = balance(registry.chunk_ledger(), counters)
    recent = registry.series("episodes", last=_RECENT_EPISODES)
    metrics = registry.series("metrics", last=1)
    return {
        "run_id": registry.run_id,
        "time": time.time(),
        "stop_reason": registry.stop_reason(),
        "weight_version": registry.weight_version(),
        "counters": counters,
        "chunks_in_flight": chunks.produced - chunks.consumed - chunks.dropped - chunks.lost,
        "chunk_accounting": chunks.as_dict(),
        "mean_return_last_20": _mean_return(recent[-20:]),
        "recent_episodes": [
            {k: e[k] for k in ("return", "success", "env_steps") if k in e} for e in recent
        ],
        "last_metrics": metrics[-1] if metrics else None,
        "evaluations": registry.series("evaluations", last=10),
        "roles": [dataclasses.asdict(r) for r in roles],
        "nodes": node_totals(roles, registry.launchers()),
    }


def _mean_return(episodes: list[dict[str, Any]]) -> float | None:
    return sum(e["return"] for e in episodes) / len(episodes) if episodes else None


def node_totals(roles: list[RoleRecord], launchers: list[LauncherRecord]) -> list[dict[str, Any]]:
    """Per node: its launcher (status, address) and its roles (alive of all, summed rates)."""
    launcher = {rec.node: rec for rec in launchers}
    names = sorted({r.node for r in roles} | set(launcher))
    totals = []
    for name in names:
        mine = [r for r in roles if r.node == name]
        rec = launcher.get(name)
        totals.append(
            {
                "node": name,
                "launcher": (rec.status if rec.alive else "LOST") if rec else "-",
                "address": rec.address if rec else (mine[0].host if mine else ""),
                "roles_alive": sum(r.alive for r in mine),
                "roles": len(mine),
                "steps_per_s": sum(r.stats.get("steps_per_s", 0.0) for r in mine if r.alive),
                "requests_per_s": sum(r.stats.get("requests_per_s", 0.0) for r in mine if r.alive),
            }
        )
    return totals


def watch(registry: Registry, interval_s: float = 1.0, stop: threading.Event | None = None) -> int:
    """Redraw the view every ``interval_s`` until Ctrl-C or the run's Redis goes away."""
    stop = stop or threading.Event()
    console = Console()
    history = RunHistory(window_s=max(5.0, 3 * interval_s))

    def screen() -> Group:
        history.add(snapshot(registry))
        width, height = console.size
        return render(history, width=width, height=height)

    try:
        with Live(screen(), console=console, refresh_per_second=4, screen=False) as live:
            while not stop.wait(interval_s):
                live.update(screen())
    except KeyboardInterrupt:
        return 0
    except (redis.ConnectionError, FileNotFoundError):
        console.print("the run's Redis is gone: the run has ended")
        return 0
    return 0


def save_svg(registry: Registry, path: Path, width: int = 80, height: int = 24) -> None:
    """Write one screen of the view, as an 80x24 terminal would show it, to an SVG file
    (rates need two snapshots: it takes them ``2 x`` a window apart)."""
    history = RunHistory(window_s=3.0)
    for _ in range(3):
        history.add(snapshot(registry))
        time.sleep(1.5)  # (the view's rates are differences over time)
    history.add(snapshot(registry))
    console = Console(record=True, width=width, height=height, file=io.StringIO())
    console.print(render(history, width=width, height=height))
    console.save_svg(str(path), title=f"rlvla3 monitor: {registry.run_id}")
