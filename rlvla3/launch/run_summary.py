"""``summary.json``: what a run reached, written by the head's launcher when the run ends.

``RunSummary`` is the file's one shape and ``RunSummary.write`` its one writer. ``write_report``
measures the run from its Redis (and draws ``learning_curve.png``); ``unmeasured_summary`` is
what is known when that Redis is gone: the file then says ``"complete": false``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlvla3.config.run_config import Config
from rlvla3.launch.learning_curve import plot_learning_curve
from rlvla3.launch.stop_reason import StopReason
from rlvla3.launch.stop_rules import evaluation_episodes, meets_target
from rlvla3.runtime.chunk_ledger import balance
from rlvla3.runtime.registry import Registry

_EVALUATION_KEYS = ("version", "env_steps", "episodes", "success_rate", "mean_return")
# Measures that only some runs have: the key is left out of summary.json, not written as null.
_LEFT_OUT_WHEN_NONE = frozenset({"success_rate", "evaluation", "final_loss", "evaluations"})


@dataclass(frozen=True, slots=True, kw_only=True)
class RunMeasures:
    """What the run's Redis held at its end (counters and curves live there)."""

    env_steps: int
    """Env steps of the whole run."""
    final_mean_return: float | None
    """Mean return of the newest ``run.stop.return_window`` episodes, None before any."""
    episodes: int
    """Episodes finished."""
    weight_version: int
    """The newest weight version the rollout servers were given."""
    counters: dict[str, int]
    """Every run counter (``rlvla3/runtime/metric_names.py``)."""
    finished_at: float
    """When the summary was measured, Unix time in seconds."""
    success_rate: float | None
    """Success rate of the end-of-run evaluation when it measured one, else of the newest
    ``run.stop.return_window`` episodes; None (left out) where the env reports no success."""
    evaluation: dict[str, Any] | None
    """The end-of-run evaluation (``version``, ``episodes``, ``mean_return``, ``success_rate``);
    None (left out) when none ran."""
    chunk_accounting: dict[str, Any]
    """Where every chunk went (``rlvla3/runtime/chunk_ledger.py``), ``balanced`` included."""
    chunks_lost: int
    """Chunks a node, a killed worker's queue or a killed trainer took with it."""
    roles: list[dict[str, Any]]
    """Every role instance: ``role``, ``index``, ``node``, ``host``, ``status``, ``restarts``,
    ``stats``."""
    nodes: list[dict[str, Any]]
    """Every node's launcher: ``node``, ``address``, ``hostname``, ``status``."""
    final_loss: float | None
    """The newest training loss; None (left out) when no metrics carry one."""
    evaluations: list[dict[str, Any]] | None
    """The periodic evaluations (``version``, ``env_steps``, ``episodes``, ``success_rate``,
    ``mean_return``); None (left out) when none ran."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSummary:
    """The content of ``summary.json``."""

    run_id: str
    """``run.name``."""
    mode: str
    """``run.mode``."""
    stop_reason: str
    """Why the run ended, as the launcher printed it."""
    solved: bool
    """A target of ``run.stop`` reached: by the stop rule that ended the run, over a full window
    of the newest episodes, or (deciding when one ran) by the end-of-run evaluation."""
    wall_s: float
    """Seconds from the roles' start to the end of the run."""
    measures: RunMeasures | None
    """What the run's Redis held; None when it was gone (``"complete": false`` in the file)."""

    def as_json(self) -> dict[str, Any]:
        """The dict ``summary.json`` holds."""
        out: dict[str, Any] = {
            "run_id": self.run_id,
            "mode": self.mode,
            "stop_reason": self.stop_reason,
            "solved": self.solved,
            "wall_s": self.wall_s,
        }
        if self.measures is None:
            out["complete"] = False
            return out
        for field in dataclasses.fields(RunMeasures):
            value = getattr(self.measures, field.name)
            if value is not None or field.name not in _LEFT_OUT_WHEN_NONE:
                out[field.name] = value
        return out

    def write(self, run_dir: Path) -> None:
        """Write ``run_dir/summary.json``."""
        (run_dir / "summary.json").write_text(json.dumps(self.as_json(), indent=2) + "\n")


def unmeasured_summary(cfg: Config, wall_s: float, reason: StopReason) -> RunSummary:
    """The summary when the run's Redis is gone: not solved, as far as anyone can tell."""
    return RunSummary(
        run_id=cfg.run.name,
        mode=cfg.run.mode,
        stop_reason=reason.text,
        solved=False,
        wall_s=round(wall_s, 2),
        measures=None,
    )


def write_report(
    registry: Registry, cfg: Config, run_dir: Path, wall_s: float, reason: StopReason
) -> RunSummary:
    """Write ``summary.json`` (and a learning-curve PNG when episodes exist); return the summary."""
    episodes = registry.series("episodes")
    evaluations = registry.series("evaluations")
    summary = measured_summary(registry, cfg, wall_s, reason, episodes, evaluations)
    summary.write(run_dir)
    if episodes:
        window = cfg.run.stop.return_window
        plot_learning_curve(episodes, run_dir / "learning_curve.png", window, evaluations)
    return summary


def measured_summary(
    registry: Registry,
    cfg: Config,
    wall_s: float,
    reason: StopReason,
    episodes: list[dict[str, Any]],
    evaluations: list[dict[str, Any]],
) -> RunSummary:
    """The summary from the run's Redis (``episodes`` and ``evaluations``: its series)."""
    counters = registry.counters()
    recent = episodes[-cfg.run.stop.return_window :]
    final_mean = sum(e["return"] for e in recent) / len(recent) if recent else None
    evaluation = evaluation_summary(registry)
    solved, success_rate = _verdict(cfg.run.stop, reason, recent, final_mean, evaluation)
    # Where every chunk went, exact across crashes (rlvla3/runtime/chunk_ledger.py): lost are
    # those a node, a killed worker's queue or a killed trainer took with it.
    chunks = balance(registry.chunk_ledger(), counters)
    last_metrics = registry.series("metrics", last=1)
    measures = RunMeasures(
        env_steps=counters.get("env_steps", 0),
        final_mean_return=final_mean,
        episodes=len(episodes),
        weight_version=registry.weight_version(),
        counters=counters,
        finished_at=time.time(),
        success_rate=success_rate,
        evaluation=evaluation,
        chunk_accounting=chunks.as_dict(),
        chunks_lost=chunks.lost,
        roles=_roles(registry),
        nodes=[
            {"node": n.node, "address": n.address, "hostname": n.hostname, "status": n.status}
            for n in registry.launchers()
        ],
        final_loss=last_metrics[-1].get("loss") if last_metrics else None,
        evaluations=[{k: e[k] for k in _EVALUATION_KEYS if k in e} for e in evaluations] or None,
    )
    unmeasured = unmeasured_summary(cfg, wall_s, reason)
    return dataclasses.replace(
        unmeasured, solved=solved, wall_s=round(wall_s, 3), measures=measures
    )


def _verdict(
    stop: Any,
    reason: StopReason,
    recent: list[dict[str, Any]],
    final_mean: float | None,
    evaluation: dict[str, Any] | None,
) -> tuple[bool, float | None]:
    """Whether the run is solved, and its success rate (None where the env reports none)."""
    success_rate = (
        sum(bool(e.get("success")) for e in recent) / len(recent)
        if recent and "success" in recent[-1]
        else None
    )
    # Either target reached over a full window of the last episodes (what stops the run).
    # The stop rule's verdict stands: episodes that finish while the roles are stopping
    # come after it and must not undo it.
    full_window = len(recent) >= stop.return_window
    solved = reason.solved or (full_window and meets_target(stop, final_mean, success_rate))
    if evaluation is not None and evaluation["episodes"]:
        # Measured on fresh episodes of the final weights: it decides, over all of them (the
        # last-window rule would judge only the last return_window of them).
        success_rate = evaluation.get("success_rate", success_rate)
        solved = meets_target(stop, evaluation["mean_return"], evaluation.get("success_rate"))
    return solved, success_rate


def _roles(registry: Registry) -> list[dict[str, Any]]:
    return [
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
