"""VLA policy cost on this machine: inference (``act``) and training (``evaluate`` + backward).

Builds the VLA for the table-top task's spaces at a few sizes and times, per batch size, the
median of several repeats. Prints a table; ``--json PATH`` writes ``{config: {batch: {...}}}``.

    python bench/vla_step.py [--threads 1] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import statistics
import time

import torch
from harness.provenance import write_result
from harness.report import Table, benchmark_parser

from rlvla3.config.run_config import load_config
from rlvla3.policy.factory import env_spaces

SIZES = {
    "tiny (d64 L2)": {"d_model": 64, "num_layers": 2, "num_heads": 4},
    "small (d128 L4)": {"d_model": 128, "num_layers": 4, "num_heads": 4},
    "base (d256 L6)": {"d_model": 256, "num_layers": 6, "num_heads": 8},
}
TABLE = Table.from_layout("model:<16 | params:>8 | batch:>6d | act ms:>8.1f | train step ms:>14.1f")


def batch_of(spaces, n: int) -> dict[str, torch.Tensor]:
    return {
        k: torch.as_tensor(s.sample()).unsqueeze(0).expand(n, *s.shape).clone()
        for k, s in spaces.observation.spaces.items()
    }


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(vla: dict, batches: list[int], repeats: int) -> dict[int, dict[str, float]]:
    spaces = _spaces()
    policy = _policy(vla, spaces)
    optim = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    out = {}
    for n in batches:
        obs = batch_of(spaces, n)
        actions = policy.act(obs).action

        def train_step(obs=obs, actions=actions) -> None:
            loss = -policy.evaluate(obs, actions).log_prob.mean()
            optim.zero_grad()
            loss.backward()
            optim.step()

        with torch.inference_mode():
            act_ms = median_ms(lambda obs=obs: policy.act(obs), repeats)
        out[n] = {"act_ms": act_ms, "train_step_ms": median_ms(train_step, repeats)}
    return out


def _spaces():
    return env_spaces(load_config(None, ["env.id=rlvla3/TableTop-v0", "policy.kind=vla"]))


def _policy(vla: dict, spaces):
    from rlvla3.config.typed_load import from_dict
    from rlvla3.policy.factory import _vla_fields_from_spaces
    from rlvla3.policy.vla import VLAConfig, VLAPolicy

    fields = _vla_fields_from_spaces(spaces)
    fields.update(vla)
    return VLAPolicy(from_dict(VLAConfig, fields, "policy.vla"))


def main() -> None:
    parser = benchmark_parser(__doc__, smoke_help="a few seconds of each case, for CI")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.batches = 1, [1]
    torch.set_num_threads(args.threads)
    results = {}
    print(TABLE.header())
    for name, vla in SIZES.items():
        params = sum(p.numel() for p in _policy(vla, _spaces()).parameters())
        results[name] = {"params": params, "batches": measure(vla, args.batches, args.repeats)}
        for n, r in results[name]["batches"].items():
            print(TABLE.row(name, f"{params / 1e6:.2f}M", n, r["act_ms"], r["train_step_ms"]))
    write_result(args.json, "vla_step", results, vars(args))


if __name__ == "__main__":
    main()
