"""The fault suite as a table: what was injected, what the system did, recovery time, losses.

Runs ``tests/test_faults.py`` (the README's main job with one fault injected about 5,000 env steps
in, per row) and prints one row per fault from what the tests measured (recovery: from the injection until
the victim's successor runs; solved after: the run's wall time until it reached its target); docs/reliability.md
shows this table.

    python bench/faults.py [--json PATH] [--smoke]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.launch_run import REPO
from harness.provenance import write_result
from harness.report import Table, benchmark_parser

TABLE = Table.from_layout("fault:<58 | recovery:>9 | solved after:>12 | lost:<44 | solved:>6")


def main() -> None:
    parser = benchmark_parser(__doc__, smoke_help="one fault (kill -9 env worker)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlvla3-bench-faults-") as tmp:
        report = Path(tmp) / "rows.jsonl"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "slow", "tests/test_faults.py"]
        if args.smoke:
            cmd += ["-k", "kill and env and worker"]
        env = dict(os.environ, RLVLA3_FAULT_REPORT=str(report))
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        rows = (
            [json.loads(line) for line in report.read_text().splitlines()]
            if report.exists()
            else []
        )
    TABLE.print(
        (r["fault"], f"{r['recovery_s']:.2f}s", f"{r['wall_s']:.1f}s", r["lost"], r["solved"])
        for r in rows
    )
    write_result(args.json, "faults", {"rows": rows}, vars(args))
    if done.returncode != 0:
        print(done.stdout[-3000:])
        sys.exit(done.returncode)


if __name__ == "__main__":
    main()
