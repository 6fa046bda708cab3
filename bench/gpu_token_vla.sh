#!/usr/bin/env bash
# The token VLA's GPU checks in one command, for a CUDA machine lent for minutes (about 6 on an
# H200, the 0.5B preset's writing and loading included): the real-size benchmark
# (bench/token_vla_scale.py, issue 32 item 8; the most wanted figure, so first), then the token
# VLA's GPU tests (tests/test_token_vla_gpu.py: bfloat16 log-prob gaps, a PPO update, the
# memory refusal). Logs and JSON land in OUTDIR: token_vla_scale.{json,log}, the f phase's run
# logs as f_logs.tgz, pytest_token_vla_gpu.txt, environment.txt.
#
#   bench/gpu_token_vla.sh OUTDIR [more bench/token_vla_scale.py options]
#
# On a machine without this project installed, put its runtime wheels on PYTHONPATH first
# (docs/benchmarks.md, GPU paths).
set -uo pipefail
mkdir -p "${1:?usage: bench/gpu_token_vla.sh OUTDIR [bench/token_vla_scale.py options]}"
out=$(cd "$1" && pwd)  # absolute: the steps below change directory
shift
cd "$(dirname "$0")/.."
runs=/tmp/token_vla_scale_runs  # the f phase's runs (--run-dir), their logs returned cut
rm -rf "$runs" /tmp/f_logs
export PYTHONUNBUFFERED=1
status=0
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
    python -c 'import sys, torch, transformers, peft
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers",
      transformers.__version__, "peft", peft.__version__, "gpu", torch.cuda.get_device_name(0))'
    nproc
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt"

# 450 + 90 s: inside a lent machine's 10-minute command
timeout --kill-after=10 450 python bench/token_vla_scale.py --json "$out/token_vla_scale.json" \
    --run-dir "$runs" "$@" 2>&1 | grep --line-buffered -v 'it/s]' \
    | tee "$out/token_vla_scale.log"
rc=$?
echo "== token_vla_scale: rc=$rc"
[ "$rc" -eq 0 ] || status=1
# the f phase's logs, each cut to its last 64 kB (whole, they outgrow what a lent machine
# returns), without the runs' checkpoints
(cd "$(dirname "$runs")" && find "$(basename "$runs")" -name '*.log' -o -name '*.yaml' |
    while read -r f; do
        mkdir -p "f_logs/$(dirname "$f")" && tail -c 65536 "$f" > "f_logs/$f"
    done && tar czf "$out/f_logs.tgz" f_logs) 2>/dev/null

timeout --kill-after=10 90 python -m pytest -m gpu tests/test_token_vla_gpu.py -q -rs -s \
    > "$out/pytest_token_vla_gpu.txt" 2>&1
rc=$?
grep -E 'gap|passed|failed|error|Error' "$out/pytest_token_vla_gpu.txt" | tail -n 30
echo "== pytest_token_vla_gpu: rc=$rc"
[ "$rc" -eq 0 ] || status=1
exit $status
