#!/usr/bin/env bash
# Every GPU check and GPU figure of docs/benchmarks.md ("GPU paths") in one command, for a CUDA
# machine: the GPU tests, packed vs padded training (4 model sizes, bf16 and FP8), padded SDPA
# backends, and the weight broadcast. Logs and JSON land in OUTDIR; nothing else is written.
#
#   bench/gpu_suite.sh OUTDIR
set -uo pipefail
out=${1:?usage: bench/gpu_suite.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
status=0

python - > "$out/environment.txt" 2>&1 <<'PY'
import importlib, torch
from rlvla3.policy.attention import backend_name
from sft.precision import fp8_backends
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0))
for name in ("flash_attn", "transformer_engine.pytorch"):
    try:
        importlib.import_module(name)
        print(name, "imports")
    except Exception as err:  # not installed, or built for another torch
        print(name, "missing:", type(err).__name__, err)
print("packed attention backend:", backend_name("cuda"))
print("FP8 backends:", fp8_backends(torch.device("cuda")))
PY
cat "$out/environment.txt"

python -m pytest -m gpu tests/test_gpu.py tests/test_precision.py tests/test_attention.py -q \
    2>&1 | tee "$out/pytest_gpu.log" || status=1

# name: model flags (the first is the issue's CPU shape)
shapes=(
    "default:--batch 8 --d-model 256 --layers 4 --heads 4"
    "d1024:--batch 32 --d-model 1024 --layers 8 --heads 8"
    "d2048:--batch 64 --d-model 2048 --layers 4 --heads 16"
    "d4096:--batch 64 --d-model 4096 --layers 2 --heads 32"
)
for entry in "${shapes[@]}"; do
    name=${entry%%:*}
    # shellcheck disable=SC2086  # the flags are meant to split
    python -m bench.packing --device cuda --steps 10 --fp8 ${entry#*:} \
        --json "$out/packing_$name.json" 2>&1 | tee "$out/packing_$name.log" || status=1
done

python bench/sdpa_backends.py --json "$out/sdpa_backends.json" 2>&1 \
    | tee "$out/sdpa_backends.log" || status=1
python bench/weight_sync.py --json "$out/weight_sync.json" 2>&1 \
    | tee "$out/weight_sync.log" || status=1
exit $status
