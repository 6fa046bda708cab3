"""The runner of a group of separate envs (``env.envs_per_request``, one by default).

It asks a rollout server for the group's actions (one request per step), steps the envs,
records each env's transitions in its ``EnvSlot`` and cuts them into chunks of
``env.chunk_len`` transitions (shorter at an episode end) for the trainers. With action chunks
(``ActionChunkEnvs``) a step of the group executes each env's K actions, one transition each. Groups never wait for
each other, except in ``sync`` mode's lock-step (``Pacing``).
"""

from __future__ import annotations

from rlvla3.algo.number_limits import usable_number, usable_obs, usable_step
from roles.env.env_slot import EnvSlot, Step, reset_until_usable, stacked
from roles.env.episode_queue import FinishedEpisode
from roles.env.policy_client import Act
from roles.env.runner_thread import RunnerParts
from sim.adapter import Obs
from sim.env_group import EnvGroup, Stepped


class EnvRunner:
    """Request, step, record, push: one group of envs, independent of the worker's others."""

    def __init__(self, parts: RunnerParts, slots: list[EnvSlot], chunk_len: int) -> None:
        self.parts = parts
        self.slots = slots
        self.chunk_len = chunk_len
        """``env.chunk_len``: most transitions per chunk; in sync mode, steps per round."""

    def run(self, envs: EnvGroup) -> None:
        parts, slots = self.parts, self.slots
        self.envs = envs
        for slot in slots:
            slot.obs = self._reset(slot)
        acts = self._act()
        round_steps = 0
        while not parts.stop_event.is_set():
            results = parts.meter.step(envs.step, [act.env_action for act in acts])
            parts.meter.transitions(sum(res.sim_steps for res in results if not res.restarted))
            round_steps += 1
            ended = [
                (False, False) if res.restarted else self._record(slot, act, res)
                for slot, act, res in zip(slots, acts, results, strict=True)
            ]
            parts.pacing.after_step()  # lock-step: every env of the worker finished this step
            self._end_episodes(acts, results, ended)
            acts = self._act()
            round_over = parts.pacing.round_over(round_steps, self.chunk_len)
            for slot, act in zip(slots, acts, strict=True):
                if len(slot.steps) >= self.chunk_len or round_over:
                    self._push(slot, act.value)
            fresh = parts.pacing.hold(acts, round_over, self._act, _version)
            acts = acts if fresh is None else fresh
            if round_over:
                round_steps = 0

    def _act(self) -> list[Act]:
        """Actions for every env's current observation; an env that has not stepped in its
        episode yet starts it with their weight version."""
        acts = self.parts.client.act([slot.obs for slot in self.slots])
        for slot, act in zip(self.slots, acts, strict=True):
            if slot.episode_len == 0:
                slot.start_episode(act)
        return acts

    def _reset(self, slot: EnvSlot) -> Obs:
        parts = self.parts
        return reset_until_usable(slot, self.envs, parts.meter, parts.counters, parts.env_id)

    def _record(self, slot: EnvSlot, act: Act, res: Stepped) -> tuple[bool, bool]:
        """Record one env's step; returns (episode ended, by a simulator fault)."""
        reward, terminated, truncated = res.reward, res.terminated, res.truncated
        fault = not usable_step(res.obs, reward)
        if fault:  # a simulator blow-up (NaN, inf, 1e30): cut the episode here, as a truncation
            self.parts.counters.drop(
                "sim_faults",
                f"env {slot.env_index}: the simulator returned a "
                "non-finite (or absurdly large) observation or reward; episode cut there, env reset",
            )
            reward = reward if usable_number(reward) else 0.0
            terminated, truncated = False, True
        slot.add(Step(slot.obs, act, reward, terminated, truncated, res.sim_steps))
        return terminated or truncated, fault

    def _end_episodes(
        self, acts: list[Act], results: list[Stepped], ended: list[tuple[bool, bool]]
    ) -> None:
        """Push and record the episodes that ended this step and start the next ones; the rest
        move on to their next observation. Truncated episodes bootstrap from the value of their
        last observation, asked for in one request."""
        slots = self.slots
        truncated = [
            i
            for i, (done, fault) in enumerate(ended)
            if done and not fault and not slots[i].steps[-1].terminated
        ]
        values = {}
        if truncated:
            asked = self.parts.client.act([results[i].obs for i in truncated])
            values = {i: a.value for i, a in zip(truncated, asked, strict=True)}
        for i, (slot, act, res) in enumerate(zip(slots, acts, results, strict=True)):
            done, fault = ended[i]
            if not done:
                slot.obs = res.obs
                continue
            if slot.steps[-1].terminated:
                bootstrap = 0.0
            else:  # after a fault, the last finite observation's value stands in
                bootstrap = act.value if fault else values[i]
            self._push(slot, bootstrap)
            self._finish_episode(slot, res)

    def _finish_episode(self, slot: EnvSlot, res: Stepped) -> None:
        """Record ``slot``'s ended episode and give it its next one's first observation."""
        self.parts.episodes.record(
            FinishedEpisode(
                episode_return=slot.episode_return,
                length=slot.episode_len,
                success=res.info.get("success"),
                versions=slot.versions,
                greedy=slot.greedy,
            )
        )
        slot.episode_return, slot.episode_len = 0.0, 0
        if res.reset_obs is not None and not slot.grouped and usable_obs(res.reset_obs):
            slot.obs = res.reset_obs  # a vector env reset it already
        else:
            slot.obs = self._reset(slot)

    def _push(self, slot: EnvSlot, bootstrap_value: float) -> None:
        """Send ``slot``'s unsent transitions as its next chunk (dropped when not training)."""
        steps, slot.steps = slot.steps, []
        if steps and self.parts.sink.trains:
            self.parts.sink.push(slot.stream, stacked(steps), float(bootstrap_value))


def _version(acts: list[Act]) -> int:
    """The weight version of a group's actions (one request: one version)."""
    return acts[0].version
