"""Eval env worker role: the env worker of periodic evaluation (``run.eval``).

Its envs play the same held-out episodes (reset seeds ``run.eval.seed`` onwards) each time the
eval rollout server starts a round with newer weights, and ask that server, which acts greedily,
for every action. When the round's ``run.eval.episodes`` episodes are done it records one point
(weight version, success rate, mean return, the run's env steps) to ``metrics.jsonl``
(``"kind": "eval"``), TensorBoard (``eval/``) and the run's ``evaluations`` series in Redis, and
marks the round finished so the server may take the next version. It pushes no chunks: nothing
it does reaches the trainer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlvla3.runtime.metrics_log import MetricsLog
from rlvla3.runtime.role import main
from roles.env_runner import EnvRunner, _finite
from roles.env_worker import EnvWorker


@dataclass(frozen=True, slots=True)
class EvalEpisode:
    """One held-out episode to play: its round, the weights it must be acted on by, its index."""

    round: int
    version: int
    index: int


class EvalEnvWorker(EnvWorker):
    """Plays each evaluation round's held-out episodes on its envs and records the result."""

    name = "eval_env_worker"
    server_role = "eval_rollout_server"
    serves_training = False

    def setup(self) -> None:
        self.round_lock = threading.Lock()
        self.round, self.round_version = 0, -1
        self.round_open = False  # the current round's result is still to be recorded
        self.todo: deque[EvalEpisode] = deque()
        self.results: dict[int, dict[str, Any]] = {}
        self.metrics = self.own(MetricsLog(self.run_dir, self.registry, "eval", "evaluations"))
        super().setup()

    def runner(self, env_indices: list[int]) -> EnvRunner:
        return EvalRunner(self, env_indices)

    def step(self) -> None:
        super().step()
        round_, version, done = self.registry.eval_round()
        if round_ > self.round:
            self._start_round(round_, version, already_done=done >= round_)
        self._record_if_complete()

    def _start_round(self, round_: int, version: int, already_done: bool) -> None:
        with self.round_lock:
            if self.round_open:
                self.count("eval_rounds_void")  # the server moved on before it was finished
            self.round, self.round_version = round_, version
            self.results = {}
            episodes = 0 if already_done else self.cfg.run.eval.episodes
            self.round_open = episodes > 0
            self.todo = deque(EvalEpisode(round_, version, k) for k in range(episodes))
        if episodes:
            self.log.info("evaluating v%d on %d held-out episodes", version, episodes)

    def take_episode(self) -> EvalEpisode | None:
        """The next episode of the current round to play, or None when there is none now."""
        with self.round_lock:
            return self.todo.popleft() if self.todo else None

    def still_current(self, episode: EvalEpisode) -> bool:
        """Whether ``episode``'s round is still the one being evaluated."""
        return episode.round == self.round

    def episode_done(self, episode: EvalEpisode, result: dict[str, Any]) -> None:
        """Record one finished episode of ``episode.round`` (dropped if that round is over)."""
        with self.round_lock:
            if episode.round == self.round:
                self.results[episode.index] = result
        self.count("eval_episodes")

    def _record_if_complete(self) -> None:
        wanted = self.cfg.run.eval.episodes
        with self.round_lock:
            if not self.round_open or len(self.results) < wanted:
                return
            results, round_, version = list(self.results.values()), self.round, self.round_version
            self.results, self.round_open = {}, False
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
        self.registry.finish_eval_round(round_)
        self.log.info(
            "evaluated v%d: success rate %s, mean return %.2f over %d episodes",
            version,
            f"{point['success_rate']:.2f}" if "success_rate" in point else "n/a",
            point["mean_return"],
            len(results),
        )


class EvalRunner(EnvRunner):
    """One env of the eval worker: plays held-out episodes as the worker hands them out."""

    worker: EvalEnvWorker

    def _loop(self) -> None:
        w = self.worker
        while not w.stop_event.is_set():
            episode = w.take_episode()
            if episode is None:
                w.stop_event.wait(0.05)
                continue
            result = self._play(episode)
            if result is not None:
                w.episode_done(episode, result)

    def _play(self, episode: EvalEpisode) -> dict[str, Any] | None:
        """Play one held-out episode; None if its round ended or its weights changed."""
        w, slot = self.worker, self.slots[0]
        obs = self._reset(slot, seed=w.cfg.run.eval.seed + episode.index)
        total, length = 0.0, 0
        while True:
            act = self._request([obs])[0]
            if act.version != episode.version or not w.still_current(episode):
                return None
            self.sim_since = time.time()
            res = self.group.step([act.env_action])[0]
            self.sim_since = 0.0
            w.count("eval_env_steps")
            obs = res.obs
            total += res.reward
            length += 1
            if not _finite(obs, res.reward):  # a simulator blow-up ends the episode, unsuccessful
                return {"return": total, "length": length, "success": False}
            if res.terminated or res.truncated:
                result: dict[str, Any] = {"return": total, "length": length}
                if res.info.get("success") is not None:
                    result["success"] = bool(res.info["success"])
                return result


if __name__ == "__main__":
    main(EvalEnvWorker)
