"""RL probe: synchronous PPO of a launch YAML's policy in one process, for fast tuning.

Reads the same YAML as ``rlvla3 launch`` (``env``, ``policy``, ``algo``, ``run.seed``; ``--set``
overrides as there) and runs the trainer's own code path (``build_policy``, ``build_batch``,
``ppo_update``, ``build_optimizer``, ``policy.init_checkpoint`` and the KL reference) on ``env.num_envs_per_worker * roles.env_worker.count`` envs
stepped as one batch in this process, ``env.chunk_len`` steps per round, one update per round: no
processes, sockets or staleness, so it isolates *learning* from *system* throughput. Every
``--report-every`` updates it prints the success rate of the last 100 finished (sampled-action)
episodes; at the end it measures the greedy policy on ``--eval-episodes`` fresh episodes.

    python bench/rl_tabletop_probe.py launch/vla_tabletop.yaml --max-train-s 600 \
        [--set algo.lr=0.001] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from typing import Any

import numpy as np
import torch
from harness.provenance import write_result
from harness.report import benchmark_parser, point_line
from harness.tabletop_eval import evaluate

from rlvla3.algo.batch import build_batch
from rlvla3.algo.learners import Objective
from rlvla3.algo.optim import build_optimizer
from rlvla3.algo.ppo import frozen_reference
from rlvla3.config.run_config import Config, load_config
from rlvla3.policy.factory import build_policy
from rlvla3.runtime.checkpoints import load_checkpoint
from sim.envs import make_env
from transport.messages import TrajectoryChunk


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, smoke_help="a few seconds of training, for CI")
    p.add_argument("config", help="launch YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--max-train-s", type=float, default=600.0, help="wall time of the RL loop")
    p.add_argument("--report-every", type=int, default=20)
    p.add_argument("--eval-episodes", type=int, default=100)
    p.add_argument("--eval-seed", type=int, default=2_000_000)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument(
        "--log-std",
        type=float,
        help="what-if: set the Gaussian head's log-std to this before RL (default: as loaded)",
    )
    return p.parse_args(argv)


class Rollouts:
    """``n`` envs stepped as one batch; ``collect`` returns one ``TrajectoryChunk`` per env."""

    def __init__(self, cfg: Config, n: int) -> None:
        self.envs = [
            make_env(cfg.env.id, seed=cfg.run.seed + i, **cfg.env.kwargs) for i in range(n)
        ]
        self.obs = [env.reset(seed=cfg.run.seed + i)[0] for i, env in enumerate(self.envs)]
        self.returns, self.lengths = np.zeros(n), np.zeros(n, int)
        self.finished: deque[tuple[float, bool]] = deque(maxlen=100)
        self.env_steps = 0

    def _batch(self) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(np.stack([o[k] for o in self.obs])) for k in self.obs[0]}

    @torch.no_grad()
    def collect(self, policy: Any, steps: int) -> list[TrajectoryChunk]:
        n = len(self.envs)
        rec: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        chunks: list[TrajectoryChunk] = []
        for _ in range(steps):
            batch = self._batch()
            out = policy.act(batch)
            env_actions = policy.to_env_action(out.action).numpy()
            for i, env in enumerate(self.envs):
                obs, reward, term, trunc, info = env.step(env_actions[i])
                self.env_steps += 1
                rec[i].append(
                    {
                        "obs": {k: v[i].numpy() for k, v in batch.items()},
                        "action": out.action[i].numpy(),
                        "reward": reward,
                        "term": term,
                        "trunc": trunc,
                        "log_prob": float(out.log_prob[i]),
                        "value": float(out.value[i]),
                    }
                )
                self.returns[i] += reward
                self.lengths[i] += 1
                if term or trunc:
                    self.finished.append((self.returns[i], bool(info.get("success", False))))
                    self.returns[i], self.lengths[i] = 0.0, 0
                    boot = 0.0 if term else float(policy.act(_one(obs)).value[0])
                    chunks.append(_chunk(rec[i], boot))
                    rec[i] = []
                    obs, _ = env.reset()
                self.obs[i] = obs
        last = policy.act(self._batch()).value
        chunks += [_chunk(r, float(last[i])) for i, r in enumerate(rec) if r]
        return chunks


def _one(obs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v[None]) for k, v in obs.items()}


def _chunk(steps: list[dict[str, Any]], bootstrap: float) -> TrajectoryChunk:
    return TrajectoryChunk(
        worker_index=0,
        env_index=0,
        chunk_id=0,
        obs={k: np.stack([s["obs"][k] for s in steps]) for k in steps[0]["obs"]},
        actions=np.stack([s["action"] for s in steps]),
        rewards=np.array([s["reward"] for s in steps], np.float32),
        terminated=np.array([s["term"] for s in steps], bool),
        truncated=np.array([s["trunc"] for s in steps], bool),
        log_probs=np.array([s["log_prob"] for s in steps], np.float32),
        values=np.array([s["value"] for s in steps], np.float32),
        policy_versions=np.zeros(len(steps), np.int64),
        bootstrap_value=bootstrap,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.smoke:
        args.max_train_s, args.eval_episodes, args.report_every = 3.0, 2, 1
    cfg = load_config(args.config, args.set)
    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.run.seed)
    policy = build_policy(cfg)
    if cfg.policy.init_checkpoint:  # as the trainer does without a checkpoint of its own
        policy.load_state_dict(
            load_checkpoint(cfg.policy.init_checkpoint, torch.device("cpu"))["model"]
        )
    if args.log_std is not None:
        with torch.no_grad():
            policy.log_std.fill_(args.log_std)
    a = cfg.algo
    optimizer = build_optimizer(policy, a)
    objective = Objective(a, vf_coef=a.vf_coef, norm_adv=True)  # the trainer's PPO update
    reference = None
    if cfg.policy.init_checkpoint and a.ref_kl_coef > 0:  # the trainer's frozen KL reference
        reference = frozen_reference(policy)  # (it holds the init weights now)
    workers = max(cfg.num_processes("env_worker"), 1)
    rollouts = Rollouts(cfg, workers * cfg.env.num_envs_per_worker)
    started, updates, curve = time.perf_counter(), 0, []
    act_s = train_s = 0.0
    while time.perf_counter() - started < args.max_train_s:
        t0 = time.perf_counter()
        chunks = rollouts.collect(policy, cfg.env.chunk_len)
        t1 = time.perf_counter()
        batch = build_batch(chunks, policy, a, torch.device("cpu"))
        metrics = objective.update(
            policy,
            optimizer,
            batch,
            policy_coef=0.0 if updates < a.value_warmup_updates else 1.0,
            reference=reference,
        )
        act_s += t1 - t0
        train_s += time.perf_counter() - t1
        updates += 1
        if updates % args.report_every == 0 and rollouts.finished:
            done = list(rollouts.finished)
            point = {
                "update": updates,
                "wall_s": round(time.perf_counter() - started, 1),
                "env_steps": rollouts.env_steps,
                "act_s": round(act_s, 1),
                "train_s": round(train_s, 1),
                "success": float(np.mean([s for _, s in done])),
                "return": float(np.mean([r for r, _ in done])),
                "entropy": metrics["entropy"],
                "ev": metrics["explained_variance"],
                "kl": metrics["approx_kl"],
            }
            curve.append(point)
            print(point_line(point), flush=True)
    ev = evaluate(policy, cfg.env.id, args.eval_episodes, args.eval_seed, kwargs=cfg.env.kwargs)
    print(f"greedy eval on {args.eval_episodes} fresh episodes: {ev}", flush=True)
    result = {
        "args": vars(args),
        "curve": curve,
        "eval": ev,
        "updates": updates,
        "env_steps": rollouts.env_steps,
    }
    write_result(args.json, "rl_tabletop_probe", result, vars(args))
    return result


if __name__ == "__main__":
    main()
