"""Role processes of one node: start them, see them exit, stop them in order.

Processes start with ``Popen([sys.executable, "-m", <the role's module>, ...])``, never a shell, each
in its own session (the terminal's Ctrl-C reaches the launcher only, which decides how they
stop) with its own log file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlvla3.config.role_table import STOP_ORDER, role_spec
from rlvla3.runtime import run_secret
from rlvla3.runtime.role_keys import keys_for

_TICK_S = 0.2
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(slots=True)
class RoleProcess:
    """One supervised role instance."""

    role: str
    index: int
    node: str
    log_path: Path
    device: str | None = None
    """Where it runs (``Config.device_plan``), handed over as ``--device``; None: a role
    without a ``device`` setting."""
    popen: subprocess.Popen | None = None
    restarts: int = 0
    restart_at: float | None = None
    finished: bool = False
    failed: bool = False

    @property
    def name(self) -> str:
        """``role/index``."""
        return f"{self.role}/{self.index}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SpawnContext:
    """What every role process of this node is started with.

    Attributes:
        config_path: the run's ``config.yaml``.
        run_dir: the run dir (logs, checkpoints, ``run.json``).
        address: the node address roles bind and advertise.
        secret: the run secret (multi-host runs), None on one host: each role is handed only
            the keys derived from it that its role needs (``rlvla3/runtime/role_keys.py``).
        nccl_interface: the interface NCCL's bootstrap should use (``NCCL_SOCKET_IFNAME``).
        nccl_host_ids: give each role process its own ``NCCL_HOSTID`` (``run.nccl_shared_gpu``).
    """

    config_path: Path
    run_dir: Path
    address: str
    secret: str | None = None
    nccl_interface: str | None = None
    nccl_host_ids: bool = False


def spawn(proc: RoleProcess, ctx: SpawnContext) -> None:
    """Start (or restart) ``proc``; its output is appended to its log."""
    args = [
        sys.executable,
        "-m",
        role_spec(proc.role).module,
        "--config",
        str(ctx.config_path),
        "--index",
        str(proc.index),
        "--node",
        proc.node,
        "--run-dir",
        str(ctx.run_dir),
        "--address",
        ctx.address,
    ]
    if proc.device is not None:
        args += ["--device", proc.device]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # numpy's OpenBLAS starts a thread per core, and its threads spin between the small matrix
    # products a role does (a rollout server's numpy policy path): on a 2-core machine that
    # took a third of a core from the env workers. Roles size torch's threads themselves.
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    # Never the secret, only the role's keys; never in the environment (a role's simulators
    # would inherit it, and /proc/PID/environ shows it for the process's life) nor on a
    # command line: a pipe the role reads at start.
    env.pop(run_secret.SECRET_ENV, None)
    secret_fd = None
    if ctx.secret is not None:
        secret_fd = run_secret.hand_over(
            keys_for(proc.role, ctx.secret, index=proc.index).to_text()
        )
    if secret_fd is not None:
        args += ["--secret-fd", str(secret_fd)]
    if ctx.nccl_interface and "NCCL_SOCKET_IFNAME" not in env:
        env["NCCL_SOCKET_IFNAME"] = ctx.nccl_interface
    if ctx.nccl_host_ids and "NCCL_HOSTID" not in env:
        # NCCL refuses two ranks on one GPU of one host; distinct host ids make it link them
        # over sockets (transport/weights.py decides per link).
        env["NCCL_HOSTID"] = f"rlvla3-{proc.node}-{proc.role}-{proc.index}"
    try:
        with open(proc.log_path, "ab") as log:
            proc.popen = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                pass_fds=() if secret_fd is None else (secret_fd,),
            )
    finally:
        if secret_fd is not None:
            os.close(secret_fd)
    proc.restart_at = None


def dump_stacks(pid: int, log_path: Path, give_up: threading.Event, timeout_s: float = 3.0) -> str:
    """Have role process ``pid`` write every thread's stack to its log (SIGUSR1, which roles
    hand to ``faulthandler``); returns where to look, for the launcher's message."""
    if _process_state(pid) in ("T", "t"):  # SIGSTOP, a debugger: it cannot answer
        return "the process is stopped (SIGSTOP or a debugger), so no stack"
    start = log_path.stat().st_size if log_path.exists() else 0
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log_path, "rb") as log:
            log.seek(start)
            if b"most recent call first" in log.read():
                return f"every thread's stack is in {log_path}"
        if give_up.wait(0.05):
            break
    return f"it wrote no stack within {timeout_s:.0f}s"


def _process_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` (``R``, ``S``, ``T``...; ``?`` if unknown)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rpartition(")")[2].split()[0]


def running(procs: list[RoleProcess]) -> list[RoleProcess]:
    """The processes that have not exited."""
    return [p for p in procs if p.popen is not None and p.popen.poll() is None]


def stop_group(
    group: list[subprocess.Popen],
    timeout_s: float,
    kill_now: threading.Event,
    on_tick: Callable[[], None] = lambda: None,
) -> None:
    """SIGTERM every process of ``group``, wait up to ``timeout_s`` (or until ``kill_now``),
    then SIGKILL what is left. ``on_tick`` runs while waiting (the launcher's heartbeat)."""
    for popen in group:
        with contextlib.suppress(ProcessLookupError):
            popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for popen in group:
        while popen.poll() is None and time.monotonic() < deadline:
            if kill_now.is_set():
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=_TICK_S)
            on_tick()
        if popen.poll() is None:
            popen.kill()
            popen.wait()


def stop_stages(procs: list[RoleProcess]) -> list[tuple[str, list[subprocess.Popen]]]:
    """The running processes grouped by role, in ``STOP_ORDER``."""
    stages: dict[str, list[subprocess.Popen]] = {}
    for p in sorted(running(procs), key=lambda p: STOP_ORDER.index(p.role)):
        stages.setdefault(p.role, []).append(p.popen)
    return list(stages.items())
