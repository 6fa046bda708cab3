"""Where a figure came from: every ``bench/`` script writes its JSON through ``write_result``.

The file holds ``benchmark`` (the script), ``provenance`` (the commit and whether the tree had
uncommitted changes, the UTC time, the machine: CPU model and count, load averages, Python and
library versions), ``settings`` (the script's arguments) and ``results``. A figure in the docs
links to such a file under ``bench/results/``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
_LIBRARIES = ("torch", "numpy", "pyzmq", "msgspec", "redis", "gymnasium", "mani-skill", "libero")


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> dict[str, str]:
    found = {}
    for name in _LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    try:
        import zmq

        found["libzmq"] = zmq.zmq_version()
    except ImportError:
        pass
    return found


def stamp() -> dict[str, Any]:
    """The provenance of a figure measured now, here."""
    return {
        "commit": _git("rev-parse", "HEAD") or None,
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "libraries": _versions(),
    }


def write_result(
    path: Path | str | None, benchmark: str, results: dict[str, Any], settings: dict[str, Any]
) -> None:
    """Write a benchmark's ``results`` to ``path`` (nothing when None), stamped (see module)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": benchmark,
        "provenance": stamp(),
        "settings": {k: v for k, v in settings.items() if k != "json"},
        "results": results,
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
