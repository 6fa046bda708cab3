"""What the monitor concludes from a run's recent history: whether it is healthy, where it
waits, how stale the samples it trains are and how many it drops.

Every figure here is read off a ``RunHistory`` (``rlvla3.monitor.rates``) over its window.
"""

from __future__ import annotations

from typing import Any

from rlvla3.monitor.rates import RoleFigures, RunHistory, role_key

# Counters of input the run refused, shown on the monitor when any is non-zero.
BAD_INPUT = (
    "bad_frames",
    "bad_requests",
    "bad_replies",
    "bad_chunks",
    "weights_rejected",
    "auth_refused",
)

# The trained-staleness counters, by how many versions the samples lagged.
STALENESS_BUCKETS = (
    ("0", "trained_staleness_0"),
    ("1", "trained_staleness_1"),
    ("2", "trained_staleness_2"),
    ("3+", "trained_staleness_3plus"),
)


def staleness_shares(history: RunHistory) -> list[tuple[str, float]]:
    """Share of the samples trained in the window by how many versions they lagged
    (empty when the window trained none)."""
    counts = [(label, history.delta(c)) for label, c in STALENESS_BUCKETS]
    total = sum(n for _, n in counts)
    return [(label, n / total) for label, n in counts] if total else []


def drop_shares(history: RunHistory) -> dict[str, float] | None:
    """Of the samples the trainers took in the window (trained or dropped), the share
    dropped, and the chunks dropped as too stale (or for their group) and refused by the
    chunk checks. None when the window saw none."""
    consumed, dropped = history.delta("samples_consumed"), history.delta("samples_dropped")
    if consumed + dropped == 0:
        return None
    refused = history.delta("bad_chunks")
    return {
        "samples": dropped / (consumed + dropped),
        "stale_chunks": max(0, history.delta("chunks_dropped") - refused),
        "refused_chunks": refused,
    }


def stopping(history: RunHistory) -> bool:
    """Whether the run is ending: a stop was asked for, or its roles are stopping."""
    snap = history.latest
    return bool(snap.get("stop_reason")) or any(
        r["status"] in ("stopping", "done") for r in snap["roles"]
    )


def health(history: RunHistory, figures: list[RoleFigures]) -> tuple[bool, str]:
    """(healthy, what is wrong): a LOST, STALLED or failed role, or a run that stands."""
    bad = [f"{f.key} {f.status}" for f in figures if f.status in ("LOST", "STALLED", "error")]
    if bad:
        more = f" +{len(bad) - 2}" if len(bad) > 2 else ""
        return False, ", ".join(bad[:2]) + more
    if stopping(history):
        return True, ""
    moving = history.rate("env_steps") > 0 or history.rate("sft_samples") > 0
    kept_s = history.latest["time"] - history.snaps[0]["time"]
    if len(history.snaps) >= 2 and kept_s >= history.window_s:
        if not moving and not history.latest.get("stop_reason"):
            return False, "no env steps or SFT samples in the last window"
    return True, ""


def bottleneck(history: RunHistory, figures: list[RoleFigures]) -> str:
    """Where the run waits, in words: the trainer, the rollout servers or the simulators."""
    c = history.latest["counters"]
    queued = _max_stat(history.latest, "env_worker", "chunks_queued")
    limit = _max_stat(history.latest, "env_worker", "max_chunks_queued")
    drops = drop_shares(history)
    if limit and queued is not None and queued >= 0.8 * limit:
        return f"trainer: {queued:.0f}/{limit:.0f} chunks queued, envs held back"
    if drops is not None and drops["samples"] > 0.1:
        return f"trainer: {drops['samples']:.0%} of samples dropped (too stale)"
    waits = [
        (
            history.role_ratio(f.key, "action_wait_us", "action_requests"),
            history.role_ratio(f.key, "env_step_us", "env_steps"),
        )
        for f in figures
        if f.role == "env_worker"
    ]
    waits = [(w, s) for w, s in waits if w is not None and s is not None]
    if not waits or not c.get("env_steps"):
        return "-"
    wait = sum(w for w, _ in waits) / len(waits)
    sim = sum(s for _, s in waits) / len(waits)
    fills = [
        history.latest_stat(f.key, "batch_fill") for f in figures if f.role == "rollout_server"
    ]
    fill = max((f for f in fills if f is not None), default=0.0)
    if wait > sim:
        busy = "saturated, " if fill >= 0.9 else ""
        return (
            f"rollout servers ({busy}envs wait {wait / 1000:.1f}ms per action, "
            f"step {sim / 1000:.2f}ms)"
        )
    return f"simulators (step {sim / 1000:.2f}ms, action {wait / 1000:.1f}ms)"


def waiting_share(history: RunHistory) -> float | None:
    """The share of the env workers' env time spent waiting for an action in the window
    (their action round trips per second over their envs; None without env workers)."""
    workers = [r for r in history.latest["roles"] if r["role"] == "env_worker" and r["alive"]]
    envs = sum(r["stats"].get("envs", 0) for r in workers)
    if not envs:
        return None
    waited_s = sum(history.role_rate(role_key(r), "action_wait_us") for r in workers) / 1e6
    return min(1.0, waited_s / envs)


def _max_stat(snap: dict[str, Any], role: str, stat: str) -> float | None:
    values = [r["stats"][stat] for r in snap["roles"] if r["role"] == role and stat in r["stats"]]
    return max(values) if values else None
