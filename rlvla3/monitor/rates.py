"""What the monitor derives from successive snapshots: rates per second over a recent window,
their history for sparklines, and per-role figures in ms and shares instead of raw totals.

``RunHistory`` keeps the snapshots (``rlvla3.monitor.live.snapshot``) of the last few minutes; every
figure is a difference between two of them divided by the time between them, so a run that
stops moving shows 0/s within one window. A role's own counters restart from zero when its
process restarts; such a drop counts as a restart, never as a negative rate. What the monitor
concludes from these figures (health, bottleneck, staleness) is ``rlvla3.monitor.diagnosis``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from rlvla3.config.role_table import ROLE_TABLE

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int) -> str:
    """The last ``width`` values as block characters scaled from 0 to their maximum."""
    values = values[-width:]
    top = max(values, default=0.0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(
        SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in values
    )


def headline_rate(role: str) -> tuple[str, str]:
    """The counter whose rate is ``role``'s headline figure, and its unit (``("", "")``: none,
    or a role the table does not know)."""
    spec = ROLE_TABLE.get(role)
    return spec.headline_rate if spec is not None and spec.headline_rate else ("", "")


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
    if role["status"] == "starting" and int(role.get("restarts", 0)) > 0:
        return "restarting"
    return role["status"]


def role_key(role: dict[str, Any]) -> str:
    """``role/index`` of a role record."""
    return f"{role['role']}/{role['index']}"


@dataclass(frozen=True, slots=True)
class RoleFigures:
    """One role instance's derived figures for the monitor."""

    key: str
    role: str
    node: str
    status: str
    restarts: int
    rate: float | None
    """Its headline rate (``RoleSpec.headline_rate``) over the window, None for roles without one."""
    unit: str
    spark: str
    """Its rate over the last minutes."""
    detail: str
    """The figures that locate a bottleneck at this role (ms, shares, versions)."""


class RunHistory:
    """Snapshots of one run over the last ``keep_s`` seconds, and the rates they give.

    Args:
        window_s: rates are averaged over (about) this many recent seconds.
        keep_s: how far back the sparklines reach.
    """

    def __init__(self, window_s: float = 5.0, keep_s: float = 300.0) -> None:
        self.window_s = window_s
        self.keep_s = keep_s
        self.snaps: deque[dict[str, Any]] = deque()

    def add(self, snap: dict[str, Any]) -> None:
        """Record a snapshot (its ``time`` field orders them)."""
        self.snaps.append(snap)
        while self.snaps and snap["time"] - self.snaps[0]["time"] > self.keep_s:
            self.snaps.popleft()

    @property
    def latest(self) -> dict[str, Any]:
        return self.snaps[-1]

    def _base(self, now: dict[str, Any], window_s: float) -> dict[str, Any] | None:
        """The newest snapshot at least ``window_s`` older than ``now`` (else the oldest)."""
        base = None
        for snap in self.snaps:
            if now["time"] - snap["time"] >= window_s or base is None:
                base = snap
            if now["time"] - snap["time"] < window_s:
                break
        return base if base is not None and base is not now else None

    # --- run-wide -----------------------------------------------------------------------------
    def rate(self, counter: str, now: dict[str, Any] | None = None) -> float:
        """A run-wide counter's increase per second over the window ending at ``now``."""
        now = now or self.latest
        base = self._base(now, self.window_s)
        if base is None:
            return 0.0
        dt = now["time"] - base["time"]
        delta = now["counters"].get(counter, 0) - base["counters"].get(counter, 0)
        return max(0.0, delta / dt) if dt > 0 else 0.0

    def delta(self, counter: str) -> int:
        """A run-wide counter's increase over the window (0 before there are two snapshots)."""
        base = self._base(self.latest, self.window_s)
        if base is None:
            return 0
        return max(0, self.latest["counters"].get(counter, 0) - base["counters"].get(counter, 0))

    def rate_history(self, counter: str, points: int) -> list[float]:
        """``counter``'s rate at ``points`` evenly spaced moments of the kept history."""
        return self._history(points, lambda now: self.rate(counter, now))

    def _history(self, points: int, value: Any) -> list[float]:
        snaps = list(self.snaps)
        if len(snaps) < 2:
            return []
        span = snaps[-1]["time"] - snaps[0]["time"]
        out, j = [], 0
        for i in range(points):
            t = snaps[0]["time"] + span * (i + 1) / points
            while j + 1 < len(snaps) and snaps[j + 1]["time"] <= t:
                j += 1
            out.append(value(snaps[j]))
        return out

    # --- per role -----------------------------------------------------------------------------
    def _role(self, snap: dict[str, Any], key: str) -> dict[str, Any] | None:
        for role in snap["roles"]:
            if role_key(role) == key:
                return role
        return None

    def _role_stats(self, snap: dict[str, Any], key: str) -> dict[str, float] | None:
        role = self._role(snap, key)
        return None if role is None else role["stats"]

    def _role_window(
        self, key: str, now: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], float] | None:
        """(stats now, stats at the window's start, seconds between) for one role instance. A
        role restarted within the window counts from the first snapshot of its new process
        (its own counters start again from zero); a LOST role has none."""
        base = self._base(now, self.window_s)
        role = self._role(now, key)
        if base is None or role is None or not role["alive"]:
            return None
        start = None
        for snap in self.snaps:
            if snap["time"] < base["time"] or snap is now:
                continue
            earlier = self._role(snap, key)
            if earlier is not None and earlier["pid"] == role["pid"]:
                start = snap if start is None else start
            else:
                start = None  # another process: the window restarts after it
        if start is None or start is now:
            return None
        first = self._role(start, key)
        assert first is not None
        return role["stats"], first["stats"], now["time"] - start["time"]

    def role_rate(self, key: str, stat: str, now: dict[str, Any] | None = None) -> float:
        """Per second increase of one of a role's own counters over the window (since its
        restart when it restarted within it); 0 for a LOST role."""
        window = self._role_window(key, now or self.latest)
        if window is None:
            return 0.0
        new, old, dt = window
        delta = new.get(stat, 0.0) - old.get(stat, 0.0)
        return delta / dt if dt > 0 and delta >= 0 else 0.0

    def role_ratio(self, key: str, num: str, den: str) -> float | None:
        """Increase of ``num`` over increase of ``den`` in the window (None if ``den`` stood)."""
        window = self._role_window(key, self.latest)
        if window is None:
            return None
        new, old, _ = window
        d_den = new.get(den, 0.0) - old.get(den, 0.0)
        d_num = new.get(num, 0.0) - old.get(num, 0.0)
        return d_num / d_den if d_den > 0 and d_num >= 0 else None

    def roles(self, spark_points: int = 12) -> list[RoleFigures]:
        """Every role instance of the newest snapshot with its derived figures."""
        snap = self.latest
        trainer_version = _trainer_version(snap)
        out = []
        for role in snap["roles"]:
            key = role_key(role)
            counter, unit = headline_rate(role["role"])
            rate = self.role_rate(key, counter) if counter and role["alive"] else None
            spark = (
                sparkline(
                    self._history(
                        spark_points, lambda s, k=key, c=counter: self.role_rate(k, c, s)
                    ),
                    spark_points,
                )
                if counter
                else ""
            )
            out.append(
                RoleFigures(
                    key=key,
                    role=role["role"],
                    node=role["node"],
                    status=role_status(role),
                    restarts=int(role["restarts"]),
                    rate=rate,
                    unit=unit,
                    spark=spark,
                    detail=self._detail(role, trainer_version),
                )
            )
        return out

    def _detail(self, role: dict[str, Any], trainer_version: int | None) -> str:
        key, stats, kind = role_key(role), role["stats"], role["role"]
        parts: list[str] = []
        if kind in ("env_worker", "eval_env_worker"):
            wait = self.role_ratio(key, "action_wait_us", "action_requests")
            step = self.role_ratio(key, "env_step_us", "env_steps")
            if wait is not None:
                parts.append(f"action {wait / 1000:.1f}ms")
            if step is not None:
                parts.append(f"sim {step / 1000:.2f}ms")
        elif kind in ("rollout_server", "eval_rollout_server"):
            if "batch_fill" in stats:
                parts.append(f"fill {stats['batch_fill']:.0%}")
            if "queue_wait_ms" in stats:
                parts.append(f"wait {stats['queue_wait_ms']:.1f}ms")
            if "policy_version" in stats:
                version = int(stats["policy_version"])
                lag = "" if trainer_version is None else f" lag {max(0, trainer_version - version)}"
                parts.append(f"v{version}{lag}")
        elif kind == "trainer":
            updates = self.role_rate(key, "updates")
            parts.append(f"{updates:.1f} upd/s")
            if "policy_version" in stats:
                parts.append(f"v{int(stats['policy_version'])}")
        elif kind == "sft_trainer":
            if "steps" in stats:
                parts.append(f"step {int(stats['steps'])}")
            if "loss" in stats:
                parts.append(f"loss {stats['loss']:.3f}")
        elif kind == "weight_broadcaster":
            if "policy_version" in stats:
                parts.append(f"v{int(stats['policy_version'])}")
            if "links" in stats:
                parts.append(f"{int(stats['links'])} links")
            if "last_sync_ms" in stats:
                parts.append(f"sync {stats['last_sync_ms']:.0f}ms")
        return " ".join(parts)

    def latest_stat(self, key: str, stat: str) -> float | None:
        stats = self._role_stats(self.latest, key)
        return None if stats is None else stats.get(stat)

    def learning(self, points: int) -> tuple[list[float], list[float]]:
        """Mean return and (where reported) success rate of the recent training episodes, in
        ``points`` buckets, oldest first."""
        episodes = self.latest.get("recent_episodes") or []
        if not episodes:
            return [], []
        size = max(1, len(episodes) // points)
        buckets = [episodes[i : i + size] for i in range(0, len(episodes), size)][-points:]
        returns = [sum(e["return"] for e in b) / len(b) for b in buckets]
        if not any("success" in e for e in episodes):
            return returns, []
        return returns, [sum(bool(e.get("success")) for e in b) / len(b) for b in buckets]


def _trainer_version(snap: dict[str, Any]) -> int | None:
    """The newest version the run has: the trainers' (their gauges lag by a heartbeat) or the
    broadcast one, whichever is newer."""
    versions = [
        int(r["stats"]["policy_version"])
        for r in snap["roles"]
        if r["role"] == "trainer" and r["alive"] and "policy_version" in r["stats"]
    ]
    if not versions:
        return None
    return max(*versions, int(snap["weight_version"]))
