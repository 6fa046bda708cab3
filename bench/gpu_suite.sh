#!/usr/bin/env bash
# Every GPU check and GPU figure of docs/benchmarks.md ("GPU paths") in one command, for a CUDA
# machine: the GPU tests, the NCCL weight sync, the token VLA at 0.5B parameters
# (bench/token_vla_scale.py), packed vs padded training (model sizes x every
# FlashAttention varlen kernel that loads, bf16 and FP8), and the padded SDPA backends. Logs and
# JSON land in OUTDIR; nothing else is written. Each step has a time limit (STEP_S, seconds) so
# one stuck step cannot take the others' time; the most wanted figures come first.
#
#   bench/gpu_suite.sh OUTDIR [STEP_S]
#
# GPU_SUITE_QUICK=1 runs the environment, the tests and the weight sync alone (about 2 minutes).
# On a machine lent for minutes, the token VLA's benchmark and GPU tests alone (about 6 minutes):
#   bench/gpu_token_vla.sh OUTDIR
set -uo pipefail
out=${1:?usage: bench/gpu_suite.sh OUTDIR [STEP_S]}
step_s=${2:-240}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0

step() {  # step NAME COMMAND...: run with a time limit, log to OUTDIR/NAME.log
    local name=$1
    shift
    echo "== $name: $*"
    local started=$SECONDS
    timeout --kill-after=10 "$step_s" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 12 "$out/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - started)) s"
    [ "$rc" -eq 0 ] || status=1
}

step environment python - <<'PY'
import importlib, importlib.metadata, subprocess, torch
from rlvla3.policy.attention import available_varlen_kernels, backend_name
from sft.precision import fp8_backends
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0))
print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
print("nvidia-smi:", subprocess.run(query, capture_output=True, text=True).stdout.strip())
for dist in ("flash-attn", "flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13",
             "transformer-engine"):
    try:
        print(dist, importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        print(dist, "not installed")
for name in ("flash_attn", "flash_attn.cute", "transformer_engine.pytorch"):
    try:
        module = importlib.import_module(name)
        print(name, "imports", getattr(module, "__version__", ""))
    except Exception as err:  # not installed, or built for another torch
        print(name, "missing:", type(err).__name__, err)
print("varlen kernels that load:", available_varlen_kernels())
print("packed attention backend:", backend_name("cuda"))
print("FP8 backends:", fp8_backends(torch.device("cuda")))
PY
cp "$out/environment.log" "$out/environment.txt"

step pytest_gpu python -m pytest -m gpu tests/test_gpu.py tests/test_precision.py \
    tests/test_attention.py tests/test_token_vla_gpu.py -q -rs
# the real-size token VLA (issue 32 item 8), the most wanted figure: about 5 minutes on an
# H200, the 0.5B preset's writing and loading included; its own limit, STEP_S or 600 s,
# whichever is longer (not in the quick run)
if [ "${GPU_SUITE_QUICK:-0}" != 1 ]; then
    step_s=$((step_s > 600 ? step_s : 600)) step token_vla_scale \
        python bench/token_vla_scale.py --json "$out/token_vla_scale.json"
fi
step weight_sync_nccl python bench/weight_sync.py --device cuda --sizes 10e6 100e6 \
    --json "$out/weight_sync_nccl.json"
step weight_sync_cuda_gloo python bench/weight_sync.py --device cuda-gloo --sizes 10e6 100e6 \
    --json "$out/weight_sync_cuda_gloo.json"

if [ "${GPU_SUITE_QUICK:-0}" = 1 ]; then
    exit $status
fi
kernels=$(timeout 120 python -c 'from rlvla3.policy.attention import available_varlen_kernels as a
print(" ".join(a()))')
if [ -z "$kernels" ]; then
    echo "== no FlashAttention varlen kernel loads: packing not measured"
    status=1
fi
# name: model flags (the last is the CPU benchmark's default shape)
shapes=(
    "d2048:--batch 64 --d-model 2048 --layers 4 --heads 16"
    "d4096:--batch 64 --d-model 4096 --layers 2 --heads 32"
    "d1024:--batch 32 --d-model 1024 --layers 8 --heads 8"
    "default:--batch 8 --d-model 256 --layers 4 --heads 4"
)
for entry in "${shapes[@]}"; do
    name=${entry%%:*}
    for kernel in $kernels; do
        # shellcheck disable=SC2086  # the flags are meant to split
        step "packing_${name}_$kernel" python bench/packing.py --device cuda --steps 10 --fp8 \
            --varlen-kernel "$kernel" ${entry#*:} --json "$out/packing_${name}_$kernel.json"
    done
done

step sdpa_backends python bench/sdpa_backends.py --json "$out/sdpa_backends.json"
exit $status
