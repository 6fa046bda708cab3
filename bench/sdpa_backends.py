"""Masked SDPA on CUDA per backend, for sequence lengths that change every call or stay fixed.

The padded attention path (``rlvla3.policy.attention._padded``: SDPA with a key padding mask)
sees a new shape whenever a batch's longest sample or a rollout batch's size changes. Backends
that build a plan per shape pay that on every new shape. For each backend (``default``: torch's
own choice; ``efficient``, ``cudnn``, ``math``; flash takes no mask) this times forward + backward
of bf16 SDPA, batch 8, 4 heads of 64, with a key padding mask:

- ``varying_ms``: a new length every call, from 32..512, each backend its own lengths (a
  backend that caches plans per shape must not profit from another's run);
- ``fixed_ms``: the same length (512) every call.

``ours`` is ``rlvla3.policy.attention.attention`` in its padded form, whatever it picks.

Usage: ``python bench/sdpa_backends.py [--calls 30] [--json PATH]`` (needs a CUDA GPU).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from harness.provenance import write_result
from harness.report import Table, benchmark_parser
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlvla3.policy.attention import attention

OURS = "ours"
BACKENDS: dict[str, SDPBackend | str | None] = {
    OURS: OURS,
    "default": None,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
BATCH, HEADS, HEAD_DIM = 8, 4, 64
TABLE = Table.from_layout("backend:<10 | fixed ms:>9.2f | varying ms:>11.2f")


def one_call(length: int, backend: SDPBackend | str | None, g: torch.Generator) -> None:
    """Forward + backward of masked SDPA at ``length``; pads the last quarter of each row."""
    q, k, v = (
        torch.randn(
            BATCH, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g
        ).requires_grad_()
        for _ in range(3)
    )
    mask = torch.ones(BATCH, 1, 1, length, dtype=torch.bool, device="cuda")
    mask[..., length - length // 4 :] = False
    if backend == OURS:
        out = attention(q, k, v, key_padding_mask=mask[:, 0, 0, :])
    elif backend is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.float().sum().backward()


def ms_per_call(lengths: list[int], backend: SDPBackend | str | None) -> float:
    g = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for length in lengths:
        one_call(length, backend, g)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / len(lengths)


def run(calls: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.arange(32, 512)[torch.randperm(480, generator=gen)].tolist()
    per_backend = len(lengths) // len(BACKENDS)
    if calls > per_backend:
        raise SystemExit(f"--calls: at most {per_backend} (distinct lengths per backend)")
    results: dict[str, dict[str, float | str]] = {}
    for i, (name, backend) in enumerate(BACKENDS.items()):
        varying = lengths[i * per_backend : i * per_backend + calls]
        try:
            one_call(512, backend, torch.Generator(device="cuda").manual_seed(0))  # warm-up
            results[name] = {
                "fixed_ms": ms_per_call([512] * calls, backend),
                "varying_ms": ms_per_call(varying, backend),
            }
        except RuntimeError as err:  # a backend that cannot take this input
            results[name] = {"error": str(err).splitlines()[0]}
    return {
        "backends": results,
        "calls": calls,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(
        __doc__, smoke_help="two calls each; without a GPU, say so and exit 0 (CI)"
    )
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args(argv)
    if args.smoke:
        args.calls = 2
    if not torch.cuda.is_available():
        print("bench/sdpa_backends.py needs a CUDA GPU", file=sys.stderr)
        return 0 if args.smoke else 2
    result = run(args.calls)
    print(f"masked SDPA fwd+bwd, bf16, B={BATCH}, H={HEADS}, Dh={HEAD_DIM}, {result['gpu']}")
    print(TABLE.header())
    for name, r in result["backends"].items():
        if "error" in r:
            print(f"{name:<10} {r['error']}")
        else:
            print(TABLE.row(name, r["fixed_ms"], r["varying_ms"]))
    write_result(args.json, "sdpa_backends", result, vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
