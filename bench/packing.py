"""Padded vs packed training throughput, in real (non-pad) tokens per second.

Each step trains on 8 samples of random lengths in [32, 512] (float features, d=256) with a 4-layer
d=256 transformer built on ``rlvla3.policy.attention.attention`` (the VLA trunk, ``Transformer``):
forward + backward + AdamW step, per-token MSE loss. Both modes see the same samples and start from
the same weights:

- **padded**: zero-pad to the step's longest sample, key padding mask, batched SDPA.
- **packed**: ``sft.packing.pack`` + ``collate_packed`` (no pad tokens), per-document attention
  (``sdpa_per_segment`` on CPU, ``flash_attn_varlen`` on CUDA with flash-attn under bf16 autocast).

The padding bound is padded token slots / real tokens (= max_len / mean_len per step): the speed-up
packing would give if cost were linear in tokens. Modes alternate step by step so load drift on a
shared machine hits both alike.

Usage: ``python -m bench.packing [--steps 6] [--seed 0] [--device cpu] [--threads 1] [--json P]``
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlvla3.policy.attention import backend_name  # noqa: E402
from rlvla3.policy.vla import Transformer  # noqa: E402
from sft.packing import collate_packed, collate_padded, pack  # noqa: E402

D_MODEL, NUM_LAYERS, NUM_HEADS = 256, 4, 4
BATCH, MIN_LEN, MAX_LEN = 8, 32, 512


@dataclass(frozen=True, slots=True, kw_only=True)
class StepData:
    """One step's samples: inputs/targets float32[len_i, D_MODEL] each, on the bench device."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]

    @property
    def lengths(self) -> list[int]:
        return [int(x.shape[0]) for x in self.inputs]


def make_steps(num_steps: int, seed: int, device: torch.device) -> list[StepData]:
    """Random lengths in [MIN_LEN, MAX_LEN] and random features, ``BATCH`` samples per step."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(num_steps):
        lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (BATCH,), generator=g).tolist()
        inputs = [torch.randn(n, D_MODEL, generator=g).to(device) for n in lengths]
        targets = [torch.randn(n, D_MODEL, generator=g).to(device) for n in lengths]
        steps.append(StepData(inputs=inputs, targets=targets))
    return steps


def padded_step(model: Transformer, data: StepData) -> torch.Tensor:
    """Forward + backward on the zero-padded batch; loss = mean over real tokens."""
    idx = range(BATCH)
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
    fn: Callable[[], torch.Tensor], opt: torch.optim.Optimizer, device: torch.device
) -> float:
    """Seconds for one training step: ``fn`` (forward + backward), then the optimizer step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        fn()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run(steps: int, seed: int, device: torch.device, budget: int, warmup: int = 1) -> dict:
    """Alternate padded and packed training steps on the same data; return the figures."""
    torch.manual_seed(seed)
    padded_model = Transformer(d_model=D_MODEL, num_layers=NUM_LAYERS, num_heads=NUM_HEADS).to(
        device
    )
    packed_model = copy.deepcopy(padded_model)
    opts = {
        name: torch.optim.AdamW(m.parameters(), lr=1e-4)
        for name, m in (("padded", padded_model), ("packed", packed_model))
    }
    fns = {
        "padded": lambda d: padded_step(padded_model, d),
        "packed": lambda d: packed_step(packed_model, d, budget),
    }
    all_steps = make_steps(warmup + steps, seed, device)
    seconds = {"padded": 0.0, "packed": 0.0}
    real = slots = 0
    for i, data in enumerate(all_steps):
        order = ("padded", "packed") if i % 2 == 0 else ("packed", "padded")
        times = {
            name: timed(lambda n=name, d=data: fns[n](d), opts[name], device) for name in order
        }
        if i < warmup:
            continue
        for name, t in times.items():
            seconds[name] += t
        real += sum(data.lengths)
        slots += BATCH * max(data.lengths)
    padded_tps, packed_tps = real / seconds["padded"], real / seconds["packed"]
    bound = slots / real
    return {
        "padded_tokens_per_s": padded_tps,
        "packed_tokens_per_s": packed_tps,
        "speedup": packed_tps / padded_tps,
        "padding_bound": bound,
        "speedup_over_bound": packed_tps / padded_tps / bound,
        "device": str(device),
        "backend": backend_name(device, None if device.type == "cuda" else torch.float32),
        "steps": steps,
        "seed": seed,
        "budget": budget,
        "real_tokens": real,
        "padded_slots": slots,
        "threads": torch.get_num_threads(),
        "model": f"{NUM_LAYERS} layers, d={D_MODEL}, {NUM_HEADS} heads",
        "torch": torch.__version__,
    }


def print_table(r: dict) -> None:
    """Human-readable summary of ``run``'s result."""
    per_step = r["real_tokens"] / r["steps"]
    print(
        f"packing bench: {r['model']}, {BATCH} samples/step of {MIN_LEN}..{MAX_LEN} tokens, "
        f"{r['steps']} steps, device {r['device']} ({r['backend']}), {r['threads']} threads"
    )
    print(f"{'mode':<8} {'real tok/s':>12} {'ms/step':>10}")
    for mode in ("padded", "packed"):
        tps = r[f"{mode}_tokens_per_s"]
        print(f"{mode:<8} {tps:>12.0f} {1e3 * per_step / tps:>10.1f}")
    print(
        f"speed-up {r['speedup']:.2f}x   padding bound (max_len/mean_len) "
        f"{r['padding_bound']:.2f}x   speed-up / bound {100 * r['speedup_over_bound']:.0f}%"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--budget",
        type=int,
        default=BATCH * MAX_LEN,
        help="packing token budget (default: one bin per step)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args.steps, args.seed, torch.device(args.device), args.budget)
    print_table(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
