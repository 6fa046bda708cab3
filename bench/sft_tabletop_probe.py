"""SFT probe: behaviour-clone the VLA on table-top expert demos in one process, eval as it trains.

Same data path, loss and batching as ``roles/sft_trainer.py`` (``DemoSet.packed_batch``,
``policy.demo_action``, ``-policy.demo_evaluate(obs, actions).log_prob.mean()``, AdamW, grad-norm
clip 1.0, constant lr), without the launcher. Every ``--eval-every`` steps the greedy policy
(``act(obs, deterministic=True)`` -> ``to_env_action``) runs ``--eval-episodes`` fresh seeded
episodes (seeds ``--eval-seed + i``, disjoint from the demo seeds), batched across episodes.
Training wall time excludes evaluation; both are printed.

Demos are generated once per (env, count, noise, seed) under ``--demo-dir`` and reused.
``action_err`` / ``first_err`` in each eval line: mean L2 distance between the policy's action and
the clean scripted expert's action (all visited states / first step of each episode; a policy that
always outputs 0 scores ~0.9, a uniform-random one ~1.2), a signal long before success appears.

``--expert-noise`` generates DART demos exactly as ``sft.expert_noise`` does (expert + noise
executed, clean expert action recorded). What-if flags (off by default, so the defaults measure the
product path): ``--image-pos-std``, ``--drop-velocity``.

Usage::

    python bench/sft_tabletop_probe.py --env-id rlvla3/TableTop-v0 --num-demos 300 \
        --expert-noise 0.3 --d-model 64 --num-layers 2 --num-bins 32 --lr 1e-3 \
        --token-budget 4096 --max-steps 800 --eval-every 200 --eval-episodes 50 --json out.json

Any policy family from a launch YAML (its policy and env sections; ``--set`` overrides), e.g. the
token VLA of the learning run (write its preset first: ``python -m rlvla3.policy.presets``)::

    python bench/sft_tabletop_probe.py --config launch/sft_token_vla_tabletop.yaml \
        --num-demos 400 --expert-noise 0.3 --symmetry --lr 2e-3 --max-steps 600 \
        --eval-every 200 --set policy.token_vla.bins=3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from harness.provenance import write_result
from harness.report import benchmark_parser, point_line
from harness.tabletop_eval import evaluate

from rlvla3.config.run_config import config_from_dict, load_config
from rlvla3.config.sections import SymmetryConfig
from rlvla3.policy.factory import build_policy
from rlvla3.policy.sft_tokens import frame_tokens
from roles.sft_trainer import planar_symmetry
from sft.data import DemoSet
from sft.demos import generate_demos
from sft.symmetry import PlanarSymmetry, augment

# sft.symmetry's defaults, which describe the table-top task's observations and action.
TABLETOP_SYMMETRY = planar_symmetry(SymmetryConfig(kind="dihedral"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, smoke_help="5 demos, 3 steps, 2 evaluation episodes (CI)")
    p.add_argument("--env-id", default="rlvla3/TableTop-v0")
    p.add_argument(
        "--env-kwarg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="env.kwargs entry (YAML value), e.g. image_size=32; repeatable",
    )
    p.add_argument("--num-demos", type=int, default=300)
    p.add_argument("--expert-noise", type=float, default=0.0)
    p.add_argument("--demo-seed", type=int, default=12345)
    p.add_argument("--demo-dir", default="/tmp/rlvla3_sft_probe")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--patch-size", type=int, default=8)
    p.add_argument("--action-head", default="discrete_bins", choices=("discrete_bins", "gaussian"))
    p.add_argument("--num-bins", type=int, default=32)
    p.add_argument(
        "--vla",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other policy.vla field (YAML value), repeatable",
    )
    p.add_argument(
        "--image-pos-std",
        type=float,
        default=0.0,
        help="what-if: re-initialise VLAPolicy.image_pos with this std (0: as built, 1.0)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--token-budget", type=int, default=4096)
    p.add_argument("--max-steps", type=int, default=800)
    p.add_argument("--max-train-s", type=float, default=0.0, help="stop training after (0: off)")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-episodes", type=int, default=50)
    p.add_argument("--eval-seed", type=int, default=1_000_000)
    p.add_argument(
        "--drop-velocity",
        action="store_true",
        help="diagnostic: zero proprio[2:4] (pusher velocity) in training and eval",
    )
    p.add_argument(
        "--symmetry",
        action="store_true",
        help="sft.symmetry: each frame under a random rotation/reflection of the table",
    )
    p.add_argument(
        "--config",
        default=None,
        help="a launch YAML whose policy and env sections are probed (any policy.kind, e.g. "
        "launch/sft_token_vla_tabletop.yaml); the --d-model ... --vla flags then do nothing",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --config: an override as `rlvla3 launch --set` takes it, repeatable",
    )
    p.add_argument("--seed", type=int, default=0, help="run.seed: model init and batch order")
    p.add_argument("--threads", type=int, default=1, help="torch threads (roles use 1)")
    return p.parse_args(argv)


def demo_root(args: argparse.Namespace) -> Path:
    """Generate the demos once per (env, count, noise, seed); reuse them afterwards."""
    name = args.env_id.split("/")[-1] + "".join(f"_{k}{v}" for k, v in env_kwargs(args).items())
    root = Path(args.demo_dir) / (
        f"{name}_n{args.num_demos}_dart{args.expert_noise:g}_seed{args.demo_seed}"
    )
    if (root / "meta" / "info.json").exists():
        return root
    started = time.perf_counter()
    stats = generate_demos(
        args.env_id,
        args.num_demos,
        root,
        args.demo_seed,
        expert_noise=args.expert_noise,
        overwrite=True,
        **env_kwargs(args),
    )
    print(
        f"generated {stats.num_episodes} demos ({stats.num_frames} frames, expert success "
        f"{stats.success_rate:.2f}) in {time.perf_counter() - started:.1f}s",
        flush=True,
    )
    return root


def env_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``--env-kwarg`` items as the ``env.kwargs`` mapping."""
    return {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.env_kwarg)}


def config_policy(args: argparse.Namespace) -> torch.nn.Module:
    """``--config``'s policy as the launcher builds it; its env id and kwargs become the
    probe's (so demos and evaluation use the task the YAML trains on)."""
    cfg = load_config(args.config, [*args.set, f"run.seed={args.seed}"])
    args.env_id = cfg.env.id
    args.env_kwarg = [f"{k}={json.dumps(v)}" for k, v in cfg.env.kwargs.items()]
    torch.manual_seed(args.seed)
    return build_policy(cfg)


def build(args: argparse.Namespace) -> torch.nn.Module:
    """The policy exactly as the launcher builds it (``build_policy`` from a Config)."""
    if args.config:
        return config_policy(args)
    vla: dict[str, Any] = {
        "d_model": args.d_model,
        "num_layers": args.num_layers,
        "num_heads": args.num_heads,
        "patch_size": args.patch_size,
        "action_head": args.action_head,
        "num_bins": args.num_bins,
    }
    for item in args.vla:
        key, _, value = item.partition("=")
        vla[key] = json.loads(value) if value[:1] in "-0123456789[{tf" else value
    cfg = config_from_dict(
        {
            "run": {"seed": args.seed},
            "env": {"id": args.env_id, "kwargs": env_kwargs(args)},
            "policy": {"kind": "vla", "vla": vla},
        }
    )
    torch.manual_seed(args.seed)
    policy = build_policy(cfg)
    if args.image_pos_std > 0:
        torch.nn.init.normal_(policy.image_pos, std=args.image_pos_std)
    return policy


def train_step(
    policy: Any,
    data: DemoSet,
    optimizer: Any,
    budget: int,
    rng: Any,
    symmetry: PlanarSymmetry | None = None,
) -> tuple[float, int]:
    """One SFT step, exactly as ``SftTrainer._train_step`` (CPU, no autocast)."""
    batch = data.packed_batch(budget, rng)
    obs_np, actions_np = batch.obs, batch.actions
    if symmetry is not None:
        obs_np, actions_np = augment(obs_np, actions_np, symmetry, rng)
    obs = {k: torch.from_numpy(v) for k, v in obs_np.items()}
    actions = policy.demo_action(obs, torch.from_numpy(actions_np))
    loss = -policy.demo_evaluate(obs, actions).log_prob.mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    return float(loss.item()), batch.num_samples


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.smoke:
        args.num_demos, args.max_steps, args.eval_every, args.eval_episodes = 5, 3, 0, 2
        args.demo_dir = f"{args.demo_dir}_smoke"
    torch.set_num_threads(args.threads)
    policy = build(args).train()
    root = demo_root(args)
    counting = frame_tokens(policy)
    data = DemoSet(
        root, fixed_tokens=counting.fixed_tokens, variable_tokens=counting.variable_tokens
    )
    if args.drop_velocity:
        data.obs["proprio"][:, 2:] = 0.0
    n_params = sum(p.numel() for p in policy.parameters())
    print(
        f"{len(data)} frames / {data.num_episodes} episodes; {n_params} params; "
        f"{args.config or policy.config}",
        flush=True,
    )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    rng = np.random.default_rng(args.seed)
    symmetry = TABLETOP_SYMMETRY if args.symmetry else None
    curve: list[dict[str, float]] = []
    train_s = train_cpu_s = eval_s = 0.0
    losses: list[float] = []
    samples = 0

    def record(step: int) -> None:
        nonlocal eval_s
        started = time.perf_counter()
        ev = evaluate(
            policy,
            args.env_id,
            args.eval_episodes,
            args.eval_seed,
            args.drop_velocity,
            env_kwargs(args),
        )
        eval_s += time.perf_counter() - started
        loss = float(np.mean(losses[-20:])) if losses else float("nan")
        point = {
            "step": step,
            "train_s": round(train_s, 1),
            "cpu_s": round(train_cpu_s, 1),
            "eval_s": round(eval_s, 1),
            "loss": loss,
            "epochs": samples / len(data),
            **ev,
        }
        curve.append(point)
        print(point_line(point), flush=True)

    step = 0
    while step < args.max_steps and not (args.max_train_s and train_s >= args.max_train_s):
        started, cpu = time.perf_counter(), time.process_time()
        loss, n = train_step(policy, data, optimizer, args.token_budget, rng, symmetry)
        train_s += time.perf_counter() - started
        train_cpu_s += time.process_time() - cpu
        losses.append(loss)
        samples += n
        step += 1
        if args.eval_every and step % args.eval_every == 0:
            record(step)
    if not curve or curve[-1]["step"] != step:
        record(step)
    result = {
        "args": vars(args),
        "frames": len(data),
        "params": n_params,
        "curve": curve,
        "final_success": curve[-1]["success_rate"],
        "train_s": train_s,
        "train_cpu_s": train_cpu_s,
    }
    write_result(args.json, "sft_tabletop_probe", result, vars(args))
    return result


if __name__ == "__main__":
    main()
