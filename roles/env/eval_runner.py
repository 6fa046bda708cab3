"""The runner of an eval env worker's env: plays held-out episodes as the worker hands them out."""

from __future__ import annotations

from typing import Any

from rlvla3.algo.number_limits import usable_step
from roles.env.env_slot import EnvSlot, reset_until_usable
from roles.env.eval_rounds import EvalEpisode, EvalRounds
from roles.env.runner_thread import RunnerParts
from sim.env_group import EnvGroup


class EvalRunner:
    """Plays each episode of the current evaluation round it takes, acting with the round's
    weights only (an action from any other version voids the episode)."""

    def __init__(self, parts: RunnerParts, slot: EnvSlot, rounds: EvalRounds, seed: int):
        self.parts = parts
        self.slot = slot
        self.rounds = rounds
        self.seed = seed
        """Reset seed of each round's first episode (``run.eval.seed``)."""

    def run(self, envs: EnvGroup) -> None:
        self.envs = envs
        stop = self.parts.stop_event
        while not stop.is_set():
            episode = self.rounds.take()
            if episode is None:
                stop.wait(0.05)
                continue
            result = self._play(episode)
            if result is not None:
                self.rounds.finish(episode, result)
                self.parts.counters.count("eval_episodes")

    def _play(self, episode: EvalEpisode) -> dict[str, Any] | None:
        """Play one held-out episode; None if its round ended or its weights changed."""
        parts = self.parts
        seed = self.seed + episode.index
        obs = reset_until_usable(
            self.slot, self.envs, parts.meter, parts.counters, parts.env_id, seed
        )
        total, length = 0.0, 0
        while True:
            act = parts.client.act([obs])[0]
            if act.version != episode.version or not self.rounds.still_current(episode):
                return None
            with parts.meter.inside():
                res = self.envs.step([act.env_action])[0]
            parts.counters.count("eval_env_steps", res.sim_steps)
            obs = res.obs
            total += res.reward
            length += res.sim_steps
            if not usable_step(obs, res.reward):  # a simulator blow-up: the episode ends, failed
                return {"return": total, "length": length, "success": False}
            if res.terminated or res.truncated:
                result: dict[str, Any] = {"return": total, "length": length}
                if res.info.get("success") is not None:
                    result["success"] = bool(res.info["success"])
                return result
