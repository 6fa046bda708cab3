"""Benchmark evaluation protocols: the exact list of episodes an evaluation plays, built before
anything runs (``rlvla3 eval``; docs/evaluation.md).

- LIBERO (:func:`libero_protocol`): every task of a suite, one episode per fixed initial state
  (``get_task_init_states``; 50 per task, episode ``k`` starts from state ``k``), the suite's
  step limit and 10 settle steps of a still, open-gripper action before the policy acts, as
  openpi's ``examples/libero/main.py`` evaluates (``max_steps``, ``num_steps_wait``).
- ManiSkill3 (:func:`maniskill_protocol`): ManiSkill's documented fair evaluation: no episode
  ends on success or failure (``ignore_terminations``), each runs the task's full
  ``max_episode_steps``, scenes are rebuilt on every reset (``reconfiguration_freq=1``), reset
  seeds ``seed``, ``seed + 1``, ...; the headline is ``success_once`` (``success_at_end`` is
  kept too).
- Any other env id (the table-top task, gymnasium ids; :func:`seeded_protocol`): ``N``
  episodes from reset seeds ``seed`` .. ``seed + N - 1``, ending as the env ends them.

Every episode's outcome depends only on its env id, reset seed (for LIBERO: its initial state)
and the policy's weights, so how many workers play them changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sim.libero import SUITES, parse_env_id

LIBERO_SETTLE_STEPS = 10
"""Still, open-gripper steps after each LIBERO reset, neither acted by the policy nor counted
(openpi's ``num_steps_wait``)."""
LIBERO_EPISODES_PER_TASK = 50
"""Episodes per LIBERO task: one per fixed initial state (openpi's ``num_trials_per_task``)."""
MANISKILL_EPISODES = 100
"""Default ManiSkill3 episode count (ManiSkill prescribes none; its examples use 8-64 envs)."""
SEEDED_EPISODES = 50
"""Default episode count of the table-top task and gymnasium ids."""

OPENPI_LIBERO = "openpi examples/libero/main.py (max_steps per suite, num_steps_wait=10)"
MANISKILL_DOCS = (
    "ManiSkill docs, user_guide/reinforcement_learning/setup.md#evaluation "
    "(ignore_terminations=True, reconfiguration_freq=1, success_once / success_at_end)"
)


_MISSING = object()


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtocolEpisode:
    """One episode of a protocol: everything a worker needs to play it, alone."""

    index: int
    """Its place in the protocol (0-based); videos record the first ``K``."""
    key: str
    """Its unique name, ``ENV_ID#SEED``: what resuming matches finished episodes by."""
    env_id: str
    """The env it plays (``sim.envs.make_env``), e.g. ``libero/libero_spatial/3``."""
    task: str
    """The task's name (a LIBERO task's name, else the env id)."""
    seed: int
    """Its reset seed (LIBERO: the index of its fixed initial state)."""
    init_state: int | None
    """LIBERO: the index of its fixed initial state; None elsewhere."""
    max_steps: int | None
    """Env (simulator) steps after which it is cut, settle steps not counted; an action chunk
    of K actions is K of them (None: the env's own limit)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Env options the protocol sets over the run's ``env.kwargs`` (step limit, settle steps)."""
    ignore_terminations: bool = False
    """Play on after ``terminated`` until truncation (ManiSkill's fair evaluation)."""

    def identity(self) -> dict[str, Any]:
        """What names it in its result record (``episodes.jsonl``)."""
        names = ("index", "key", "task", "env_id", "seed", "init_state")
        return {name: getattr(self, name) for name in names}

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON), as workers receive it."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: Any) -> ProtocolEpisode:
        """The episode ``to_dict`` wrote.

        Raises:
            ValueError: not such data (the message names the field).
        """
        if not isinstance(data, dict):
            raise ValueError(f"a protocol episode is a mapping, got {type(data).__name__}")
        for name, kinds in _FIELD_TYPES.items():
            if type(data.get(name, _MISSING)) not in kinds:  # (exact: a bool is no int here)
                raise ValueError(f"protocol episode field {name!r}: bad or missing value")
        unknown = set(data) - set(_FIELD_TYPES)
        if unknown:
            raise ValueError(f"protocol episode: unknown fields {sorted(unknown)}")
        return cls(**data)


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "index": (int,),
    "key": (str,),
    "env_id": (str,),
    "task": (str,),
    "seed": (int,),
    "init_state": (int, type(None)),
    "max_steps": (int, type(None)),
    "env_kwargs": (dict,),
    "ignore_terminations": (bool,),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Protocol:
    """A benchmark's evaluation: its episodes and how they are scored."""

    name: str
    """What is evaluated, e.g. ``libero_spatial`` or ``maniskill/PickCube-v1``."""
    success_metric: str
    """The headline per episode: ``success_once`` (succeeded at some step; LIBERO and the
    table-top task end an episode on success, so there it is also its last step's)."""
    reference: str
    """Where the protocol's numbers come from."""
    episodes: tuple[ProtocolEpisode, ...]
    """Every episode, in order."""

    def describe(self) -> dict[str, Any]:
        """The protocol without its episodes (the results JSON's ``protocol``)."""
        return {
            "name": self.name,
            "success_metric": self.success_metric,
            "reference": self.reference,
            "episodes": len(self.episodes),
            "tasks": len({e.task for e in self.episodes}),
        }


def file_safe(text: str, fill: str = "-", limit: int = 80) -> str:
    """``text`` as part of a file or run name: letters, digits, ``-``, ``_`` and ``.`` kept,
    anything else (the ``/`` of an env id, a space) ``fill``; at most ``limit`` long."""
    return "".join(c if c.isalnum() or c in "-_." else fill for c in text)[:limit]


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` over it, nested mappings merged too (ManiSkill's ``env_kwargs``)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def libero_protocol(
    suite: str,
    episodes_per_task: int = LIBERO_EPISODES_PER_TASK,
    tasks: list[int] | None = None,
) -> Protocol:
    """Every task of LIBERO ``suite`` (or only ``tasks``) times its first ``episodes_per_task``
    fixed initial states, read from LIBERO's benchmark (nothing is rendered).

    Raises:
        ValueError: an unknown suite or task index.
        SimulatorNotInstalledError: LIBERO is not installed.
    """
    from sim.libero_setup import import_libero

    if suite not in SUITES:
        raise ValueError(f"unknown LIBERO suite {suite!r}; known: {sorted(SUITES)}")
    benchmark, _, _ = import_libero()
    task_suite = benchmark.get_benchmark_dict()[suite]()
    num_tasks, max_steps = task_suite.n_tasks, SUITES[suite][1]
    chosen = list(range(num_tasks)) if tasks is None else tasks
    bad = [t for t in chosen if not 0 <= t < num_tasks]
    if bad:
        raise ValueError(f"{suite} has tasks 0..{num_tasks - 1}, not {bad}")
    kwargs = {"max_episode_steps": max_steps, "num_settle_steps": LIBERO_SETTLE_STEPS}
    episodes = []
    for task_index in chosen:
        name = task_suite.get_task(task_index).name
        states = len(task_suite.get_task_init_states(task_index))
        env_id = f"libero/{suite}/{task_index}"
        for state in range(min(episodes_per_task, states)):
            episodes.append(
                ProtocolEpisode(
                    index=len(episodes),
                    key=f"{env_id}#{state}",
                    env_id=env_id,
                    task=name,
                    seed=state,
                    init_state=state,
                    max_steps=max_steps,
                    env_kwargs=dict(kwargs),
                )
            )
    # one task's evaluation is named after it: its default --out is not the whole suite's
    name = suite if tasks is None else suite + "".join(f"/{t}" for t in tasks)
    return Protocol(
        name=name, success_metric="success_once", reference=OPENPI_LIBERO, episodes=tuple(episodes)
    )


def maniskill_protocol(env_id: str, episodes: int = MANISKILL_EPISODES, seed: int = 0) -> Protocol:
    """ManiSkill's fair evaluation of ``maniskill/<Task>`` (see the module docstring)."""
    protocol = seeded_protocol(env_id, episodes, seed)
    played = tuple(
        ProtocolEpisode(
            **(
                e.to_dict()
                | {
                    "env_kwargs": {"env_kwargs": {"reconfiguration_freq": 1}},
                    "ignore_terminations": True,
                }
            )
        )
        for e in protocol.episodes
    )
    return Protocol(
        name=env_id, success_metric="success_once", reference=MANISKILL_DOCS, episodes=played
    )


def seeded_protocol(env_id: str, episodes: int = SEEDED_EPISODES, seed: int = 0) -> Protocol:
    """``episodes`` episodes of ``env_id`` from reset seeds ``seed`` onwards."""
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    played = tuple(
        ProtocolEpisode(
            index=k,
            key=f"{env_id}#{seed + k}",
            env_id=env_id,
            task=env_id,
            seed=seed + k,
            init_state=None,
            max_steps=None,
        )
        for k in range(episodes)
    )
    return Protocol(
        name=env_id,
        success_metric="success_once",
        reference=f"{episodes} episodes, reset seeds {seed}..{seed + episodes - 1}",
        episodes=played,
    )


def protocol_for(
    *, suite: str | None, env_id: str, episodes: int | None, seed: int = 0
) -> Protocol:
    """The protocol ``rlvla3 eval`` plays: a LIBERO ``suite`` (``episodes``: per task), else by
    ``env_id``'s kind (``episodes``: in all)."""
    if suite is not None:
        return libero_protocol(suite, episodes or LIBERO_EPISODES_PER_TASK)
    if env_id.startswith("libero/"):  # one LIBERO task: its suite's protocol, that task only
        suite_name, task = parse_env_id(env_id)
        return libero_protocol(suite_name, episodes or LIBERO_EPISODES_PER_TASK, [task])
    if env_id.startswith("maniskill/"):
        return maniskill_protocol(env_id, episodes or MANISKILL_EPISODES, seed)
    return seeded_protocol(env_id, episodes or SEEDED_EPISODES, seed)
