"""Can an env be built and stepped here? Asked of a child process, so the answer is safe to get.

The optional simulators fail in ways that can take the asking process down: LIBERO prompts on
stdin without its config, a broken MuJoCo GL or Vulkan driver can hang or crash the interpreter.
So the env is made, reset and stepped once in ``python -m sim.env_probe ENV_ID KWARGS_JSON``
(stdin closed, killed after a timeout), and the caller gets None or the reason in one line.
Benchmarks and tests that need a simulator ask this before they start one.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

from sim.adapter import SimulatorNotInstalledError

PROBE_OK = "ENV_PROBE_OK"
"""What the child prints once the env stepped."""
NOT_INSTALLED_RC = 3
"""The child's exit status when the env's simulator package is not installed."""


@functools.cache
def env_unavailable(env_id: str, kwargs_json: str = "{}", timeout_s: float = 180.0) -> str | None:
    """None if ``make_env(env_id, **kwargs)`` builds, resets and steps here, else why not: "not
    installed" with the extra to install, or the child's last error line. ``kwargs_json`` is the kwargs as JSON (hashable, so the answer is
    cached per process)."""
    cmd = [sys.executable, "-m", "sim.env_probe", env_id, kwargs_json]
    try:
        proc = subprocess.run(
            cmd,
            cwd=Path(__file__).resolve().parent.parent,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return f"{env_id}: building and stepping one env took over {timeout_s:.0f}s"
    if proc.returncode == 0 and PROBE_OK in proc.stdout:
        return None
    if proc.returncode == NOT_INSTALLED_RC:
        return f"{env_id}: not installed ({proc.stderr.strip()})"
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()] or ["(no output)"]
    errors = [line for line in lines if "Error:" in line or "Exception:" in line]
    return f"{env_id}: {(errors or lines)[-1]}"


def _child(env_id: str, kwargs_json: str) -> None:
    from sim.envs import make_env  # the simulator's imports happen here, in the child

    try:
        env = make_env(env_id, seed=0, **json.loads(kwargs_json))
    except SimulatorNotInstalledError as err:
        print(err, file=sys.stderr)
        sys.exit(NOT_INSTALLED_RC)
    try:
        env.reset(seed=0)
        env.step(env.action_space.sample())
    finally:
        env.close()
    print(PROBE_OK, flush=True)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "{}")
