"""Benchmarks in their smoke mode: a broken benchmark fails here, not on the day it is run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.launching import REPO


@pytest.mark.parametrize(
    ("script", "check"),
    [
        ("bench/transport.py", lambda r: all(r[k]["curve_msgs_per_s"] > 0 for k in ("small", "obs"))),
        ("bench/multi_node.py", lambda r: r["one_host"]["trials"] == 1
         and ("three_nodes" in r or "three_nodes_skipped" in r)),
    ],
)  # fmt: skip
def test_benchmark_smoke_mode_runs_and_writes_its_json(tmp_path, script: str, check) -> None:
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, script, "--smoke", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert check(json.loads(out.read_text())), out.read_text()
