"""Eval env worker role: the env worker of periodic evaluation (``run.eval``).

Its envs play the same held-out episodes (reset seeds ``run.eval.seed`` onwards) each time the
eval rollout server starts a round with newer weights, and ask that server, which acts greedily,
for every action. When the round's ``run.eval.episodes`` episodes are done it records one point
(weight version, success rate, mean return, the run's env steps) to ``metrics.jsonl``
(``"kind": "eval"``), TensorBoard (``eval/``) and the run's ``evaluations`` series in Redis, and
marks the round finished so the server may take the next version. It pushes no chunks: nothing
it does reaches the trainer.

In a protocol evaluation (``run.eval.protocol``, what ``rlvla3 eval`` runs) its envs instead
play a benchmark's episode list, shared by every eval env worker of the run through Redis
(``roles/env/protocol_runner.py``); the launcher collects the results.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from rlvla3.runtime.eval_queue import EvalQueue
from rlvla3.runtime.keys import role_id
from rlvla3.runtime.metrics_log import MetricsLog
from rlvla3.runtime.role_main import main
from roles.env.env_slot import EnvSlot
from roles.env.eval_rounds import EvalRounds
from roles.env.eval_runner import EvalRunner
from roles.env.protocol_runner import ProtocolRunner, task_envs_factory
from roles.env.runner_thread import Runner
from roles.env_worker import EnvWorker


class EvalEnvWorker(EnvWorker):
    """Plays each evaluation round's held-out episodes on its envs and records the result."""

    name = "eval_env_worker"
    server_role = "eval_rollout_server"
    serves_training = False

    def setup(self) -> None:
        self.rounds = EvalRounds()
        self.metrics = self.own(MetricsLog(self.run_dir, self.registry, "eval", "evaluations"))
        super().setup()

    def runner(self, env_indices: list[int]) -> Runner:
        if self.cfg.run.eval.protocol:
            return self._protocol_runner(env_indices)
        slot = EnvSlot(0, self.chunk_stream(env_indices[0]), group_rounds=None)
        return EvalRunner(self.runner_parts(env_indices), slot, self.rounds, self.cfg.run.eval.seed)

    def _protocol_runner(self, env_indices: list[int]) -> Runner:
        cfg = self.cfg
        parts = dataclasses.replace(
            self.runner_parts(env_indices),
            make_envs=task_envs_factory(dict(cfg.env.kwargs), cfg.policy.action_steps),
        )
        return ProtocolRunner(
            parts,
            EvalQueue(self.registry),
            role_id(self.name, self.index),
            (self.run_dir / "videos", cfg.run.eval.videos),
            self.log,
        )

    def step(self) -> None:
        super().step()
        if self.cfg.run.eval.protocol:
            return  # the launcher collects a protocol's results
        round_, version, done = self.registry.eval_round()
        if round_ > self.rounds.round:
            self._start_round(round_, version, already_done=done >= round_)
        self._record_if_complete()

    def _start_round(self, round_: int, version: int, already_done: bool) -> None:
        episodes = 0 if already_done else self.cfg.run.eval.episodes
        if self.rounds.start(round_, version, episodes):
            self.count("eval_rounds_void")  # the server moved on before it was finished
        if episodes:
            self.log.info("evaluating v%d on %d held-out episodes", version, episodes)

    def _record_if_complete(self) -> None:
        done = self.rounds.collect(self.cfg.run.eval.episodes)
        if done is None:
            return
        results, version = done.results, done.version
        point: dict[str, Any] = {
            "kind": "eval",
            "version": version,
            "episodes": len(results),
            "mean_return": float(np.mean([r["return"] for r in results])),
            "mean_length": float(np.mean([r["length"] for r in results])),
            "env_steps": self.registry.counters().get("env_steps", 0),
            "t": time.time(),
        }
        if all("success" in r for r in results):
            point["success_rate"] = float(np.mean([r["success"] for r in results]))
        self.metrics.log(version, point)
        self.count("eval_rounds")
        self.registry.finish_eval_round(done.round)
        self.log.info(
            "evaluated v%d: success rate %s, mean return %.2f over %d episodes",
            version,
            f"{point['success_rate']:.2f}" if "success_rate" in point else "n/a",
            point["mean_return"],
            len(results),
        )


if __name__ == "__main__":
    main(EvalEnvWorker)
