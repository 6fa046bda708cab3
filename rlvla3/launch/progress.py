"""The progress lines a launcher prints every ``run.progress_interval_s``: the head's line about
the whole run (``ProgressTracker``), another node's line about its own roles and the head
(``member_line``)."""

from __future__ import annotations

from rlvla3.config.run_config import Config
from rlvla3.launch.stop_rules import mean_recent
from rlvla3.runtime.registry import Registry

_NO_PROGRESS_S = 20.0  # the progress line flags a run whose env steps and weights stand still
_FLAGGED_COUNTERS = (
    "bad_frames",
    "bad_chunks",
    "bad_requests",
    "bad_replies",
    "weights_rejected",
    "auth_refused",
)


class ProgressTracker:
    """The head launcher's progress line. Rates are over the time since the previous line, not
    the average since the start (a run that stopped moving shows 0/s at once), roles whose
    heartbeat expired are named, and a run whose env steps and weight version stand still says
    so instead of only counting live roles."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        # (elapsed_s, env steps, version, SFT samples) at the previous line
        self._last: tuple[float, int, int, int] | None = None
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
        # an SFT run whose live evaluation waits for the next version still moves: it trains
        sft_samples = counters.get("sft_samples", 0)
        prev_s, prev_steps, prev_version, prev_sft = self._last or (0.0, 0, -1, 0)
        rate = (steps - prev_steps) / max(elapsed_s - prev_s, 1e-9)
        moved = (steps, version, sft_samples) != (prev_steps, prev_version, prev_sft)
        if self._last is None or moved:
            self._moved_at = elapsed_s
        updates = counters.get("updates", 0)
        if self._last is None or updates != self._updates:
            self._learned_at, self._updates = elapsed_s, updates
        self._last = (elapsed_s, steps, version, sft_samples)
        mean = mean_recent(registry, "return", min(self.cfg.run.stop.return_window, 20))
        roles = registry.roles()
        expected = max(len(roles), self.cfg.total_processes())
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
        parts += [f"{c}={counters[c]}" for c in _FLAGGED_COUNTERS if counters.get(c)]
        standstill = self._standstill(elapsed_s, version, counters.get("chunks_dropped", 0))
        if standstill:
            parts.append(standstill)
        return " ".join(parts)

    def _standstill(self, elapsed_s: float, version: int, chunks_dropped: int) -> str | None:
        """The warning for a run that stopped moving (or stopped learning), None while it moves."""
        still_s = elapsed_s - self._moved_at
        if still_s >= _NO_PROGRESS_S:
            what = (
                "no weights have reached the rollout servers"
                if version < 0
                else "env steps, SFT samples and weight version have not moved"
            )
            return f"NO PROGRESS for {still_s:.0f}s: {what}"
        if self._learns and elapsed_s - self._learned_at >= _NO_PROGRESS_S:
            return (
                f"NO LEARNING for {elapsed_s - self._learned_at:.0f}s: env steps go on but no "
                f"trainer update ran (chunks_dropped={chunks_dropped}; see the trainer's log)"
            )
        return None


def member_line(
    elapsed_s: float,
    node: str,
    running: int,
    started: int,
    restarts: int,
    head: str,
    head_unreachable_s: float | None,
) -> str:
    """Another node's line: its roles running, their restarts, whether the head is reachable
    (``head_unreachable_s`` None: it is)."""
    reach = (
        "reachable" if head_unreachable_s is None else f"unreachable for {head_unreachable_s:.0f}s"
    )
    return (
        f"[{elapsed_s:5.0f}s] node {node}: {running}/{started} roles running, "
        f"restarts={restarts}, head {head} {reach}"
    )
