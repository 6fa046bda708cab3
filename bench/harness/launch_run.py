"""Run ``rlvla3 launch`` as a subprocess and read what it leaves: ``summary.json``.

The whole-system benchmarks (``bench/main_job.py``, ``bench/redis_fsync.py``,
``bench/stale_drops.py``, ``bench/multi_node.py``) time complete runs this way; the run
sampler (``run_sampler.py``) starts its live runs with the same command line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
"""The repository root: runs start here, so the launch YAMLs' relative paths resolve."""


def launch_command(
    config: str | Path, out: Path, overrides: Mapping[str, Any] | None = None
) -> list[str]:
    """``python -m rlvla3.cli launch CONFIG --out OUT``, one ``--set KEY=VALUE`` per override."""
    cmd = [sys.executable, "-m", "rlvla3.cli", "launch", str(config), "--out", str(out)]
    for key, value in (overrides or {}).items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The ``summary.json`` a finished run wrote into ``run_dir``."""
    return json.loads((run_dir / "summary.json").read_text())


def launch_and_read(
    config: str | Path,
    out: Path,
    overrides: Mapping[str, Any] | None = None,
    *,
    extra: Sequence[str] = (),
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Launch ``config`` into ``out`` (with ``overrides`` as ``--set`` and ``extra`` arguments
    after them), wait for it to end, and return its summary; a failed run raises
    ``RuntimeError`` with the end of its output."""
    cmd = [*launch_command(config, out, overrides), *extra]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return read_summary(out)
