"""The thread of one env group: makes its simulators, opens its runner's sockets, runs the
runner's loop, and keeps the error that ended it for the worker's main loop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from rlvla3.config.run_config import Config
from roles.env.action_chunks import ActionChunkEnvs
from roles.env.chunk_sink import ChunkSink
from roles.env.episode_queue import EpisodeQueue
from roles.env.pacing import Pacing
from roles.env.policy_client import PolicyClient
from roles.env.role_counters import RoleCounters
from roles.env.sim_meter import SimMeter
from sim.env_group import EnvGroup, SeparateEnvs, VectorEnvs
from sim.envs import make_env
from sim.straggler import StragglerConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerParts:
    """What every runner is a loop over. The worker builds them; the runner's thread makes the
    simulators and opens the sockets. (An evaluation runner pushes no chunks and records no
    training episodes: its worker's sink and pacing stay idle.)"""

    env_indices: list[int]
    """The group's envs (indices in the worker)."""
    make_envs: Callable[[], EnvGroup]
    """Makes the group's simulators (in the thread that steps them)."""
    client: PolicyClient
    sink: ChunkSink
    meter: SimMeter
    pacing: Pacing
    """The worker's pauses (lock-step, weight rounds, back-pressure), shared by its runners."""
    episodes: EpisodeQueue
    """Where finished episodes go (the worker writes them to the run's learning curve)."""
    counters: RoleCounters
    stop_event: threading.Event
    env_id: str
    """``env.id`` (names the simulator in errors)."""


class Runner(Protocol):
    """A loop over ``parts``: steps the group's envs until the stop."""

    parts: RunnerParts

    def run(self, envs: EnvGroup) -> None: ...


class RunnerThread:
    """Runs one ``Runner`` on its own daemon thread."""

    def __init__(self, runner: Runner, log: logging.Logger) -> None:
        self.runner = runner
        self.log = log
        envs = runner.parts.env_indices
        self.env_index = envs[0]
        """The group's first env (names it in logs and stall reports)."""
        name = f"env-{envs[0]}" if len(envs) == 1 else f"envs-{envs[0]}+"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None
        """What ended the loop, other than the stop (the worker's main loop fails the role)."""

    @property
    def sim_since(self) -> float:
        """Wall time its envs entered a simulator call; 0: not inside one."""
        return self.runner.parts.meter.since

    def _run(self) -> None:
        parts = self.runner.parts
        envs = parts.make_envs()
        parts.client.open()
        parts.sink.open()
        try:
            self.runner.run(envs)
        except (InterruptedError, threading.BrokenBarrierError):
            pass
        except BaseException as err:  # reported by the worker's main loop, which fails the role
            self.log.exception("env %d failed", self.env_index)
            self.error = err
        finally:
            # the sink first, and each on its own: a simulator that fails to close must not
            # leave the chunk socket open (the worker's exit waits for it)
            for part, close in (
                ("chunk sink", parts.sink.close),
                ("policy client", parts.client.close),
                ("envs", envs.close),
            ):
                try:
                    close()
                except Exception:
                    self.log.exception("env %d: closing its %s failed", self.env_index, part)


def make_env_group(
    cfg: Config, worker_index: int, env_indices: list[int], vector: bool
) -> EnvGroup:
    """The simulators of envs ``env_indices`` of worker ``worker_index``, seeded apart from
    every other env of the run: one vector env (``vector``) or one simulator each (stepped
    with action chunks when ``policy.action_steps`` is above 1)."""
    env = cfg.env
    base = cfg.run.seed + 10_000 * worker_index
    if vector:
        return VectorEnvs(env.id, len(env_indices), seed=base + env_indices[0], **env.kwargs)
    sims = []
    for env_index in env_indices:
        seed = base + env_index
        sims.append(make_env(env.id, seed=seed, straggler=_straggler(cfg, seed), **env.kwargs))
    if cfg.policy.action_steps > 1:  # each action is a chunk of K env actions
        return ActionChunkEnvs(SeparateEnvs(sims), cfg.policy.action_steps)
    return SeparateEnvs(sims)


def _straggler(cfg: Config, seed: int) -> StragglerConfig | None:
    s = cfg.env.straggler
    if s.distribution == "none":
        return None
    return StragglerConfig(distribution=s.distribution, mean_ms=s.mean_ms, sigma=s.sigma, seed=seed)
