"""``rlvla3 monitor``: a live terminal view of a run, or one JSON snapshot for scripts.

Read-only: it finds the run's Redis through ``run.json`` in the run dir and reads the registry,
counters, weight version and the roles' own gauges. It works from any node of a multi-node run:
every node's run dir has ``run.json`` and the run secret (``secret``, mode 0600).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from rlvla3.chunk_ledger import balance
from rlvla3.registry import LauncherRecord, Registry, RoleRecord

# Gauges each role publishes that the table shows first, in this order.
_KEY_GAUGES = (
    "steps_per_s",
    "requests_per_s",
    "batch_fill",
    "chunks_queued",
    "queue_wait_ms",
    "staleness",
    "policy_version",
    "updates",
    "bad_frames",
)


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
    recent = registry.series("episodes", last=20)
    metrics = registry.series("metrics", last=1)
    return {
        "run_id": registry.run_id,
        "time": time.time(),
        "stop_reason": registry.stop_reason(),
        "weight_version": registry.weight_version(),
        "counters": counters,
        "chunks_in_flight": chunks.produced - chunks.consumed - chunks.dropped - chunks.lost,
        "chunk_accounting": chunks.as_dict(),
        "mean_return_last_20": sum(e["return"] for e in recent) / len(recent) if recent else None,
        "last_metrics": metrics[-1] if metrics else None,
        "evaluations": registry.series("evaluations", last=10),
        "roles": [dataclasses.asdict(r) for r in roles],
        "nodes": node_totals(roles, registry.launchers()),
    }


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


def role_status(role: dict[str, Any]) -> str:
    """What the monitor calls a role (a ``RoleRecord`` as a dict): LOST when its heartbeat
    expired, STALLED when it is alive but finished no step by its deadline, ``busy: ...``
    while it says so, else its own status."""
    if not role["alive"] and role["status"] not in ("done", "error"):
        return "LOST"
    if role.get("stalled_for_s", 0) > 0:
        return "STALLED"
    if role["status"] == "running" and role.get("busy"):
        return f"busy: {role['busy']}"
    return role["status"]


def render(snap: dict[str, Any]) -> Group:
    """A rich renderable of one snapshot: a role table, a node table and a line of run-wide
    figures."""
    table = Table(title=f"rlvla3 run {snap['run_id']}", expand=True)
    for col in ("role", "node", "pid", "status", "heartbeat", "restarts", "gauges"):
        table.add_column(col, overflow="fold")
    for r in snap["roles"]:
        status = role_status(r)
        style = {"running": "green", "error": "red", "LOST": "red", "STALLED": "red"}.get(
            status, "yellow"
        )
        table.add_row(
            f"{r['role']}/{r['index']}",
            r["node"],
            str(r["pid"]),
            f"[{style}]{status}[/]",
            f"{r['heartbeat_age_s']:.1f}s ago",
            str(r["restarts"]),
            _gauges(r["stats"]),
        )
    nodes = Table(expand=True)
    for col in ("node", "address", "launcher", "roles alive", "env steps/s", "requests/s"):
        nodes.add_column(col)
    for n in snap.get("nodes", []):
        style = {"running": "green", "LOST": "red", "error": "red"}.get(n["launcher"], "yellow")
        nodes.add_row(
            n["node"],
            n["address"],
            f"[{style}]{n['launcher']}[/]",
            f"{n['roles_alive']}/{n['roles']}",
            f"{n['steps_per_s']:.0f}",
            f"{n['requests_per_s']:.0f}",
        )
    c = snap["counters"]
    mean = snap["mean_return_last_20"]
    line = (
        f"env_steps={c.get('env_steps', 0)}  episodes={c.get('episodes', 0)}  "
        f"mean_return(20)={'-' if mean is None else f'{mean:.1f}'}  "
        f"weights v{snap['weight_version']}  chunks produced={c.get('chunks_produced', 0)} "
        f"consumed={c.get('chunks_consumed', 0)} dropped={c.get('chunks_dropped', 0)} "
        f"in_flight={snap['chunks_in_flight']}  bad_frames={c.get('bad_frames', 0)}"
        + (f"  auth_refused={c['auth_refused']}" if c.get("auth_refused") else "")
    )
    evaluations = snap.get("evaluations") or []
    if not evaluations:
        return Group(table, nodes, line)
    return Group(table, nodes, line, evaluation_line(evaluations))


def evaluation_line(evaluations: list[dict[str, Any]]) -> str:
    """The newest periodic evaluations, newest first: ``v12 0.62 (ret 2.3)`` each, success
    rate where the env reports it, on how many held-out episodes."""
    shown = []
    for e in reversed(evaluations[-5:]):
        rate = f"{e['success_rate']:.2f} " if "success_rate" in e else ""
        shown.append(f"v{e['version']} {rate}(ret {e['mean_return']:.1f})")
    return f"evaluated (greedy, {evaluations[-1]['episodes']} held-out episodes): " + ", ".join(
        shown
    )


def _gauges(stats: dict[str, float]) -> str:
    ordered = [k for k in _KEY_GAUGES if k in stats] + sorted(
        k for k in stats if k not in _KEY_GAUGES
    )
    return " ".join(f"{k}={_fmt(stats[k])}" for k in ordered)


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3g}"


def watch(registry: Registry, interval_s: float = 1.0, stop: threading.Event | None = None) -> int:
    """Redraw the view every ``interval_s`` until Ctrl-C or the run's Redis goes away."""
    stop = stop or threading.Event()
    console = Console()
    try:
        with Live(render(snapshot(registry)), console=console, refresh_per_second=4) as live:
            while not stop.wait(interval_s):
                live.update(render(snapshot(registry)))
    except KeyboardInterrupt:
        return 0
    except (redis.ConnectionError, FileNotFoundError):
        console.print("the run's Redis is gone: the run has ended")
        return 0
    return 0
