"""Packed vs right-padded SFT of a token VLA: real tokens per second and the padding fraction.

The workload is ``launch/sft_token_vla_tabletop.yaml``'s with the state as text
(``TEXT_STATE``): its policy section (the ``llava-tiny`` size preset, written into a temp dir,
nothing fetched; its bins) and DART demos of its task, so the prompts have the table-top's real
mix of lengths (instructions name different colours; state values write different digits). Each step takes one batch of
``sft.token_budget`` tokens the way the SFT trainer does (``DemoSet.packed_batch``, frames
counted by ``rlvla3/policy/sft_tokens.py``) and trains on it in three layouts, from the same
weights, alternating which goes first:

- **padded**: ``TokenVLAPolicy.evaluate``: the batch right-padded to its longest frame;
- **packed**: ``PackedEvaluator`` (``rlvla3/policy/token_vla_packing.py``): the frames back to
  back in one row, position ids restarting per frame, the language model's attention our
  varlen ``attention()`` (``rlvla3_varlen``: SDPA per frame on CPU, FlashAttention varlen on a
  GPU), what the SFT trainer runs;
- **packed_mask**: the same rows under ``transformers``' own packed path for sdpa: rows of the
  budget and a dense block-diagonal mask over each row.

Forward, backward and AdamW step, as the trainer does. The padding fraction is the share of
token slots the model runs on that hold no frame's token; the padding bound is the padded
layout's slots over the packed one's. The log-prob check is the largest per-frame difference
of a packed mode from the padded one on the first batch (before any update).

Usage: ``python bench/token_vla_packing.py [--steps 8] [--demos 50] [--family llava]
[--threads 1] [--json P]``; ``--smoke``: the ``test`` preset, 2 demos, one step.
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from harness.provenance import write_result
from harness.report import Table, benchmark_parser

from rlvla3.config.run_config import load_config
from rlvla3.policy.factory import build_policy
from rlvla3.policy.presets import ensure_preset
from rlvla3.policy.sft_tokens import frame_tokens
from rlvla3.policy.token_vla_packing import PackedEvaluator
from sft.data import DemoSet
from sft.demos import generate_demos

CONFIG = "launch/sft_token_vla_tabletop.yaml"
MODES = ("padded", "packed", "packed_mask")
TEXT_STATE = [
    "policy.token_vla.state_projector=0",
    'policy.token_vla.prompt="{instruction}{state}\\n"',
    "policy.token_vla.state_decimals=2",
]
"""The state written into the prompt as text, as a model without a state projector reads it:
the YAML's projector would leave every prompt of one instruction the same length."""
TABLE = Table.from_layout("mode:<11 | real tok/s:>11.0f | ms/step:>9.1f | padding:>8.1%")


def _setup(workdir: Path, family: str, size: str, demos: int, budget: int | None):
    """The config's policy (from the size preset) and its demos, counted as SFT counts them."""
    overrides = [
        f"policy.token_vla.path={workdir / 'model'}",
        f"policy.token_vla.preset={family}-{size}",
        *TEXT_STATE,
    ]
    if budget is not None:
        overrides.append(f"sft.token_budget={budget}")
    cfg = load_config(CONFIG, overrides)
    ensure_preset(cfg.policy.token_vla.path, cfg.policy.token_vla.preset)
    kwargs = dict(cfg.env.kwargs)
    noise = cfg.sft.expert_noise
    generate_demos(
        cfg.env.id, demos, workdir / "demos", cfg.sft.demo_seed, expert_noise=noise, **kwargs
    )
    policy = build_policy(cfg).train()
    counting = frame_tokens(policy, packing=False)  # SFT's counting; the policy left as loaded
    data = DemoSet(workdir / "demos", counting.fixed_tokens, counting.variable_tokens)
    return cfg, policy, data


def run(args) -> dict:
    """Alternate the modes' training steps on the same batches; return the figures."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg, policy, data = _setup(Path(tmp), args.family, args.size, args.demos, args.budget)
        budget = cfg.sft.token_budget
        policies = {m: policy if m == "padded" else copy.deepcopy(policy) for m in MODES}
        evaluate = {
            "padded": policy.evaluate,
            "packed": PackedEvaluator(policies["packed"], budget),
            "packed_mask": PackedEvaluator(policies["packed_mask"], budget, varlen=False),
        }
        optimizers = {
            m: torch.optim.AdamW(p.parameters(), lr=cfg.sft.lr, fused=True)
            for m, p in policies.items()
        }
        rng = np.random.default_rng(cfg.run.seed)
        seconds, slots = dict.fromkeys(MODES, 0.0), dict.fromkeys(MODES, 0)
        real = frames = 0
        max_diff = None
        for i in range(args.warmup + args.steps):
            batch = data.packed_batch(budget, rng)
            obs = {k: torch.from_numpy(v) for k, v in batch.obs.items()}
            action = policy.from_env_action(torch.from_numpy(batch.actions))
            if max_diff is None:  # before any update: the weights are the same in every mode
                max_diff = _log_prob_difference(evaluate, obs, action)
            order = MODES if i % 2 == 0 else MODES[::-1]
            times = {m: _train_step(evaluate[m], optimizers[m], obs, action) for m in order}
            if i < args.warmup:
                continue
            lengths = _frame_lengths(policy, obs)
            for m in MODES:
                seconds[m] += times[m]
                slots[m] += evaluate[m].last.slots if m != "padded" else 0
            slots["padded"] += len(lengths) * int(lengths.max())
            real += batch.num_tokens
            frames += batch.num_samples
    return _figures(args, cfg, seconds, slots, real, frames, max_diff)


def _frame_lengths(policy, obs) -> torch.Tensor:
    """Each frame's tokens: its prompt's and its action tokens."""
    _, lengths = policy._prompt_inputs(obs)
    return lengths + policy.bins.dims


def _log_prob_difference(evaluate, obs, action) -> float:
    """The largest per-frame |log-prob| difference of a packed mode from the padded one."""
    with torch.no_grad():
        padded, *packed = (evaluate[m](obs, action).log_prob for m in MODES)
    return max(float((padded - p).abs().max()) for p in packed)


def _train_step(evaluate, optimizer, obs, action) -> float:
    start = time.perf_counter()
    loss = -evaluate(obs, action).log_prob.mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def _figures(args, cfg, seconds, slots, real, frames, max_diff) -> dict:
    tokens_per_s = {m: real / seconds[m] for m in MODES}
    padding = {m: 1.0 - real / slots[m] for m in MODES}
    return {
        **{f"{m}_tokens_per_s": tokens_per_s[m] for m in MODES},
        **{f"{m}_padding_fraction": padding[m] for m in MODES},
        "speedup": tokens_per_s["packed"] / tokens_per_s["padded"],
        "mask_speedup": tokens_per_s["packed_mask"] / tokens_per_s["padded"],
        "padding_bound": slots["padded"] / slots["packed"],
        "max_abs_log_prob_difference": max_diff,
        "model": f"{args.family}-{args.size}",
        "token_budget": cfg.sft.token_budget,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "real_tokens": real,
        "frames": frames,
        "frames_per_step": frames / args.steps,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def print_table(r: dict) -> None:
    print(
        f"token VLA SFT, {r['model']}, budget {r['token_budget']} tokens "
        f"({r['frames_per_step']:.1f} frames/step), {r['steps']} steps, {r['threads']} threads"
    )
    TABLE.print(
        (
            m,
            r[f"{m}_tokens_per_s"],
            1e3 * r["real_tokens"] / r["steps"] / r[f"{m}_tokens_per_s"],
            r[f"{m}_padding_fraction"],
        )
        for m in MODES
    )
    print(
        f"packed / padded {r['speedup']:.2f}x   packed_mask / padded {r['mask_speedup']:.2f}x   "
        f"padding bound (padded slots / packed slots) "
        f"{r['padding_bound']:.2f}x   max |log-prob packed - padded| "
        f"{r['max_abs_log_prob_difference']:.1e}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, smoke_help="the test preset, 2 demos, one step, for CI")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument(
        "--demos", type=int, default=50, help="DART demos generated (the config's 50)"
    )
    parser.add_argument("--family", default="llava", choices=["llava", "idefics3"])
    parser.add_argument("--size", default="tiny", help="size preset (rlvla3/policy/presets.py)")
    parser.add_argument("--budget", type=int, help="sft.token_budget (default: the config's)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.demos, args.size, args.budget = 1, 0, 2, "test", 1024
    torch.set_num_threads(args.threads)
    result = run(args)
    print_table(result)
    write_result(args.json, "token_vla_packing", result, vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
