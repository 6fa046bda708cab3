"""A stand-in role process for tests/test_hardening.py: takes its keys the way a role does and
reports, into ``RUN_DIR/probe.json``, what it was handed and what can be read where a secret
must not be (its environment, ``/proc/self/environ``, its command line, a process it starts,
as a simulator would), for the test to search for the secret and every key derived from it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from rlvla3.runtime import role_keys

_CHILD = "import os, sys; sys.stdout.write(repr(dict(os.environ)))"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--secret-fd", type=int, default=None)
    args, _ = parser.parse_known_args()
    keys = role_keys.take(args.secret_fd, "env_worker", 0)
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True)
    report = {
        "bundle": None if keys is None else keys.to_text(),
        "keys": [] if keys is None else sorted(keys.names()),
        "os_environ": repr(dict(os.environ)),
        "proc_environ": Path("/proc/self/environ").read_bytes().decode(errors="replace"),
        "cmdline": Path("/proc/self/cmdline").read_bytes().decode(errors="replace"),
        "child_environ": child.stdout,
        "secret_fd_still_open": args.secret_fd is not None
        and os.path.exists(f"/proc/self/fd/{args.secret_fd}"),
    }
    Path(args.run_dir, "probe.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
