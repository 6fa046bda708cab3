"""Bytes per weight version with and without LoRA, on our VLA (``launch/vla_tabletop.yaml``) and
on a pretrained-model policy (``launch/token_vla_tabletop.yaml``: the llava-tiny and llava-0.5b
size presets of ``rlvla3/policy/presets.py``, written into a temporary directory; 0.5b takes a
few GB of memory and about a minute per rank on a CPU).

For each model (the table-top VLA as the launch file sets it, wider/deeper ones, the token VLA) and
each ``policy.lora.rank`` (0: no LoRA, the whole float state travels), the policy is built as
every role builds it (``build_policy``) and one version is published as the trainer publishes
it: ``FlatLayout.of(policy)`` flattened into one float32 buffer (what the broadcaster sends
over gloo / NCCL to each rollout server) and encoded as the ``WeightsUpdate`` message the
trainer pushes to the broadcaster over ZeroMQ (``wire bytes``). ``ratio`` is the full model's
bytes over these; ``flatten ms`` the median time of the trainer's flatten (``--repeats``).

With LoRA the adapters go on every Linear outside the heads (``target_modules`` empty), and the
heads (action, log-std, value; the token VLA's value head) travel in full: at small widths they
are most of the bytes.

    python bench/lora_sync.py [--ranks 0 4 16 32] [--repeats 20] [--json PATH]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from harness.provenance import write_result
from harness.report import Table, benchmark_parser

from rlvla3.config.run_config import load_config
from rlvla3.policy.factory import build_policy, env_spaces
from rlvla3.policy.presets import write_vlm
from transport import codec
from transport.messages import WeightsUpdate
from transport.weights import FlatLayout

LAUNCH = "launch/vla_tabletop.yaml"
TOKEN_VLA_LAUNCH = "launch/token_vla_tabletop.yaml"
TOKEN_VLA_PRESETS = [("llava", "tiny"), ("llava", "0.5b")]
"""Token-VLA size presets measured (the first alone with ``--smoke``)."""
FROM_SCRATCH = ["policy.init_checkpoint=null", "policy.init_launch=null", "algo.ref_kl_coef=0"]
SIZES = {
    "tabletop (d64 L2)": [],
    "d256 L6": ["policy.vla.d_model=256", "policy.vla.num_layers=6", "policy.vla.num_heads=8"],
}
"""Our VLA's sizes: overrides of ``LAUNCH``."""
TABLE = Table.from_layout(
    "model:<22 | rank:>5d | tensors:>8d | bytes/version:>14,d | wire bytes:>12,d | ratio:>7.1f"
    " | flatten ms:>10.3f"
)


def measure(launch: str, size: list[str], rank: int, repeats: int, spaces) -> dict[str, float]:
    """One version of ``launch``'s model with the ``size`` overrides and ``policy.lora.rank=rank``,
    as the trainer sends it."""
    cfg = load_config(launch, [*FROM_SCRATCH, *size, f"policy.lora.rank={rank}"])
    policy = build_policy(cfg, spaces)
    layout = FlatLayout.of(policy)
    flat = layout.flatten(policy).detach().cpu().numpy()
    frames = codec.encode(WeightsUpdate(version=1, layout=layout.digest, flat=flat))
    times = []
    layout.flatten(policy)  # warm-up: the first call pays for allocator and kernel set-up
    for _ in range(repeats):
        started = time.perf_counter()
        layout.flatten(policy)
        times.append((time.perf_counter() - started) * 1000)
    return {
        "tensors": len(layout.names),
        "bytes_per_version": int(flat.nbytes),
        "wire_bytes": int(sum(memoryview(f).nbytes for f in frames)),
        "params": sum(p.numel() for p in policy.parameters()),
        "flatten_ms": statistics.median(times),
    }


def main() -> None:
    parser = benchmark_parser(__doc__, smoke_help="the table-top sizes at ranks 0 and 4, once")
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 4, 16, 32])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lora_sync_") as tmp:
        models = _models(Path(tmp), smoke=args.smoke)
        if args.smoke:
            args.ranks, args.repeats = [0, 4], 1
        spaces = env_spaces(load_config(LAUNCH, FROM_SCRATCH))
        results: dict[str, dict[int, dict[str, float]]] = {}
        print(TABLE.header())
        for name, (launch, size) in models.items():
            ranks = sorted(set(args.ranks))
            rows = {rank: measure(launch, size, rank, args.repeats, spaces) for rank in ranks}
            full = rows[0]["bytes_per_version"] if 0 in rows else None
            for rank, r in rows.items():
                r["ratio"] = full / r["bytes_per_version"] if full else None
                print(
                    TABLE.row(
                        name,
                        rank,
                        r["tensors"],
                        r["bytes_per_version"],
                        r["wire_bytes"],
                        r["ratio"],
                        r["flatten_ms"],
                    )
                )
            results[name] = rows
    write_result(args.json, "lora_sync", results, vars(args))


def _models(tmp: Path, *, smoke: bool) -> dict[str, tuple[str, list[str]]]:
    """Model name -> (launch file, overrides): our VLA's sizes (the table-top one alone when
    ``smoke``) and the token VLA on a preset written into ``tmp`` (the table-top env's spaces)."""
    models = {name: (LAUNCH, size) for name, size in SIZES.items()}
    if smoke:
        models = {k: v for k, v in models.items() if k.startswith("tabletop")}
    for family, size in TOKEN_VLA_PRESETS[:1] if smoke else TOKEN_VLA_PRESETS:
        path = write_vlm(tmp / f"{family}_{size}", family, size)
        overrides = [f"policy.token_vla.path={path}", f"policy.token_vla.preset={family}-{size}"]
        models[f"token VLA {family}-{size}"] = (TOKEN_VLA_LAUNCH, overrides)
    return models


if __name__ == "__main__":
    main()
