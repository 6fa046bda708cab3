"""A rehearsal cluster driven from Python (tests, ``bench/multi_node.py``): what
``launch/rehearsal/cluster.sh`` makes, network namespaces with their own addresses and,
optionally, a real Slurm.

Each cluster gets namespace and interface names of its own (``RLVLA3_CLUSTER_PREFIX``) and a
state dir of its caller's choosing; callers run ``down`` whatever happens, so no namespace,
daemon or job outlives them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO / "launch" / "rehearsal" / "cluster.sh"
SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "munged", "munge")


def unavailable(slurm: bool) -> str | None:
    """Why a rehearsal cluster cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"rlvprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns does not work here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None] if slurm else []
    if missing:
        return f"needs {' '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)"
    return None


class Cluster:
    """A cluster made by ``cluster.sh up`` (nodes ``node1``.. at ``NET.11``..)."""

    def __init__(self, state_dir: Path, *, slurm: bool, nodes: int = 3) -> None:
        self.prefix = f"rt{uuid.uuid4().hex[:4]}"  # interface names stay within 15 characters
        self.net = "10.77.0"
        self.nodes = nodes
        self.env = dict(
            os.environ,
            RLVLA3_CLUSTER_PREFIX=self.prefix,
            RLVLA3_CLUSTER_DIR=str(state_dir),
            RLVLA3_CLUSTER_NODES=str(nodes),
            RLVLA3_CLUSTER_NET=self.net,
        )
        self.env.pop("RLVLA3_RUN_SECRET", None)
        self.state_dir = state_dir
        self.slurm = slurm

    def address(self, i: int) -> str:
        """The address of node ``i`` (1-based)."""
        return f"{self.net}.{10 + i}"

    def up(self) -> None:
        """Make the namespaces (and start Slurm)."""
        self._sh("up", *([] if self.slurm else ["--no-slurm"]))

    def down(self) -> None:
        """Stop everything and remove the namespaces (safe to call twice)."""
        self._sh("down", check=False)

    def _sh(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        done = subprocess.run(
            [str(CLUSTER_SH), *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"cluster.sh {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def sbatch(self, *args: str) -> int:
        """Submit from the repository root; returns the job id."""
        out = subprocess.run(
            [str(CLUSTER_SH), "sbatch", "--parsable", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed: {out.stderr}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode...)."""
        out = self._sh("scontrol", "show", "job", "-o", str(job_id), check=False)
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def job_done(self, job_id: int) -> dict[str, str] | None:
        """The job's fields once it has ended, else None."""
        fields = self.job(job_id)
        ended = fields.get("JobState") in (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
        )
        return fields if ended else None

    def exec(
        self, node: int, *cmd: str, env: dict[str, str] | None = None, **popen: object
    ) -> subprocess.Popen:
        """Start ``cmd`` on node ``node`` (1-based) from the repository root, with ``env``
        added to the environment."""
        return subprocess.Popen(
            [str(CLUSTER_SH), "exec", f"node{node}", *cmd],
            env={**self.env, **(env or {})},
            cwd=REPO,
            **popen,
        )

    def run(self, node: int, *cmd: str, timeout: float = 60) -> str:
        """Run ``cmd`` on node ``node``; its stdout."""
        proc = self.exec(node, *cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} on node{node} failed ({proc.returncode}): {err}")
        return out

    def monitor(self, node: int, run_dir: Path) -> dict:
        """``rlvla3 monitor --json`` run on node ``node``."""
        return json.loads(
            self.run(
                node, sys.executable, "-m", "rlvla3.cli", "monitor", "--json", "--run", str(run_dir)
            )
        )

    def cut(self, node: int) -> None:
        """Take node ``node``'s link down (its processes go on, unreachable)."""
        self._sh("cut", f"node{node}")

    def heal(self, node: int) -> None:
        """Bring node ``node``'s link back up."""
        self._sh("heal", f"node{node}")

    def processes(self, node: int) -> list[str]:
        """``pid command`` of every process in node ``node``'s namespace."""
        pids = subprocess.run(
            ["ip", "netns", "pids", f"{self.prefix}-node{node}"], capture_output=True, text=True
        ).stdout.split()
        found = []
        for pid in pids:
            try:
                found.append(f"{pid} {Path(f'/proc/{pid}/comm').read_text().strip()}")
            except OSError:
                pass  # exited meanwhile
        return found
