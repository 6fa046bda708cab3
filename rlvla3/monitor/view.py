"""The monitor's screen: health, recent rates with sparklines, queues against their limits,
staleness, drops, bad input, the learning curve and one row per role, in 80x24 and more.

Everything shown is derived (``rlvla3.monitor.rates``, ``rlvla3.monitor.diagnosis``): rates per
second over a recent window, times in ms, shares in %, never raw microsecond totals.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from rlvla3.monitor import diagnosis
from rlvla3.monitor.rates import RoleFigures, RunHistory, sparkline

_STATUS_STYLE = {
    "running": "green",
    "done": "blue",
    "error": "bold red",
    "LOST": "bold red",
    "STALLED": "bold red",
}
_SPARK_POINTS = 20
_HEADER_LINES = 10  # lines above the role table, its header included


def render(history: RunHistory, width: int = 80, height: int = 24) -> Group:
    """One screen of the run for a terminal of ``width`` x ``height`` (at least 80x24)."""
    snap = history.latest
    figures = history.roles(spark_points=8)
    healthy, problem = diagnosis.health(history, figures)
    lines: list[Text] = [_header(snap, healthy, problem, diagnosis.stopping(history))]
    lines.append(
        _rate_line("env steps", history, "env_steps", "/s")
        + _rate_line("  trained", history, "samples_consumed", "/s")
    )
    lines.append(
        Text(
            f"requests {history.rate('requests_served'):,.0f}/s  "
            f"updates {history.rate('updates'):.1f}/s  "
            f"episodes {history.rate('episodes'):.1f}/s  "
            f"restarts {snap['counters'].get('role_restarts', 0)}"
        )
    )
    lines.append(_queue_line(history))
    lines.append(_staleness_line(history))
    lines.append(_bad_input_line(snap["counters"]))
    lines.append(_learning_line(history))
    lines.append(_evaluation_line(snap.get("evaluations") or []))
    lines.append(Text(f"bottleneck: {diagnosis.bottleneck(history, figures)}", style="cyan"))
    for line in lines:  # one line each, whatever the figures: the role table keeps its room
        line.no_wrap, line.overflow = True, "ellipsis"
        line.truncate(width, overflow="ellipsis")
    room = max(3, height - _HEADER_LINES - 1)
    parts: list[Text | Table] = [*lines, _role_table(figures, room, width)]
    nodes = snap.get("nodes") or []
    if len(nodes) > 1 and height - _HEADER_LINES - len(figures) - 2 > len(nodes) + 1:
        parts.append(_node_table(nodes))
    return Group(*parts)


def _header(snap: dict, healthy: bool, problem: str, history_stopping: bool) -> Text:
    text = Text(f"rlvla3 {snap['run_id']}  weights v{snap['weight_version']}  ", style="bold")
    if history_stopping:
        text.append(f"stopping: {snap.get('stop_reason') or 'the run is ending'}", style="yellow")
    elif healthy:
        text.append("healthy", style="bold green")
    else:
        text.append(f"UNHEALTHY: {problem}", style="bold red")
    return text


def _rate_line(label: str, history: RunHistory, counter: str, unit: str) -> Text:
    spark = sparkline(history.rate_history(counter, _SPARK_POINTS), _SPARK_POINTS)
    text = Text(f"{label} {history.rate(counter):,.0f}{unit} ")
    text.append(spark, style="magenta")
    return text


def _bar(value: float, limit: float, width: int = 16) -> str:
    filled = 0 if limit <= 0 else max(0, min(width, round(width * value / limit)))
    return "█" * filled + "░" * (width - filled)


def _queue_line(history: RunHistory) -> Text:
    snap = history.latest
    queued = [r["stats"].get("chunks_queued") for r in snap["roles"] if r["role"] == "env_worker"]
    limits = [
        r["stats"].get("max_chunks_queued") for r in snap["roles"] if r["role"] == "env_worker"
    ]
    q = max((max(0.0, v) for v in queued if v is not None), default=None)
    limit = max((v for v in limits if v is not None), default=0.0)
    text = Text("chunks queued ")
    if q is None:
        text.append("-")
    elif limit:
        style = "red" if q >= 0.8 * limit else "green"
        text.append(f"{q:.0f}/{limit:.0f} ")
        text.append(_bar(q, limit, 12), style=style)
    else:
        text.append(f"{q:.0f} (no limit)")
    text.append(f"  in flight {snap['chunks_in_flight']}")
    waiting = diagnosis.waiting_share(history)
    if waiting is not None:
        text.append(f"  envs waiting {waiting:.0%} ")
        text.append(_bar(waiting, 1.0, 8), style="yellow")
    return text


def _staleness_line(history: RunHistory) -> Text:
    shares = diagnosis.staleness_shares(history)
    text = Text("staleness ")
    text.append(" ".join(f"{label}:{share:.0%}" for label, share in shares) or "-")
    drops = diagnosis.drop_shares(history)
    if drops is not None:
        style = "red" if drops["samples"] > 0.02 else ""
        text.append(
            f"  dropped {drops['samples']:.1%}: {drops['stale_chunks']} stale, "
            f"{drops['refused_chunks']} refused",
            style=style,
        )
    return text


def _bad_input_line(counters: dict[str, int]) -> Text:
    bad = [f"{name}={counters[name]}" for name in diagnosis.BAD_INPUT if counters.get(name)]
    return Text("bad input: " + (" ".join(bad) if bad else "none"), style="red" if bad else "")


def _learning_line(history: RunHistory) -> Text:
    returns, successes = history.learning(_SPARK_POINTS)
    if not returns:
        return Text("learning: no episodes yet")
    text = Text(f"return {returns[-1]:.1f} ")
    text.append(sparkline(_shifted(returns), _SPARK_POINTS), style="magenta")
    if successes:
        text.append(f"  success {successes[-1]:.0%} ")
        text.append(sparkline(successes, _SPARK_POINTS), style="magenta")
    return text


def _shifted(values: list[float]) -> list[float]:
    """Values moved to start at 0, so negative returns still draw a curve."""
    low = min(values)
    return [v - low for v in values]


def _evaluation_line(evaluations: list[dict]) -> Text:
    if not evaluations:
        return Text("evaluation: none (run.eval)")
    shown = []
    for e in reversed(evaluations[-4:]):
        rate = f"{e['success_rate']:.0%}" if "success_rate" in e else f"ret {e['mean_return']:.1f}"
        shown.append(f"v{e['version']} {rate}")
    return Text(f"evaluated ({evaluations[-1]['episodes']} eps): " + ", ".join(shown))


def _role_table(figures: list[RoleFigures], room: int, width: int) -> Table:
    """One row per role instance: its status, headline rate per second (env steps for env
    workers, requests for rollout servers, samples for trainers) and its trend, and detail."""
    multi_node = len({f.node for f in figures}) > 1
    table = Table(box=None, pad_edge=False, expand=False, show_edge=False, header_style="bold")
    table.add_column("role", no_wrap=True, max_width=22)
    if multi_node:
        table.add_column("node", no_wrap=True, max_width=10)
    table.add_column("status", no_wrap=True, max_width=11)
    table.add_column("rate/s", justify="right", no_wrap=True)
    table.add_column("trend", no_wrap=True)
    used = 22 + 11 + 7 + 8 + 4 + (11 if multi_node else 0)
    table.add_column("detail", no_wrap=True, overflow="ellipsis", max_width=max(16, width - used))
    shown = figures if len(figures) <= room else figures[: room - 1]
    for f in shown:
        status = f.status
        if f.restarts:
            status = f"{status} ↻{f.restarts}"
        row = [f.key] + ([f.node] if multi_node else [])
        row += [
            Text(status, style=_status_style(f.status)),
            "" if f.rate is None else _short(f.rate),
            f.spark,
            f.detail,
        ]
        table.add_row(*row)
    if len(shown) < len(figures):
        table.add_row(f"... {len(figures) - len(shown)} more", *[""] * (len(table.columns) - 1))
    return table


def _status_style(status: str) -> str:
    return "green" if status.startswith("busy") else _STATUS_STYLE.get(status, "yellow")


def _short(rate: float) -> str:
    """A rate in at most 6 characters: 812, 12.4k, 3.1M."""
    if rate < 10_000:
        return f"{rate:,.0f}"
    if rate < 1e6:
        return f"{rate / 1e3:.1f}k"
    return f"{rate / 1e6:.1f}M"


def _node_table(nodes: list[dict]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("node", "address", "launcher", "roles", "steps/s"):
        table.add_column(col, no_wrap=True)
    for n in nodes:
        style = _status_style(n["launcher"])
        table.add_row(
            n["node"],
            n["address"],
            Text(n["launcher"], style=style),
            f"{n['roles_alive']}/{n['roles']}",
            f"{n['steps_per_s']:,.0f}",
        )
    return table
