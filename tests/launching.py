"""Helpers for tests that start the real launcher as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def write_yaml(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_launcher(config: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    """``rlvla3 launch CONFIG --out RUN_DIR``; its output goes to RUN_DIR-launcher.log."""
    log = open(run_dir.parent / f"{run_dir.name}-launcher.log", "wb")
    cmd = [sys.executable, "-m", "rlvla3.cli", "launch", str(config), "--out", str(run_dir), *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def launcher_output(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}-launcher.log").read_text(errors="replace")


def monitor_json(run_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "rlvla3.cli", "monitor", "--json", "--run", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=REPO,
    )
    return json.loads(out.stdout)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
