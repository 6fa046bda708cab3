"""A stand-in role process for tests/test_hardening.py: takes the run secret the way a role
does and reports, into ``RUN_DIR/probe.json``, where it can still be found (its environment,
``/proc/self/environ``, a process it starts, as a simulator would)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from rlvla3.runtime import run_secret

_CHILD = "import os, sys; sys.stdout.write(os.environ.get('RLVLA3_RUN_SECRET', ''))"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--secret-fd", type=int, default=None)
    args, _ = parser.parse_known_args()
    secret = run_secret.take(args.secret_fd) or ""
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True)
    with open("/proc/self/environ", "rb") as environ:
        in_proc_environ = bool(secret) and secret.encode() in environ.read()
    with open("/proc/self/cmdline", "rb") as cmdline:
        in_cmdline = bool(secret) and secret.encode() in cmdline.read()
    report = {
        "secret_sha256": hashlib.sha256(secret.encode()).hexdigest(),
        "in_os_environ": run_secret.SECRET_ENV in os.environ,
        "in_proc_environ": in_proc_environ,
        "in_cmdline": in_cmdline,
        "child_sees": child.stdout,
        "secret_fd_still_open": args.secret_fd is not None
        and os.path.exists(f"/proc/self/fd/{args.secret_fd}"),
    }
    Path(args.run_dir, "probe.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
