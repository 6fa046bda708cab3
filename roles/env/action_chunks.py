"""Action chunks on the env side: a group of separate envs whose every action is K steps
(``policy.token_vla.action_steps``; docs/models.md, Action chunks).

One policy call is one transition, a macro-action: the env executes the chunk's steps in order
and stops at the step that ends its episode (a terminal state, a time limit, or a simulator
fault: a non-finite or absurdly large observation or reward), dropping the rest of the chunk. An episode that
ignores terminations (ManiSkill's fair evaluation, ``ignore_terminations``) plays on through a
terminal state to its time limit, so its chunks do too. The transition's reward is the sum of
the executed steps' rewards, its episode end and ``info`` the last executed step's, and
``Stepped.sim_steps`` says how many steps the simulator took, so that ``env_steps`` and episode
lengths count real simulator steps. A success on a step before the last is kept in
``info[SUCCESS_IN_CHUNK]`` (``info["success"]`` is the last step's). The runners record such a
transition like any other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlvla3.algo.number_limits import usable_step
from sim.adapter import Obs, SimAdapter
from sim.env_group import EnvGroup, SeparateEnvs, Stepped

SUCCESS_IN_CHUNK = "success_in_chunk"
"""``info`` key of a chunk's transition: whether any executed step reported ``success`` (set
when the env reports success at all)."""


class ActionChunkEnvs(EnvGroup):
    """A ``SeparateEnvs`` group stepped with action chunks of ``steps`` env actions each."""

    def __init__(self, envs: SeparateEnvs, steps: int, ignore_terminations: bool = False) -> None:
        self.envs = envs
        self.steps = steps
        """K: env actions per chunk (``action_steps``)."""
        self.ignore_terminations = ignore_terminations
        """Play a chunk on through a terminal state (its episode ends only at its time limit)."""
        self.size = envs.size
        self.observation_space = envs.observation_space

    def reset(self, i: int, seed: int | None = None) -> Obs:
        return self.envs.reset(i, seed=seed)

    def step(self, actions: list[Any]) -> list[Stepped]:
        """Execute each env's chunk (``[K, ...]``: ``K`` env actions) on its env, in order."""
        return [
            execute_chunk(env, chunk, self.steps, self.ignore_terminations)
            for env, chunk in zip(self.envs.envs, actions, strict=True)
        ]

    def close(self) -> None:
        self.envs.close()


def execute_chunk(
    env: SimAdapter, chunk: Any, steps: int, ignore_terminations: bool = False
) -> Stepped:
    """Step ``env`` with the ``steps`` env actions of ``chunk`` until its episode ends (through
    terminal states when ``ignore_terminations``); one ``Stepped`` for what was executed
    (reward summed, the last step's observation, end and info, a success of any step in
    ``info[SUCCESS_IN_CHUNK]``)."""
    chunk = np.asarray(chunk)
    if chunk.ndim < 1 or len(chunk) != steps:
        raise ValueError(
            f"an action chunk of {steps} steps has shape {list(chunk.shape)}, not [{steps}, ...]"
        )
    reward, executed, succeeded = 0.0, 0, None
    for action in chunk:
        obs, step_reward, terminated, truncated, info = env.step(action)
        reward += step_reward
        executed += 1
        if info.get("success") is not None:
            succeeded = bool(succeeded) or bool(info["success"])
        ended = terminated and not ignore_terminations
        if ended or truncated or not usable_step(obs, step_reward):
            break  # the rest of the chunk is dropped
    if succeeded is not None:
        info = {**info, SUCCESS_IN_CHUNK: succeeded}
    return Stepped(obs, reward, terminated, truncated, info, sim_steps=executed)
