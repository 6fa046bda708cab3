"""Roll out scripted experts and record their episodes as a LeRobot dataset.

Each frame ``t`` holds the observation the expert saw (``observation.<key>`` for every key of the
env's observation dict, e.g. ``observation.image``, ``observation.instruction``,
``observation.proprio``, or ``observation.state``), the clean expert action (``action``), and what
the step returned (``next.reward`` float32[1], ``next.done`` bool[1], true on the last frame).

With ``expert_noise`` > 0 the env steps with the expert action plus Gaussian noise while ``action``
records the clean one (DART): the demos cover the off-course states a cloned policy drifts into,
labelled with how to recover. With noise 0 the recorded actions replay the episode exactly.

The dataset is LeRobot v3.0 unless ``codebase_version="v2.1"`` (``--format v2.1``) asks for the
layout older LeRobot reads (see :mod:`sft.lerobot_writer`).

Command line: ``python -m sft.demos --env-id rlvla3/TableTop-v0 --num-episodes 100 --root DIR``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces

from sft.lerobot import DEFAULT_FORMAT, FORMATS, Feature, LeRobotWriter, image_feature
from sim.adapter import SimAdapter
from sim.envs import make_env
from sim.experts import TableTopExpert, TableTopExpertConfig
from sim.tabletop import CONTROL_HZ, OBS_MODES

EXPERT_ENVS = ("rlvla3/TableTop-v0", "rlvla3/TableTopEasy-v0")


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoStats:
    """Summary of :func:`generate_demos`.

    Attributes:
        root: dataset directory.
        num_episodes: episodes written.
        num_attempts: episodes rolled out (failures are skipped when ``only_success``).
        num_frames: frames written.
        success_rate: successes / attempts.
    """

    root: Path
    num_episodes: int
    num_attempts: int
    num_frames: int
    success_rate: float


def _is_image(space: spaces.Space) -> bool:
    """A camera image: uint8 ``[H, W, 1|3|4]`` (stored as PNG, LeRobot's ``image`` dtype)."""
    shape = getattr(space, "shape", None) or ()
    return space.dtype == np.uint8 and len(shape) == 3 and shape[2] in (1, 3, 4)


def demo_features(env: SimAdapter) -> dict[str, Feature]:
    """LeRobot features for recording ``env``: one per observation key, action, reward, done."""
    features = {
        f"observation.{key}": image_feature(space.shape)
        if _is_image(space)
        else Feature(dtype=space.dtype.name, shape=tuple(space.shape))
        for key, space in env.observation_space.spaces.items()
    }
    act = env.action_space
    if isinstance(act, spaces.Discrete):
        features["action"] = Feature(dtype="int64", shape=(1,))
    else:
        features["action"] = Feature(dtype=act.dtype.name, shape=tuple(act.shape))
    features["next.reward"] = Feature(dtype="float32", shape=(1,))
    features["next.done"] = Feature(dtype="bool", shape=(1,))
    return features


def rollout_episode(
    env: SimAdapter, expert: TableTopExpert, seed: int
) -> tuple[list[dict[str, Any]], bool]:
    """One expert episode from ``env.reset(seed=seed)``: (frames, success).

    The env executes the expert's (possibly noisy) action; each frame records the clean one."""
    obs, _ = env.reset(seed=seed)
    frames: list[dict[str, Any]] = []
    while True:
        executed, clean = expert.act_with_label(env.privileged_state())
        next_obs, reward, terminated, truncated, info = env.step(executed)
        done = terminated or truncated
        frame = {f"observation.{k}": v for k, v in obs.items()}
        frame["action"] = clean
        frame["next.reward"] = np.float32(reward)
        frame["next.done"] = np.bool_(done)
        frames.append(frame)
        obs = next_obs
        if done:
            return frames, bool(info.get("success", False))


def generate_demos(
    env_id: str,
    num_episodes: int,
    root: str | Path,
    seed: int,
    *,
    only_success: bool = True,
    expert_noise: float = 0.0,
    max_attempts: int | None = None,
    overwrite: bool = False,
    codebase_version: str = DEFAULT_FORMAT,
    **env_kwargs: Any,
) -> DemoStats:
    """Roll out the scripted expert for ``env_id`` and write ``num_episodes`` episodes to ``root``.

    Attempt ``k`` resets the env with seed ``seed + k``, so datasets are reproducible.

    Args:
        env_id: an env with a scripted expert (``EXPERT_ENVS``).
        num_episodes: episodes to write.
        root: dataset directory (LeRobot layout).
        seed: seed of the first attempt.
        only_success: skip episodes the expert failed.
        expert_noise: std of Gaussian noise on the executed action; the recorded action stays
            the clean expert action (DART). ~0.3 makes cloned policies far more robust.
        max_attempts: give up after this many rollouts (default ``2 * num_episodes + 10``).
        overwrite: replace an existing dataset at ``root``.
        codebase_version: LeRobot layout to write, ``"v3.0"`` (LeRobot 0.4+) or ``"v2.1"``
            (older LeRobot); see :mod:`sft.lerobot_writer`.
        **env_kwargs: passed to :func:`sim.envs.make_env` (e.g. ``obs_mode="state"``).
    """
    if env_id not in EXPERT_ENVS:
        raise ValueError(f"no scripted expert for {env_id!r}; have {EXPERT_ENVS}")
    env = make_env(env_id, seed=seed, **env_kwargs)
    expert = TableTopExpert(TableTopExpertConfig(noise=expert_noise), seed=seed)
    limit = max_attempts if max_attempts is not None else 2 * num_episodes + 10
    attempts = successes = frames_written = 0
    writer = LeRobotWriter(
        root,
        demo_features(env),
        fps=CONTROL_HZ,
        robot_type="rlvla3-tabletop",
        codebase_version=codebase_version,
        overwrite=overwrite,
    )
    with writer:
        while len(writer.episodes) < num_episodes:
            if attempts >= limit:
                raise RuntimeError(f"only {len(writer.episodes)} episodes after {attempts} tries")
            frames, success = rollout_episode(env, expert, seed + attempts)
            attempts += 1
            successes += success
            if success or not only_success:
                writer.add_episode(frames, task=env.instruction or "")
                frames_written += len(frames)
    env.close()
    return DemoStats(
        root=Path(root),
        num_episodes=len(writer.episodes),
        num_attempts=attempts,
        num_frames=frames_written,
        success_rate=successes / max(attempts, 1),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-id", default="rlvla3/TableTop-v0", choices=EXPERT_ENVS)
    parser.add_argument("--num-episodes", type=int, default=100)
    parser.add_argument("--root", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--obs-mode", default="rgb", choices=OBS_MODES)
    parser.add_argument("--expert-noise", type=float, default=0.0)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--format", default=DEFAULT_FORMAT, choices=FORMATS)
    args = parser.parse_args(argv)
    stats = generate_demos(
        args.env_id,
        args.num_episodes,
        args.root,
        args.seed,
        expert_noise=args.expert_noise,
        overwrite=args.overwrite,
        codebase_version=args.format,
        obs_mode=args.obs_mode,
    )
    print(stats)


if __name__ == "__main__":
    main()
