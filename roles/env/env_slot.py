"""One env of a runner that steps envs one by one (``EnvRunner``, ``EvalRunner``): its episode
so far, its unsent transitions, and its resets, which a broken simulator may need again."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlvla3.algo.grpo import GroupRounds
from rlvla3.algo.number_limits import usable_obs
from roles.env.chunk_sink import ChunkStream, Transitions
from roles.env.policy_client import Act
from roles.env.role_counters import RoleCounters
from roles.env.sim_meter import SimMeter
from sim.env_group import EnvGroup

RESET_TRIES = 10
"""Resets in a row that may return an unusable observation (``rlvla3/algo/number_limits.py``)
before the env fails its worker."""


@dataclass(frozen=True, slots=True)
class Step:
    """One recorded transition of one env."""

    obs: dict[str, np.ndarray]
    """The observation acted on."""
    act: Act
    """The server's answer to it."""
    reward: float
    terminated: bool
    truncated: bool
    sim_steps: int = 1
    """Simulator steps it took (an action chunk's executed steps; ``reward`` is their sum)."""


def stacked(steps: list[Step]) -> Transitions:
    """``steps`` as a chunk's arrays."""
    return Transitions(
        obs={k: np.stack([s.obs[k] for s in steps]) for k in steps[0].obs},
        actions=np.stack([s.act.action for s in steps]),
        rewards=np.array([s.reward for s in steps], np.float32),
        terminated=np.array([s.terminated for s in steps], bool),
        truncated=np.array([s.truncated for s in steps], bool),
        log_probs=np.array([s.act.log_prob for s in steps], np.float32),
        values=np.array([s.act.value for s in steps], np.float32),
        policy_versions=np.array([s.act.version for s in steps], np.int64),
    )


class EnvSlot:
    """One env of a runner: its place in the runner's env group, its chunk stream, its current
    episode and the transitions not yet sent."""

    def __init__(self, position: int, stream: ChunkStream, group_rounds: GroupRounds | None):
        self.position = position  # its index in the runner's env group
        self.stream = stream
        # GRPO: each episode starts as a place in a group (its seed is the group's), and its
        # chunks carry the group (rlvla3/algo/grpo.py).
        self.group_rounds = group_rounds
        self.steps: list[Step] = []
        self.obs: dict[str, np.ndarray] = {}
        self.episode_return = 0.0
        self.episode_len = 0  # simulator steps (an action chunk counts its executed steps)
        self.versions = (0, 0)  # oldest and newest weight version of its current episode
        self.greedy = False  # every action of its current episode so far was greedy

    @property
    def env_index(self) -> int:
        """Its index in the worker."""
        return self.stream.env_index

    @property
    def grouped(self) -> bool:
        """Its episodes are GRPO group members."""
        return self.group_rounds is not None

    def start_episode(self, act: Act) -> None:
        """Its episode's bookkeeping starts from ``act``, the reply to its first observation."""
        self.versions = (act.version, act.version)
        self.greedy = act.greedy

    def add(self, step: Step) -> None:
        """Record one transition of its episode."""
        self.steps.append(step)
        self.episode_return += step.reward
        self.episode_len += step.sim_steps
        version = step.act.version
        self.versions = (min(self.versions[0], version), max(self.versions[1], version))
        self.greedy = self.greedy and step.act.greedy

    def next_group_seed(self) -> int:
        """Enter this env's next episode's group; return its reset seed, the same for every
        episode of the group."""
        assert self.group_rounds is not None
        self.stream.group, seed = self.group_rounds.start_episode(self.env_index)
        return seed


def reset_until_usable(
    slot: EnvSlot,
    envs: EnvGroup,
    meter: SimMeter,
    counters: RoleCounters,
    env_id: str,
    seed: int | None = None,
) -> dict[str, np.ndarray]:
    """Reset ``slot``'s env (``seed``: its next episode's), again (unseeded) while it returns a
    non-finite or absurdly large observation (a broken state); an env that keeps doing so fails
    its worker."""
    for _ in range(RESET_TRIES):
        # (a group's envs meet the same broken start state and all move on to the next)
        if slot.grouped:
            seed = slot.next_group_seed()
        with meter.inside():
            obs = envs.reset(slot.position, seed=seed)
        if usable_obs(obs):
            return obs
        counters.drop(
            "sim_faults",
            f"env {slot.env_index}: reset returned a non-finite or absurdly large observation; "
            "resetting again",
        )
        seed = None
    raise RuntimeError(
        f"env {slot.env_index} ({env_id}): {RESET_TRIES} resets in a "
        "row returned non-finite or absurdly large observations"
    )
