"""The runner of an eval env worker's env in a protocol evaluation (``rlvla3 eval``): takes the
protocol's episodes one at a time from the run's shared list (``EvalQueue``), plays each from
its own reset seed with the env it names, and records its result (and, for the first
``run.eval.videos`` episodes, a GIF of what the policy saw)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rlvla3.algo.number_limits import usable_obs, usable_step
from rlvla3.runtime.eval_queue import EvalQueue
from roles.env.action_chunks import SUCCESS_IN_CHUNK, ActionChunkEnvs
from roles.env.runner_thread import RunnerParts
from sim.adapter import Obs
from sim.env_group import EnvGroup, SeparateEnvs, Stepped
from sim.envs import make_env
from sim.protocols import ProtocolEpisode, file_safe, merged

_IDLE_S = 0.2  # how often a runner with nothing to play looks at the list again
VIDEO_FPS = 20


class TaskEnvs(EnvGroup):
    """One env at a time, made for the env id and options each episode names (and kept while
    the next episode names the same: a LIBERO env takes seconds to build)."""

    def __init__(self, base_kwargs: dict[str, Any], action_steps: int) -> None:
        self.base_kwargs = base_kwargs
        """``env.kwargs`` of the run, under the protocol's own options."""
        self.action_steps = action_steps
        self.size = 1
        self._made: tuple[str, str, bool] | None = None
        self._group: EnvGroup | None = None

    def use(self, episode: ProtocolEpisode) -> None:
        """Make ``episode``'s env current, building it unless it already is."""
        kwargs = merged(self.base_kwargs, episode.env_kwargs)
        made = (episode.env_id, repr(sorted(kwargs.items())), episode.ignore_terminations)
        if made == self._made:
            return
        self.close()
        group: EnvGroup = SeparateEnvs([make_env(episode.env_id, seed=episode.seed, **kwargs)])
        if self.action_steps > 1:
            group = ActionChunkEnvs(group, self.action_steps, episode.ignore_terminations)
        self._group, self._made = group, made
        self.observation_space = group.observation_space

    def reset(self, i: int, seed: int | None = None) -> Obs:
        assert self._group is not None, "use() an episode's env first"
        return self._group.reset(i, seed=seed)

    def step(self, actions: list[Any]) -> list[Stepped]:
        assert self._group is not None, "use() an episode's env first"
        return self._group.step(actions)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._made = None, None


class ProtocolRunner:
    """Plays protocol episodes until the worker stops (see the module docstring)."""

    def __init__(
        self,
        parts: RunnerParts,
        queue: EvalQueue,
        worker: str,
        videos: tuple[Path, int],
        log: logging.Logger,
    ) -> None:
        self.parts = parts
        self.queue = queue
        self.worker = worker
        """This worker's role id (``eval_env_worker/0``), in claims and results."""
        self.video_dir, self.num_videos = videos
        self.log = log

    def run(self, envs: EnvGroup) -> None:
        assert isinstance(envs, TaskEnvs)
        stop = self.parts.stop_event
        while not stop.is_set():
            claim = self.queue.take(self.worker, os.getpid())
            if claim is None:
                stop.wait(_IDLE_S)
                continue
            try:
                episode = ProtocolEpisode.from_dict(claim.data())
            except ValueError as err:  # not what `rlvla3 eval` queues: counted, never played
                self.queue.drop(claim)
                self.parts.counters.drop("eval_bad_episodes", f"protocol episode refused: {err}")
                continue
            result = self._play(envs, episode)
            if result is None:
                return  # stopping: the claim stays, and the episode is played again
            self.queue.finish(claim, result)
            self.parts.counters.count("eval_episodes")

    def _play(self, envs: TaskEnvs, episode: ProtocolEpisode) -> dict[str, Any] | None:
        """Play ``episode`` to its end; None when the worker stops first."""
        parts = self.parts
        with parts.meter.inside():
            envs.use(episode)
            obs = envs.reset(0, seed=episode.seed)
        frames: list[np.ndarray] | None = [] if episode.index < self.num_videos else None
        outcome = _Outcome()
        while usable_obs(obs):
            if frames is not None and "image" in obs:
                frames.append(obs["image"])
            if parts.stop_event.is_set():
                return None
            act = parts.client.act([obs])[0]
            outcome.version, outcome.greedy = act.version, outcome.greedy and act.greedy
            with parts.meter.inside():
                res = envs.step([act.env_action])[0]
            parts.counters.count("eval_env_steps", res.sim_steps)
            obs = res.obs
            if outcome.add(res, episode):
                break
        else:  # a simulator blow-up ends the episode, unsuccessful
            outcome.fault = True
        if frames:
            _write_gif(self.video_dir / video_name(episode), frames, self.log)
        return outcome.result(episode, self.worker)


class _Outcome:
    """One episode's tally so far."""

    def __init__(self) -> None:
        self.total, self.length = 0.0, 0
        self.success_once, self.success_at_end = False, False
        self.reports_success = False
        self.fault = False
        self.version, self.greedy = -1, True

    def add(self, res: Stepped, episode: ProtocolEpisode) -> bool:
        """Count one step; whether the episode has ended."""
        self.total += res.reward
        self.length += res.sim_steps
        success = res.info.get("success")
        if success is not None:
            self.reports_success = True
            self.success_at_end = bool(success)
            # an action chunk's info is its last step's: an earlier step's success is aside
            during = bool(res.info.get(SUCCESS_IN_CHUNK, success))
            self.success_once = self.success_once or self.success_at_end or during
        if not usable_step(res.obs, res.reward):
            self.fault = True
            return True
        limit = episode.max_steps is not None and self.length >= episode.max_steps
        ended = res.terminated and not episode.ignore_terminations
        return res.truncated or ended or limit

    def result(self, episode: ProtocolEpisode, worker: str) -> dict[str, Any]:
        success = (self.success_once and not self.fault) if self.reports_success else None
        return {
            **episode.identity(),
            "success": success,
            "success_at_end": self.success_at_end if self.reports_success else None,
            "length": self.length,
            "return": self.total,
            "sim_fault": self.fault,
            "version": self.version,
            "greedy": self.greedy,
            "worker": worker,
        }


def video_name(episode: ProtocolEpisode) -> str:
    """The GIF file of ``episode`` in the videos folder."""
    task = file_safe(episode.task, fill="_")
    return f"{episode.index:05d}_{task}_seed{episode.seed}.gif"


def _write_gif(path: Path, frames: list[np.ndarray], log: logging.Logger) -> None:
    """``frames`` (uint8 [H, W, 3]) as an animated GIF (Pillow; mp4 would need ffmpeg)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    images = [Image.fromarray(np.asarray(f, np.uint8)) for f in frames]
    tmp = path.with_name(path.name + ".tmp")
    images[0].save(
        tmp, format="GIF", save_all=True, append_images=images[1:], duration=1000 // VIDEO_FPS
    )
    tmp.rename(path)  # a killed worker leaves no half-written video under the final name
    log.info("wrote %s (%d frames)", path, len(frames))


def task_envs_factory(base_kwargs: dict[str, Any], action_steps: int) -> Callable[[], TaskEnvs]:
    """What the runner's thread calls to get its (still empty) envs."""
    return lambda: TaskEnvs(base_kwargs, action_steps)
