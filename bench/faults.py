"""The fault suite as a table: what was injected, what the system did, recovery time, losses.

Runs ``tests/test_faults.py`` (the README's main job with one fault injected about 5,000 env steps
in, per row) and prints one row per fault from what the tests measured; docs/reliability.md
shows this table.

    python bench/faults.py [--json PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.provenance import write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="one fault (kill -9 env worker)")
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
    print(f"{'fault':58} {'recovery':>9}  {'lost':44} {'solved':>6}")
    for r in rows:
        print(f"{r['fault']:58} {r['recovery_s']:8.2f}s  {r['lost']:44} {str(r['solved']):>6}")
    write_result(args.json, "faults", {"rows": rows}, vars(args))
    if done.returncode != 0:
        print(done.stdout[-3000:])
        sys.exit(done.returncode)


if __name__ == "__main__":
    main()
