"""Single-process synchronous PPO on CartPole-v1: a tuning aid for the distributed run's defaults.

Uses ``MLPPolicy`` + ``compute_gae`` + ``ppo_update`` exactly as the trainer does: each env's T-step
rollout is cut into chunks at episode ends, and each chunk is bootstrapped with 0 (terminated),
V(final obs) (truncated at 500 steps) or V(next obs) (cut by length). ``--lag K`` makes the envs act
with the weights from K updates ago, to mimic stale rollouts in the async run, and
``--correction truncated_is`` weights each sample's policy loss by min(pi/mu, 1) as the trainer can;
``--correction decoupled`` also clips the ratio around the pre-update policy instead of the
behaviour one (decoupled PPO, Hilton et al. 2021).

    python bench/ppo_cartpole_reference.py --seeds 0 1 2 [--lag 2 --post-solve-steps 50000]

Solved = mean return of the last 20 finished (stochastic, training) episodes >= 475. Measured on
a shared 2-core CPU, one torch thread, env steps until solved (CPU seconds), seeds 0..4:

- defaults (8 envs x 32 steps, 4 epochs x 64, lr 1e-3 const, gamma .98, lam .8, ent 0):
  29.7k (15 s), 34.0k (17 s), 46.3k (20 s), 26.4k (9 s), 42.2k (19 s); after solving, the
  last-20 mean stayed >= 475 for 50k more steps in 4 of 5 seeds (one dip to 216).
  With --lag 2: 46k-67k steps; with --lag 2 --correction truncated_is: 30k-57k.
- fastest, less stable: lr 2.5e-3: 24.3k (11 s), 25.3k, 24.8k, 29.7k, 31.7k (15 s); post-solve
  dip to 253 in 1 of 3 seeds at lag 0, and collapses (85-211) in 3 of 3 with --lag 2.
- cleanrl's CartPole settings (4 x 128, lr 2.5e-4 annealed, gamma .99, lam .95): 1 of 3 seeds
  solved within 150k steps (87k).
- decoupled clipping (around the pre-update policy) is worse than clipping against the behaviour
  log-probs under lag 2 (2 of 3 seeds unsolved in 120k at lr 1e-3).
"""

from __future__ import annotations

import collections
import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from harness.ppo_hyperparameters import ppo_hyperparameters
from harness.provenance import write_result
from harness.report import benchmark_parser

from rlvla3.algo.advantages import compute_gae, truncated_importance_weights
from rlvla3.algo.ppo import ppo_update
from rlvla3.policy.mlp import MLPPolicy


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Hyperparameters of one run (defaults are the tuned ones)."""

    num_envs: int = 8
    """CartPole envs stepped together."""
    rollout_len: int = 32
    """Steps of each env per rollout (T)."""
    epochs: int = 4
    """PPO epochs over each rollout."""
    minibatch_size: int = 64
    """Samples per minibatch."""
    lr: float = 1e-3
    """Adam's learning rate."""
    anneal_lr: bool = False
    """Decay the learning rate linearly, to 5% of ``lr`` after ``anneal_steps``."""
    anneal_steps: int = 150_000
    """Env steps of the decay."""
    gamma: float = 0.98
    """Discount."""
    lam: float = 0.8
    """GAE's lambda."""
    clip_coef: float = 0.2
    """PPO's ratio clip."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    max_grad_norm: float = 0.5
    """Gradient norm clip."""
    hidden: tuple[int, ...] = (64, 64)
    """The MLP's hidden layer sizes."""
    lag: int = 0
    """The envs act with the weights from this many updates ago (stale rollouts)."""
    correction: str = "none"
    """``none``, ``truncated_is`` or ``decoupled`` (see the module docstring)."""
    max_steps: int = 300_000
    """Env steps after which an unsolved run stops."""
    solve_return: float = 475.0
    """Mean return of the last ``solve_window`` finished episodes that counts as solved."""
    solve_window: int = 20
    """Finished episodes in that mean."""
    post_solve_steps: int = 0
    """Env steps trained on after solving, to see whether it stays solved."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """Outcome of one seed.

    ``env_steps``, ``wall_s``, ``cpu_s`` and ``updates`` are counted until solved (-1 steps if
    never); ``post_solve_min_return`` is the lowest last-20 mean over the ``post_solve_steps``
    after solving (inf if never solved).
    """

    seed: int
    solved: bool
    env_steps: int
    wall_s: float
    cpu_s: float
    updates: int
    post_solve_min_return: float


def _segments(done_row: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges of one env's rollout, cut after every done step."""
    ends = [int(t) + 1 for t in np.flatnonzero(done_row)]
    if not ends or ends[-1] != done_row.shape[0]:
        ends.append(done_row.shape[0])
    return list(zip([0] + ends[:-1], ends, strict=True))


def advantages_by_chunk(roll: dict[str, torch.Tensor], gamma: float, lam: float):
    """GAE per env and per episode chunk. ``roll`` holds [T, E] tensors; returns two [T, E]."""
    adv = torch.zeros_like(roll["rewards"])
    ret = torch.zeros_like(roll["rewards"])
    done = (roll["terminated"] | roll["truncated"]).numpy()
    for e in range(adv.shape[1]):
        for start, end in _segments(done[:, e]):
            last = end - 1
            if roll["terminated"][last, e]:
                bootstrap = 0.0
            elif roll["truncated"][last, e]:
                bootstrap = roll["final_values"][last, e]
            else:
                bootstrap = roll["next_value"][e]
            a, r = compute_gae(
                roll["rewards"][start:end, e], roll["values"][start:end, e], bootstrap, gamma, lam
            )
            adv[start:end, e], ret[start:end, e] = a, r
    return adv, ret


class Runner:
    """Steps the vector env with an acting policy and keeps episode statistics."""

    def __init__(self, envs: gym.vector.VectorEnv, seed: int) -> None:
        self.envs = envs
        self.obs, _ = envs.reset(seed=seed)
        self.ep_return = np.zeros(envs.num_envs)
        self.returns: collections.deque[float] = collections.deque(maxlen=100)
        self.env_steps = 0

    @torch.no_grad()
    def rollout(self, actor: MLPPolicy, length: int) -> dict[str, torch.Tensor]:
        """``length`` steps of every env; returns [T, E] tensors plus ``next_value`` [E]."""
        keys = ("obs", "actions", "log_probs", "values", "rewards", "terminated", "truncated")
        buf: dict[str, list] = {k: [] for k in (*keys, "final_values")}
        for _ in range(length):
            obs_t = torch.as_tensor(self.obs, dtype=torch.float32)
            out = actor.act({"state": obs_t})
            next_obs, reward, term, trunc, info = self.envs.step(out.action.numpy())
            final_values = torch.zeros(self.envs.num_envs)
            if trunc.any():
                final_obs = np.stack([o for o in info["final_obs"][trunc]]).astype(np.float32)
                final_values[trunc] = actor.act({"state": torch.as_tensor(final_obs)}).value
            for key, value in zip(keys, (obs_t, out.action, out.log_prob, out.value), strict=False):
                buf[key].append(value)
            buf["rewards"].append(torch.as_tensor(reward, dtype=torch.float32))
            buf["terminated"].append(torch.as_tensor(term))
            buf["truncated"].append(torch.as_tensor(trunc))
            buf["final_values"].append(final_values)
            self._track(reward, term | trunc)
            self.obs = next_obs
        roll = {k: torch.stack(v) for k, v in buf.items()}
        roll["next_value"] = actor.act({"state": torch.as_tensor(self.obs).float()}).value
        return roll

    def _track(self, reward: np.ndarray, done: np.ndarray) -> None:
        self.env_steps += self.envs.num_envs
        self.ep_return += reward
        for e in np.flatnonzero(done):
            self.returns.append(float(self.ep_return[e]))
            self.ep_return[e] = 0.0

    def mean_return(self, window: int) -> float:
        """Mean of the last ``window`` finished episodes (nan until ``window`` have finished)."""
        if len(self.returns) < window:
            return float("nan")
        return float(np.mean(list(self.returns)[-window:]))


def flatten(roll: dict[str, torch.Tensor], adv: torch.Tensor, ret: torch.Tensor) -> dict:
    """[T, E, ...] rollout -> the flat [N, ...] batch ``ppo_update`` expects."""
    return {
        "obs": {"state": roll["obs"].flatten(0, 1)},
        "actions": roll["actions"].flatten(0, 1),
        "log_probs": roll["log_probs"].flatten(0, 1),
        "values": roll["values"].flatten(0, 1),
        "advantages": adv.flatten(0, 1),
        "returns": ret.flatten(0, 1),
    }


def _make_envs(num_envs: int) -> gym.vector.VectorEnv:
    """CartPole-v1 vector env that resets in the same step and reports ``final_obs``."""
    return gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1")] * num_envs,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )


class Learner:
    """The policy, its optimizer, and the lagged copy of it that acts in the envs."""

    def __init__(self, s: Settings, seed: int) -> None:
        torch.manual_seed(seed)
        self.s, self.runner = s, Runner(_make_envs(s.num_envs), seed)
        self.policy = MLPPolicy(4, self.runner.envs.single_action_space, hidden_sizes=s.hidden)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=s.lr, eps=1e-5, foreach=True)
        self.history = collections.deque(
            [copy.deepcopy(self.policy.state_dict())], maxlen=s.lag + 1
        )
        self.actor = copy.deepcopy(self.policy)
        self.update_kwargs = dict(
            **ppo_hyperparameters(s), generator=torch.Generator().manual_seed(seed)
        )

    def iterate(self) -> dict[str, float]:
        """One rollout with the weights from ``lag`` updates ago, then one PPO update."""
        s = self.s
        if s.anneal_lr:
            frac = max(0.05, 1.0 - self.runner.env_steps / s.anneal_steps)
            self.optimizer.param_groups[0]["lr"] = s.lr * frac
        self.actor.load_state_dict(self.history[0])
        roll = self.runner.rollout(self.actor, s.rollout_len)
        batch = flatten(roll, *advantages_by_chunk(roll, s.gamma, s.lam))
        if s.correction != "none":
            with torch.no_grad():
                target = self.policy.evaluate(batch["obs"], batch["actions"]).log_prob
            batch["is_weights"] = truncated_importance_weights(batch["log_probs"], target)
            if s.correction == "decoupled":  # clip around the current policy, not the behaviour
                batch["log_probs"] = target
        metrics = ppo_update(self.policy, self.optimizer, batch, **self.update_kwargs)
        self.history.append(copy.deepcopy(self.policy.state_dict()))
        return metrics


def train(s: Settings, seed: int, verbose: bool = False) -> Result:
    """Run PPO until solved (+ ``post_solve_steps``) or ``s.max_steps``; report when it solved."""
    learner = Learner(s, seed)
    runner = learner.runner
    start, cpu_start = time.perf_counter(), time.process_time()
    updates, solved_at, post_min = 0, -1, float("inf")
    while runner.env_steps < s.max_steps:
        metrics = learner.iterate()
        updates += 1
        mean = runner.mean_return(s.solve_window)
        if verbose and updates % 20 == 0:
            print(f"steps {runner.env_steps} mean20 {mean:.1f} kl {metrics['approx_kl']:.4f}")
        if solved_at < 0 and mean >= s.solve_return:
            solved_at, solve_updates = runner.env_steps, updates
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if solved_at >= 0:
            post_min = min(post_min, mean)
            if runner.env_steps >= solved_at + s.post_solve_steps:
                break
    runner.envs.close()
    if solved_at < 0:
        wall, cpu, solve_updates = time.perf_counter() - start, time.process_time() - cpu_start, -1
    return Result(
        seed=seed,
        solved=solved_at >= 0,
        env_steps=solved_at,
        updates=solve_updates,
        wall_s=round(wall, 2),
        cpu_s=round(cpu, 2),
        post_solve_min_return=round(post_min, 1),
    )


def _parse() -> tuple[Settings, list[int], bool, Path | None]:
    """Settings from the command line (every ``Settings`` field is a flag)."""
    parser = benchmark_parser(__doc__, smoke_help="one seed, 2,000 env steps (CI)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--verbose", action="store_true")
    for name, default in asdict(Settings()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, type=lambda v: v.lower() in ("1", "true", "yes"))
        elif isinstance(default, tuple):
            parser.add_argument(flag, type=int, nargs="+")
        else:
            parser.add_argument(flag, type=type(default))
    args = vars(parser.parse_args())
    seeds, verbose, json_path = args.pop("seeds"), args.pop("verbose"), args.pop("json")
    if args.pop("smoke"):
        seeds, args["max_steps"] = seeds[:1], 2000
    overrides = {k: (tuple(v) if k == "hidden" else v) for k, v in args.items() if v is not None}
    return Settings(**overrides), seeds, verbose, json_path


def main() -> None:
    torch.set_num_threads(1)
    settings, seeds, verbose, json_path = _parse()
    print(json.dumps(asdict(settings)))
    results = []
    for seed in seeds:
        results.append(asdict(train(settings, seed, verbose)))
        print(json.dumps(results[-1]), flush=True)
    write_result(json_path, "ppo_cartpole_reference", {"seeds": results}, asdict(settings))


if __name__ == "__main__":
    main()
