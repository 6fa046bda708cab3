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
    """True once ``pid`` has exited (a zombie counts: its parent may not have reaped it yet)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):  # reaped, possibly between the two calls
        return True
    return "Z" in stat.split()[2]


def write_checkpoint_run(run_dir: Path, cfg: dict) -> Path:
    """A run dir holding ``cfg`` as its ``config.yaml`` and one checkpoint of its policy,
    randomly initialised (torch seed 0); returns the checkpoint."""
    import torch

    from rlvla3.config.run_config import load_config
    from rlvla3.policy.factory import build_policy, env_spaces
    from rlvla3.runtime.checkpoints import model_state, save_checkpoint

    run_dir.mkdir(parents=True)
    loaded = load_config(write_yaml(run_dir / "config.yaml", cfg))
    torch.manual_seed(0)
    policy = build_policy(loaded, env_spaces(loaded))
    return save_checkpoint(run_dir / "checkpoints", 1, {"model": model_state(policy)}, keep=1)


def eval_command(source: Path, out: Path, *extra: str) -> list[str]:
    """``rlvla3 eval SOURCE --out OUT ...``."""
    return [sys.executable, "-m", "rlvla3.cli", "eval", str(source), "--out", str(out), *extra]


def run_eval(source: Path, out: Path, *extra: str, timeout_s: float = 240) -> str:
    """Run ``rlvla3 eval`` to its end; fail unless it exits 0. Returns what it printed."""
    done = subprocess.run(
        eval_command(source, out, *extra),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


TINY_TABLETOP_VLA = {
    "env": {"id": "rlvla3/TableTopEasy-v0", "num_envs_per_worker": 1},
    "policy": {
        "kind": "vla",
        "vla": {"d_model": 32, "num_layers": 1, "num_heads": 2, "num_bins": 16},
    },
}
"""The ``env`` and ``policy`` sections of a run that trains a tiny VLA on the easy table-top
task: small enough for a test's seconds."""
