"""What a critic can explain: fresh value heads fitted to a policy's own returns.

Reads a launch YAML as ``rlvla3 launch`` does (``--set`` overrides as there), loads its
``policy.init_checkpoint`` (the RL stage's start), plays ``--envs`` envs with sampled actions
for ``--steps`` steps each (``bench/rl_tabletop_probe.py``'s ``Rollouts``) and keeps the whole
episodes. Each step's target is its discounted return to the episode's end (``algo.gamma``; a
truncated episode's return stops at the step limit, which the step index sees). Then it fits
one fresh value head per input (the policy's own head shape: Linear, Tanh, Linear; Adam at
``algo.value_lr``, minibatches of 128) on 80% of the steps and reports the explained variance
(1 - Var(R - V) / Var(R)) on the other 20%:

- ``head input``: what the policy's value head reads (for a token VLA the last prompt token's
  hidden state);
- ``step``: the step's index in its episode alone (time left);
- ``head input + step``, and, where the env gives a ``state`` observation (the table-top's
  ``obs_mode: rgb+state``), ``privileged state`` and ``privileged state + step``.

The privileged state bounds what any critic of this policy could explain from the scene; the
gap to the head's input is what the model's features do not say about it.

    python bench/critic_probe.py launch/token_vla_tabletop.yaml \\
        --set env.kwargs.obs_mode=rgb+state [--json out.json]
"""

from __future__ import annotations

import time
from typing import Any

import torch
from harness.provenance import write_result
from harness.report import Table, benchmark_parser
from rl_tabletop_probe import Rollouts

from rlvla3.algo.advantages import compute_gae
from rlvla3.config.run_config import load_config
from rlvla3.policy.factory import build_policy
from rlvla3.runtime.checkpoints import load_checkpoint

MINIBATCH = 128


def parse_args(argv: list[str] | None = None) -> Any:
    p = benchmark_parser(__doc__, smoke_help="a few episodes and fitting steps, for CI")
    p.add_argument("config", help="launch YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--envs", type=int, default=64)
    p.add_argument("--steps", type=int, default=60, help="env steps per env")
    p.add_argument("--fit-steps", type=int, default=3000, help="Adam steps per value head")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    return p.parse_args(argv)


def collect(policy: Any, cfg: Any, envs: int, steps: int) -> dict[str, torch.Tensor]:
    """Whole episodes of sampled actions: the value head's input, the step index, the
    discounted return and (where the env has one) the ``state`` observation of every step."""
    captured: list[torch.Tensor] = []
    hook = policy.value_head.register_forward_hook(
        lambda _m, inputs, _o: captured.append(inputs[0].detach().clone())
    )
    try:
        rollouts = Rollouts(cfg, envs)
        chunks = [c for c in rollouts.collect(policy, steps) if c.terminated[-1] or c.truncated[-1]]
        if not chunks:
            raise SystemExit(f"no episode ended within --steps {steps}: give it more steps")
        feats, returns, steps_in, states = [], [], [], []
        for c in chunks:  # (each chunk is one whole episode: Rollouts starts at resets)
            obs = {k: torch.from_numpy(v) for k, v in c.obs.items()}
            with torch.no_grad():
                policy.evaluate(obs, torch.from_numpy(c.actions))
            feats.append(captured[-1])
            rewards = torch.from_numpy(c.rewards)
            ended = torch.zeros(len(rewards), dtype=torch.bool)
            ended[-1] = True  # the return stops at the episode's end, truncated or not
            _, ret = compute_gae(
                rewards, torch.zeros_like(rewards), 0.0, cfg.algo.gamma, 1.0, ended
            )
            returns.append(ret)
            steps_in.append(torch.arange(len(rewards), dtype=torch.float32)[:, None])
            if "state" in c.obs:
                states.append(torch.from_numpy(c.obs["state"]).float())
    finally:
        hook.remove()
    data = {
        "head input": torch.cat(feats).float(),
        "step": torch.cat(steps_in) / max(float(cfg.env.kwargs.get("max_episode_steps", 1)), 1),
        "returns": torch.cat(returns),
    }
    if states:
        data["privileged state"] = torch.cat(states)
    return data


def explained_variance(pred: torch.Tensor, target: torch.Tensor) -> float:
    return float(1.0 - (target - pred).var() / target.var())


def fit(x: torch.Tensor, y: torch.Tensor, hidden: int, lr: float, steps: int) -> dict[str, float]:
    """A fresh Linear-Tanh-Linear head on a fixed 80/20 split: explained variance on each."""
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=gen)
    train, test = order[: int(0.8 * len(y))], order[int(0.8 * len(y)) :]
    torch.manual_seed(1)
    head = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
    )
    optimizer = torch.optim.Adam(head.parameters(), lr=lr, eps=1e-5)
    for _ in range(steps):
        idx = train[torch.randint(len(train), (MINIBATCH,), generator=gen)]
        loss = 0.5 * ((head(x[idx]).squeeze(-1) - y[idx]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        v = head(x).squeeze(-1)
    return {
        "train_ev": explained_variance(v[train], y[train]),
        "test_ev": explained_variance(v[test], y[test]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = load_config(args.config, args.set)
    if args.smoke:  # (one episode each, at most)
        args.envs, args.fit_steps = 4, 20
        args.steps = int(cfg.env.kwargs.get("max_episode_steps", args.steps))
    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.run.seed)
    policy = build_policy(cfg)
    if cfg.policy.init_checkpoint:
        state = load_checkpoint(cfg.policy.init_checkpoint, torch.device("cpu"))["model"]
        policy.load_state_dict(state)
    policy.eval()
    started = time.perf_counter()
    data = collect(policy, cfg, args.envs, args.steps)
    returns = data["returns"]
    inputs = {"head input": data["head input"], "step": data["step"]}
    inputs["head input + step"] = torch.cat([data["head input"], data["step"]], 1)
    if "privileged state" in data:
        inputs["privileged state"] = data["privileged state"]
        inputs["privileged state + step"] = torch.cat([data["privileged state"], data["step"]], 1)
    hidden = getattr(getattr(cfg.policy, cfg.policy.kind, None), "value_hidden", 64) or 64
    lr = cfg.algo.value_lr or cfg.algo.lr
    fits = {name: fit(x, returns, hidden, lr, args.fit_steps) for name, x in inputs.items()}
    rows = [(name, r["train_ev"], r["test_ev"]) for name, r in fits.items()]
    print(
        f"{len(returns)} steps of whole episodes, returns mean {returns.mean():.2f} "
        f"std {returns.std():.2f}, {time.perf_counter() - started:.0f} s"
    )
    Table.from_layout(
        "value head input:<26 | explained variance, fitted steps:>33.3f | held-out steps:>15.3f"
    ).print(rows)
    result = {
        "args": vars(args),
        "steps": len(returns),
        "return_mean": float(returns.mean()),
        "return_std": float(returns.std()),
        "fits": fits,
    }
    write_result(args.json, "critic_probe", result, vars(args))
    return result


if __name__ == "__main__":
    main()
