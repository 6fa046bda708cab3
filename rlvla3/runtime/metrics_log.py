"""Training metrics: one JSON line per update in the run dir, TensorBoard events, and Redis."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlvla3.runtime.registry import Registry


class MetricsLog:
    """Appends metric points to ``metrics.jsonl``, ``tb/`` (if tensorboard is installed), Redis."""

    def __init__(
        self, run_dir: Path, registry: Registry, prefix: str, series: str = "metrics"
    ) -> None:
        """``prefix``: the TensorBoard tag prefix; ``series``: the Redis series the points go
        to (``metrics``, or ``evaluations`` for periodic evaluation)."""
        self.file = open(run_dir / "metrics.jsonl", "a")
        self.registry = registry
        self.prefix = prefix
        self.series = series
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # JSONL and Redis still record everything
            self.tb = None
        else:
            self.tb = SummaryWriter(str(run_dir / "tb"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one point; numeric values also go to TensorBoard under ``prefix/``."""
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        self.registry.append(self.series, [metrics])
        if self.tb is not None:
            for key, value in metrics.items():
                if key != "t" and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{self.prefix}/{key}", value, step)

    def close(self) -> None:
        """Flush and close the files."""
        self.file.close()
        if self.tb is not None:
            self.tb.close()
