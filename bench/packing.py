"""Padded vs packed training throughput, in real (non-pad) tokens per second.

Each step trains on 8 samples of random lengths in [32, 512] (float features, d=256) with a 4-layer
d=256 transformer built on ``rlvla3.policy.attention.attention`` (the VLA trunk, ``Transformer``):
forward + backward + AdamW step, per-token MSE loss (``--batch``, ``--d-model``, ``--layers``,
``--heads`` change the shape: a GPU needs a bigger one to be busy). Both modes see the same samples
and start from the same weights:

- **padded**: zero-pad to the step's longest sample, key padding mask, batched SDPA.
- **packed**: ``sft.packing.pack`` + ``collate_packed`` (no pad tokens), per-document attention
  (``sdpa_per_segment`` on CPU; on CUDA under bf16 autocast a FlashAttention varlen kernel:
  ``flash_attn_varlen`` from flash-attn 2, else ``flash_attn4_varlen`` from flash-attn 4, else
  torch's built-in ``torch_varlen_attn``; ``--varlen-kernel`` picks one).
- **packed_fp8** (``--fp8``, GPU with FP8 only): the packed mode with FP8 linears
  (``sft.precision.enable_fp8``), reported against packed bf16.

The padding bound is padded token slots / real tokens (= max_len / mean_len per step): the speed-up
packing would give if cost were linear in tokens. Modes alternate step by step so load drift on a
shared machine hits both alike.

Usage: ``python bench/packing.py [--steps 6] [--seed 0] [--device cpu] [--threads 1] [--fp8]
[--batch 8] [--d-model 256] [--layers 4] [--heads 4] [--varlen-kernel NAME] [--json P]``
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from harness.provenance import write_result
from harness.report import Table, benchmark_parser

from rlvla3.policy.attention import (
    VARLEN_KERNELS,
    available_varlen_kernels,
    backend_name,
    prefer_varlen_kernel,
)
from rlvla3.policy.transformer import Transformer
from sft.packing import collate_packed, collate_padded, pack
from sft.precision import Context, autocast_context, enable_fp8, fp8_backend

MIN_LEN, MAX_LEN = 32, 512


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """The benchmark's model and batch: ``batch`` samples per step of MIN_LEN..MAX_LEN tokens."""

    batch: int = 8
    """Samples per step."""
    d_model: int = 256
    """The transformer's width."""
    layers: int = 4
    """Its layers."""
    heads: int = 4
    """Its attention heads."""

    def model(self) -> Transformer:
        return Transformer(d_model=self.d_model, num_layers=self.layers, num_heads=self.heads)

    def describe(self) -> str:
        return f"{self.layers} layers, d={self.d_model}, {self.heads} heads"


@dataclass(frozen=True, slots=True, kw_only=True)
class StepData:
    """One step's samples: inputs/targets float32[len_i, d_model] each, on the bench device."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]

    @property
    def lengths(self) -> list[int]:
        return [int(x.shape[0]) for x in self.inputs]


def make_steps(num_steps: int, seed: int, device: torch.device, shape: Shape) -> list[StepData]:
    """Random lengths in [MIN_LEN, MAX_LEN] and random features, ``shape.batch`` per step."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(num_steps):
        lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (shape.batch,), generator=g).tolist()
        inputs = [torch.randn(n, shape.d_model, generator=g).to(device) for n in lengths]
        targets = [torch.randn(n, shape.d_model, generator=g).to(device) for n in lengths]
        steps.append(StepData(inputs=inputs, targets=targets))
    return steps


def padded_step(model: Transformer, data: StepData) -> torch.Tensor:
    """Forward + backward on the zero-padded batch; loss = mean over real tokens."""
    idx = range(len(data.inputs))
    x, mask = collate_padded(data.inputs, idx)
    y, _ = collate_padded(data.targets, idx)
    out = model(x, key_padding_mask=mask)
    loss = ((out.float() - y) ** 2).mean(-1)[mask].mean()
    loss.backward()
    return loss


def packed_step(model: Transformer, data: StepData, budget: int) -> torch.Tensor:
    """Forward + backward per packed bin (gradients accumulate); loss = mean over real tokens."""
    total = sum(data.lengths)
    loss_sum = torch.zeros((), device=data.inputs[0].device)
    for b in pack(data.lengths, budget):
        batch = collate_packed(data.inputs, b, budget=budget)
        y = collate_packed(data.targets, b, budget=budget).tokens
        out = model(batch.tokens, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen)
        loss = ((out.float() - y) ** 2).mean(-1).sum() / total
        loss.backward()
        loss_sum += loss.detach()
    return loss_sum


def timed(
    fn: Callable[[], torch.Tensor],
    opt: torch.optim.Optimizer,
    device: torch.device,
    precision: Context,
) -> float:
    """Seconds for one training step: ``fn`` (forward + backward) under ``precision`` (bf16
    autocast on GPU, or the FP8 context ``enable_fp8`` returned), then the optimizer step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with precision():
        fn()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run(
    steps: int,
    seed: int,
    device: torch.device,
    budget: int,
    shape: Shape = Shape(),
    fp8: bool = False,
    warmup: int = 1,
) -> dict:
    """Alternate padded and packed (and packed FP8) steps on the same data; return the figures."""
    torch.manual_seed(seed)
    models = {"padded": shape.model().to(device)}
    models["packed"] = copy.deepcopy(models["padded"])
    fp8_name = fp8_backend(device) if fp8 else None
    if fp8 and fp8_name is None:
        raise SystemExit(f"--fp8: no FP8 backend on {device} (needs a CUDA GPU of sm_89 or newer)")
    precision = dict.fromkeys(models, autocast_context(device))
    if fp8_name is not None:
        models["packed_fp8"] = copy.deepcopy(models["padded"])
        # its own context: Transformer Engine's FP8 is on only inside te.autocast
        precision["packed_fp8"] = enable_fp8(models["packed_fp8"], fp8_name)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    fns = {
        "padded": lambda d: padded_step(models["padded"], d),
        "packed": lambda d: packed_step(models["packed"], d, budget),
        "packed_fp8": lambda d: packed_step(models["packed_fp8"], d, budget),
    }
    all_steps = make_steps(warmup + steps, seed, device, shape)
    seconds = dict.fromkeys(models, 0.0)
    real = slots = 0
    for i, data in enumerate(all_steps):
        order = list(models) if i % 2 == 0 else list(reversed(models))
        times = {
            name: timed(lambda n=name, d=data: fns[n](d), opts[name], device, precision[name])
            for name in order
        }
        if i < warmup:
            continue
        for name, t in times.items():
            seconds[name] += t
        real += sum(data.lengths)
        slots += len(data.lengths) * max(data.lengths)
    padded_tps, packed_tps = real / seconds["padded"], real / seconds["packed"]
    bound = slots / real
    extra = {}
    if fp8_name is not None:
        fp8_tps = real / seconds["packed_fp8"]
        extra = {
            "packed_fp8_tokens_per_s": fp8_tps,
            "fp8_speedup_vs_bf16": fp8_tps / packed_tps,
            "fp8_backend": fp8_name,
        }
    return {
        "padded_tokens_per_s": padded_tps,
        "packed_tokens_per_s": packed_tps,
        "speedup": packed_tps / padded_tps,
        "padding_bound": bound,
        "speedup_over_bound": packed_tps / padded_tps / bound,
        "device": str(device),
        "backend": backend_name(
            device, None if device.type == "cuda" else torch.float32, shape.d_model // shape.heads
        ),
        "steps": steps,
        "warmup_steps": warmup,
        "seed": seed,
        "budget": budget,
        "real_tokens": real,
        "padded_slots": slots,
        "threads": torch.get_num_threads(),
        "model": shape.describe(),
        "samples_per_step": shape.batch,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        **extra,
    }


def profile(
    steps: int, seed: int, device: torch.device, budget: int, shape: Shape, fp8: bool
) -> None:
    """Print each mode's top GPU kernels over a few steps (``--profile``; CUDA only)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(steps, seed, device, budget, shape, fp8)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


TABLE = Table.from_layout("mode:<10 | real tok/s:>12.0f | ms/step:>10.1f")


def print_table(r: dict) -> None:
    """Human-readable summary of ``run``'s result."""
    per_step = r["real_tokens"] / r["steps"]
    print(
        f"packing bench: {r['model']}, {r['samples_per_step']} samples/step of "
        f"{MIN_LEN}..{MAX_LEN} tokens, "
        f"{r['steps']} steps, device {r['device']} ({r['backend']}), {r['threads']} threads"
    )
    TABLE.print(
        (mode, tps, 1e3 * per_step / tps)
        for mode in ("padded", "packed", "packed_fp8")
        if (tps := r.get(f"{mode}_tokens_per_s")) is not None
    )
    print(
        f"speed-up {r['speedup']:.2f}x   padding bound (max_len/mean_len) "
        f"{r['padding_bound']:.2f}x   speed-up / bound {100 * r['speedup_over_bound']:.0f}%"
    )
    if "fp8_speedup_vs_bf16" in r:
        print(f"FP8 ({r['fp8_backend']}) vs bf16, packed: {r['fp8_speedup_vs_bf16']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, smoke_help="a few seconds of each case, for CI")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--budget", type=int, help="packing token budget (default: batch * 512, one bin per step)"
    )
    parser.add_argument("--batch", type=int, default=8, help="samples per step")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--fp8", action="store_true", help="also time packed steps in FP8 (GPU)")
    parser.add_argument(
        "--varlen-kernel",
        choices=list(VARLEN_KERNELS),
        help="CUDA: the FlashAttention varlen kernel for packed attention (default: the first "
        "that loads, in the order listed)",
    )
    parser.add_argument("--profile", action="store_true", help="print top GPU kernels (CUDA)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.d_model, args.layers = 1, 2, 32, 1
    for flag in ("steps", "threads", "batch", "d_model", "layers", "heads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.d_model % args.heads:
        parser.error("--d-model must be a multiple of --heads")
    if args.budget is not None and args.budget < MAX_LEN:
        parser.error(f"--budget must hold the longest sample ({MAX_LEN} tokens)")
    if args.varlen_kernel is not None:
        if args.varlen_kernel not in available_varlen_kernels():
            parser.error(f"--varlen-kernel {args.varlen_kernel} does not load here")
        prefer_varlen_kernel(args.varlen_kernel)
    torch.set_num_threads(args.threads)
    shape = Shape(batch=args.batch, d_model=args.d_model, layers=args.layers, heads=args.heads)
    budget = args.budget if args.budget is not None else shape.batch * MAX_LEN
    device = torch.device(args.device)
    # on CUDA, untimed steps also take the FP8 casts' compilation (one per dtype pair)
    warmup = 3 if device.type == "cuda" else 1
    result = run(args.steps, args.seed, device, budget, shape, args.fp8, warmup)
    print_table(result)
    if args.profile:
        profile(2, args.seed, device, budget, shape, args.fp8)
    write_result(args.json, "packing", result, vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
