"""LIBERO tasks (robosuite + MuJoCo, Franka Panda) as :class:`SimAdapter`s.

Env ids: ``libero/<suite>/<task_index>``, suites ``libero_spatial``, ``libero_object``,
``libero_goal``, ``libero_10`` (10 tasks each) and ``libero_90`` (90 tasks), in LIBERO's default
task order. Needs the ``libero`` extra and its assets: ``python -m sim.libero_setup``.

Observation (``S = image_size``, ``L = instruction_max_len``):

- ``image``: uint8[S, S, 3], the agent-view camera, upright (LIBERO renders in OpenGL
  convention, upside down; turned 180 degrees here like OpenVLA / openpi / LeRobot do).
- ``wrist_image``: uint8[S, S, 3], the eye-in-hand camera, turned the same way.
- ``instruction``: int32[L], the task's language (``sim.tokenizer.encode_instruction``).
- ``proprio``: float32[8], end-effector position (m, 3), orientation as axis-angle (rad, 3) and
  the two gripper finger joint positions (m, 2).

Action: float32[7] in ``[-1, 1]``: LIBERO's OSC_POSE delta (x, y, z, roll, pitch, yaw, scaled by
the controller) and the gripper (-1 open, +1 close); clipped. Reward: 1.0 on the step the task
succeeds, else 0.0 (LIBERO's sparse reward); the episode terminates on success and is truncated
after ``max_episode_steps`` (per-suite defaults as in openpi's LIBERO evaluation).

``reset(seed)`` restores one of the task's fixed initial states (50 per task): index
``seed % 50``; ``reset()`` without a seed draws the index from the env's own random stream.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from sim.adapter import Obs, SimAdapter, StepResult
from sim.libero_setup import import_libero
from sim.tokenizer import encode_instruction

SUITES = {  # suite -> (number of tasks, default max episode steps)
    "libero_spatial": (10, 220),
    "libero_object": (10, 280),
    "libero_goal": (10, 300),
    "libero_10": (10, 520),
    "libero_90": (90, 400),
}
ACTION_DIM = 7
PROPRIO_DIM = 8
RENDER_QUALITIES = ("default", "fast")
AGENT_CAMERA, WRIST_CAMERA = "agentview", "robot0_eye_in_hand"
SETTLE_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)  # hold still, gripper open


@dataclass(frozen=True, slots=True, kw_only=True)
class LiberoConfig:
    """Options of :class:`LiberoAdapter`.

    Attributes:
        suite: one of ``SUITES``.
        task_index: task number within the suite, ``0 <= task_index < SUITES[suite][0]``.
        image_size: side S of both square camera images, pixels.
        instruction_max_len: token length L of the encoded instruction (LIBERO's longest is 88).
        max_episode_steps: truncate after this many steps; None = the suite's default.
        num_settle_steps: steps of a still, open-gripper action run after each reset (not
            counted, not returned) so objects settle; openpi's evaluation uses 10.
        render_quality: ``"default"`` (LIBERO's look: shadows, reflections, 4x MSAA) or
            ``"fast"`` (none of them: ~2-3x faster software rendering, different pixels).
    """

    suite: str = "libero_spatial"
    task_index: int = 0
    image_size: int = 128
    instruction_max_len: int = 128
    max_episode_steps: int | None = None
    num_settle_steps: int = 0
    render_quality: str = "default"

    def __post_init__(self) -> None:
        if self.suite not in SUITES:
            raise ValueError(f"unknown LIBERO suite {self.suite!r}; known: {sorted(SUITES)}")
        num_tasks = SUITES[self.suite][0]
        if not 0 <= self.task_index < num_tasks:
            raise ValueError(f"{self.suite} has tasks 0..{num_tasks - 1}, got {self.task_index}")
        if self.render_quality not in RENDER_QUALITIES:
            raise ValueError(f"render_quality must be one of {RENDER_QUALITIES}")
        steps = self.max_episode_steps
        if self.image_size < 8 or self.instruction_max_len < 1 or (steps is not None and steps < 1):
            raise ValueError(f"invalid LiberoConfig {self}")
        if self.num_settle_steps < 0:
            raise ValueError(f"num_settle_steps must be >= 0, got {self.num_settle_steps}")

    @property
    def episode_steps(self) -> int:
        """The step limit in force (``max_episode_steps`` or the suite's default)."""
        return self.max_episode_steps or SUITES[self.suite][1]


def parse_env_id(env_id: str) -> tuple[str, int]:
    """``"libero/<suite>/<task_index>"`` -> ``(suite, task_index)``; ValueError if malformed."""
    parts = env_id.split("/")
    if len(parts) != 3 or parts[0] != "libero" or not parts[2].isdigit():
        raise ValueError(f"LIBERO env ids look like 'libero/libero_spatial/0', got {env_id!r}")
    LiberoConfig(suite=parts[1], task_index=int(parts[2]))  # validates both
    return parts[1], int(parts[2])


def quat_to_axis_angle(quat: np.ndarray) -> np.ndarray:
    """Unit quaternion (x, y, z, w), robosuite's order -> axis-angle float64[3] (rad)."""
    x, y, z, w = (float(v) for v in quat)
    w = min(max(w, -1.0), 1.0)
    den = math.sqrt(1.0 - w * w)
    if den < 1e-9:
        return np.zeros(3)
    return np.array([x, y, z]) * (2.0 * math.acos(w) / den)


class LiberoAdapter(SimAdapter):
    """One LIBERO task (see the module docstring for obs, action, reward and reset).

    Args:
        config: task and observation options.
        seed: the seed used by the first ``reset()`` called without one.
    """

    def __init__(self, config: LiberoConfig | None = None, *, seed: int | None = None) -> None:
        self.config = cfg = config or LiberoConfig()
        benchmark, env_cls, libero_config = import_libero()
        suite = benchmark.get_benchmark_dict()[cfg.suite]()
        task = suite.get_task(cfg.task_index)
        self.task_name: str = task.name
        self._language: str = task.language
        self._init_states = np.asarray(suite.get_task_init_states(cfg.task_index))
        bddl = os.path.join(libero_config["bddl_files"], task.problem_folder, task.bddl_file)
        self._env = env_cls(
            bddl_file_name=bddl,
            camera_heights=cfg.image_size,
            camera_widths=cfg.image_size,
            hard_reset=False,  # a hard reset rebuilds the model and GL context: seconds each
            ignore_done=True,  # episode ends are ours (success / max_episode_steps)
        )
        if cfg.render_quality == "fast":
            self._fast_render()
        self._tokens = encode_instruction(self._language, cfg.instruction_max_len)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(ACTION_DIM,), dtype=np.float32)
        s = cfg.image_size
        self.observation_space = spaces.Dict(
            {
                "image": spaces.Box(0, 255, (s, s, 3), np.uint8),
                "wrist_image": spaces.Box(0, 255, (s, s, 3), np.uint8),
                "instruction": spaces.Box(0, 256, (cfg.instruction_max_len,), np.int32),
                "proprio": spaces.Box(-np.inf, np.inf, (PROPRIO_DIM,), np.float32),
            }
        )
        self._rng = np.random.default_rng(seed)
        self._pending_seed = seed
        self._steps = 0
        self._done = True
        self._closed = False

    @property
    def instruction(self) -> str | None:
        return self._language

    @property
    def max_episode_steps(self) -> int | None:
        return self.config.episode_steps

    @property
    def num_init_states(self) -> int:
        """How many fixed initial states the task has (``reset(seed)`` uses ``seed % this``)."""
        return len(self._init_states)

    def _fast_render(self) -> None:
        """Drop shadows, reflections and multisampling from the offscreen renderer."""
        import mujoco

        context = self._env.sim._render_context_offscreen
        model = self._env.sim.model._model
        model.vis.quality.offsamples = 0
        context.con.free()
        context._set_mujoco_context_and_buffers()  # recreate buffers without MSAA
        for flag in (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION):
            context.scn.flags[flag] = 0

    # ----------------------------------------------------------------------------- episode
    def reset(self, seed: int | None = None) -> tuple[Obs, dict[str, Any]]:
        if seed is None and self._pending_seed is not None:
            seed = self._pending_seed
        self._pending_seed = None
        if seed is not None:
            self._rng = np.random.default_rng(seed)
            index = seed % self.num_init_states
        else:
            index = int(self._rng.integers(self.num_init_states))
        self._seeded_reset(int(self._rng.integers(2**31)))
        raw = self._env.set_init_state(self._init_states[index])
        for _ in range(self.config.num_settle_steps):
            raw, _, _, _ = self._env.step(SETTLE_ACTION)
        self._steps = 0
        self._done = False
        info = {
            "success": bool(self._env.check_success()),
            "instruction": self._language,
            "init_state_index": index,
        }
        return self._observe(raw), info

    def _seeded_reset(self, seed: int) -> None:
        """A soft LIBERO reset, with numpy's global generator (which its placement samplers draw
        fixture poses from; the init states cover only movable objects) seeded, then restored."""
        saved = np.random.get_state()
        np.random.seed(seed)
        try:
            self._env.reset()
        finally:
            np.random.set_state(saved)
        # A soft reset keeps the gripper model's speed-limited command from the last episode
        # (a hard reset rebuilds it at zero): zero it, or episodes depend on their predecessor.
        for robot in self._env.robots:
            robot.gripper.current_action = np.zeros_like(robot.gripper.current_action)

    def step(self, action: Any) -> StepResult:
        if self._done:
            raise RuntimeError("step() called after the episode ended; call reset() first")
        act = np.asarray(action, dtype=np.float64).reshape(ACTION_DIM)
        act = np.clip(np.nan_to_num(act, nan=0.0), -1.0, 1.0)
        raw, _, _, _ = self._env.step(act)
        self._steps += 1
        success = bool(self._env.check_success())
        truncated = not success and self._steps >= self.config.episode_steps
        self._done = success or truncated
        reward = 1.0 if success else 0.0
        return self._observe(raw), reward, success, truncated, {"success": success}

    def _observe(self, raw: dict[str, np.ndarray]) -> Obs:
        proprio = np.concatenate(
            [
                raw["robot0_eef_pos"],
                quat_to_axis_angle(raw["robot0_eef_quat"]),
                raw["robot0_gripper_qpos"],
            ]
        )
        return {
            "image": np.ascontiguousarray(raw[f"{AGENT_CAMERA}_image"][::-1, ::-1]),
            "wrist_image": np.ascontiguousarray(raw[f"{WRIST_CAMERA}_image"][::-1, ::-1]),
            "instruction": self._tokens.copy(),
            "proprio": proprio.astype(np.float32),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._env.close()


def make_libero_env(env_id: str, *, seed: int, **kwargs: Any) -> LiberoAdapter:
    """The :func:`sim.envs.make_env` factory for ``libero/<suite>/<task_index>`` ids.

    ``kwargs`` are the other fields of :class:`LiberoConfig` (``image_size``, ...).
    """
    suite, task_index = parse_env_id(env_id)
    return LiberoAdapter(LiberoConfig(suite=suite, task_index=task_index, **kwargs), seed=seed)
