"""ManiSkill 3 tasks (``maniskill/<EnvId>``, e.g. ``maniskill/PickCube-v1``) as a :class:`SimAdapter`.

One ManiSkill env (``num_envs=1``) per adapter instance. Observations, exactly what goes on the wire:

- ``obs_mode="state"``: ``{"state": float32[n]}``, ManiSkill's flat state vector (PickCube-v1:
  n = 42, PushCube-v1: 35, PegInsertionSide-v1: 43).
- ``obs_mode="rgb"``: ``{"image": uint8[S, S, 3]`` (the ``camera`` sensor, default
  ``base_camera``, rendered at ``S x S``), ``"instruction": int32[L]`` (a fixed description of the
  task, :func:`sim.tokenizer.encode_instruction`), ``"proprio": float32[P]}`` (the
  robot's joint positions then joint velocities; Panda: P = 9 + 9 = 18; plus ManiSkill's flattened
  ``extra`` task observations when ``proprio_extra``).

Action: ``float32[7]`` in ``[-1, 1]`` for the default ``control_mode="pd_ee_delta_pose"`` (end-effector
translation xyz, rotation as axis-angle xyz, gripper), the action space of OpenVLA-style policies
trained on end-effector deltas. ``"pd_joint_delta_pos"`` (``float32[8]``: 7 arm joint deltas and the
gripper) is about twice as fast on CPU (no inverse kinematics). Actions are clipped to the bounds.

Backends: ``sim_backend="physx_cpu"`` (default; physics on CPU, one env per process is the only
sensible layout) or ``"physx_cuda"`` (GPU physics; ManiSkill's strength is thousands of envs per GPU,
which needs a batched adapter; with this one-env adapter it works but is slow). Rendering uses
SAPIEN's Vulkan renderer even for ``"state"`` (ManiSkill builds render materials for every actor):
on CPU it needs a lavapipe with ``descriptorBindingPartiallyBound`` (``sim/setup_vulkan.sh``).
If ``VK_ICD_FILENAMES``/``VK_DRIVER_FILES`` are unset and that script's default install exists, the
adapter points the Vulkan loader at it (:func:`ensure_vulkan_env`).

PickCube-v1, PushCube-v1 and PegInsertionSide-v1 build their scenes from primitives and the Panda
robot description bundled in the ``mani_skill`` wheel: nothing is downloaded at runtime.
Note: PickCube-v1 hides its goal marker from the cameras, so an image-only policy cannot see the
goal: use ``proprio_extra=True`` (adds ``goal_pos``, ``tcp_pose``, ``is_grasped``) to train on it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces

from sim.adapter import Obs, SimAdapter, StepResult
from sim.tokenizer import encode_instruction

PREFIX = "maniskill/"

#: Fixed task descriptions (the instruction of every episode); other ids get one from their name.
TASK_INSTRUCTIONS: dict[str, str] = {
    "PickCube-v1": "pick up the red cube and move it to the goal position",
    "PushCube-v1": "push the blue cube onto the red and white target",
    "PullCube-v1": "pull the cube back onto the red and white target",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "PegInsertionSide-v1": "pick up the peg and insert it sideways into the hole in the box",
    "LiftPegUpright-v1": "lift the peg and stand it upright",
}

_VK_ENV_VARS = ("VK_ICD_FILENAMES", "VK_DRIVER_FILES")


def vulkan_install_dir() -> Path:
    """The folder ``sim/setup_vulkan.sh`` installs into by default (``$RLVLA3_VULKAN_DIR``, else
    ``${XDG_CACHE_HOME:-~/.cache}/rlvla3/vulkan``)."""
    if os.environ.get("RLVLA3_VULKAN_DIR"):
        return Path(os.environ["RLVLA3_VULKAN_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "rlvla3" / "vulkan"


def ensure_vulkan_env() -> str | None:
    """Point the Vulkan loader at the ``setup_vulkan.sh`` lavapipe unless the user chose a driver.

    Must run before SAPIEN creates its Vulkan instance (the first env of the process). Returns the
    ICD manifest in effect (from the environment or the default install), or None when neither.
    """
    for var in _VK_ENV_VARS:
        if os.environ.get(var):
            return os.environ[var]
    icd = vulkan_install_dir() / f"lvp_icd.{os.uname().machine}.json"
    if not icd.is_file():
        return None
    for var in _VK_ENV_VARS:
        os.environ[var] = str(icd)
    return str(icd)


_RENDER_KEEPALIVE: dict[str, Any] = {}


def _keep_render_resources(render_backend: str) -> None:
    """Hold one SAPIEN render system on the CPU render device for the life of the process.

    SAPIEN frees its shared render resources when the last render system of the process dies, and
    rebuilds them with the next first picture: on lavapipe that costs tens of CPU-seconds (a
    shader-generated table, likely the BRDF lookup table), once per process with this keep-alive
    instead of once per env generation. GPU render devices are left alone (it is cheap there).
    """
    if render_backend not in ("cpu", "sapien_cpu") or render_backend in _RENDER_KEEPALIVE:
        return
    import sapien

    _RENDER_KEEPALIVE[render_backend] = sapien.render.RenderSystem(sapien.Device("cpu"))


def missing_assets(task_id: str) -> list[str]:
    """ManiSkill data sources ``task_id`` needs that are not downloaded (empty for the tasks built
    from primitives, e.g. PickCube-v1, PushCube-v1, PegInsertionSide-v1)."""
    import mani_skill.envs  # noqa: F401 - fills the registry
    from mani_skill.utils import assets
    from mani_skill.utils.registration import REGISTERED_ENVS

    if task_id not in REGISTERED_ENVS:
        raise KeyError(f"unknown ManiSkill env {task_id!r}")
    missing = []
    for asset_id in REGISTERED_ENVS[task_id].asset_download_ids or []:
        if asset_id in assets.DATA_GROUPS:
            sources = assets.expand_data_group_into_individual_data_source_ids(asset_id)
        else:
            sources = [asset_id]
        missing += [s for s in sources if not assets.is_data_source_downloaded(s)]
    return missing


def task_instruction(task_id: str) -> str:
    """The instruction for a ManiSkill id (without the ``maniskill/`` prefix)."""
    if task_id in TASK_INSTRUCTIONS:
        return TASK_INSTRUCTIONS[task_id]
    name = task_id.split("-v")[0]
    return " ".join(w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", name))


@dataclass(frozen=True, slots=True, kw_only=True)
class ManiSkillConfig:
    """Options of :class:`ManiSkillAdapter`.

    Attributes:
        obs_mode: ``"rgb"`` (image + instruction tokens + proprio) or ``"state"``.
        control_mode: a ManiSkill controller, ``"pd_ee_delta_pose"`` (7-d) or
            ``"pd_joint_delta_pos"`` (8-d) for the Panda tasks.
        sim_backend: ``"physx_cpu"`` or ``"physx_cuda"`` (``"physx_cuda:1"`` picks a GPU).
        render_backend: SAPIEN render device; None picks ``"cpu"`` for physx_cpu (lavapipe) and
            ``"gpu"`` otherwise.
        image_size: side S of the square image, pixels (every camera renders at S x S).
        camera: the sensor whose RGB image is ``obs["image"]``.
        instruction_max_len: token length L of the encoded instruction.
        proprio_extra: append ManiSkill's ``extra`` task observations (float32) to the proprio.
        max_episode_steps: truncate after this many steps; None keeps ManiSkill's (50 for
            PickCube/PushCube, 100 for PegInsertionSide).
        reward_mode: ManiSkill reward mode; None keeps its default (``"normalized_dense"``).
        env_kwargs: further ``gymnasium.make`` kwargs for the ManiSkill env.
    """

    obs_mode: str = "rgb"
    control_mode: str = "pd_ee_delta_pose"
    sim_backend: str = "physx_cpu"
    render_backend: str | None = None
    image_size: int = 64
    camera: str = "base_camera"
    instruction_max_len: int = 64
    proprio_extra: bool = False
    max_episode_steps: int | None = None
    reward_mode: str | None = None
    env_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.obs_mode not in ("rgb", "state"):
            raise ValueError(f"obs_mode must be 'rgb' or 'state', got {self.obs_mode!r}")
        if self.image_size < 8 or self.instruction_max_len < 1:
            raise ValueError(f"invalid ManiSkillConfig {self}")
        if self.max_episode_steps is not None and self.max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be >= 1, got {self.max_episode_steps}")

    def make_kwargs(self) -> dict[str, Any]:
        """The ``gymnasium.make`` kwargs for one ManiSkill env."""
        render = self.render_backend
        if render is None:
            render = "cpu" if self.sim_backend == "physx_cpu" else "gpu"
        kwargs: dict[str, Any] = {
            "num_envs": 1,
            "obs_mode": self.obs_mode,
            "control_mode": self.control_mode,
            "sim_backend": self.sim_backend,
            "render_backend": render,
            "disable_env_checker": True,
        }
        if self.obs_mode == "rgb":
            kwargs["sensor_configs"] = {"width": self.image_size, "height": self.image_size}
        if self.max_episode_steps is not None:
            kwargs["max_episode_steps"] = self.max_episode_steps
        if self.reward_mode is not None:
            kwargs["reward_mode"] = self.reward_mode
        return kwargs | self.env_kwargs


def _to_numpy(x: Any) -> np.ndarray:
    """A batched (leading dim 1) torch tensor or array -> numpy without the batch dim."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    return arr[0] if arr.ndim >= 1 and arr.shape[0] == 1 else arr


def _to_python(x: Any) -> Any:
    """Info values: tensors of one element -> python scalars, larger ones -> numpy (unbatched)."""
    if isinstance(x, dict):
        return {k: _to_python(v) for k, v in x.items()}
    if not hasattr(x, "detach") and not isinstance(x, np.ndarray):
        return x
    arr = _to_numpy(x)
    return arr.item() if arr.size == 1 else arr


def _flat_f32(parts: list[Any]) -> np.ndarray:
    if not parts:
        return np.zeros(0, np.float32)
    return np.concatenate([_to_numpy(p).astype(np.float32).reshape(-1) for p in parts])


def _resize(img: np.ndarray, size: int) -> np.ndarray:
    if img.shape[:2] == (size, size):
        return img
    import cv2  # installed with mani_skill

    return cv2.resize(img, (size, size), interpolation=cv2.INTER_AREA)


class ManiSkillAdapter(SimAdapter):
    """One ManiSkill 3 env behind the :class:`SimAdapter` contract (see the module docstring).

    Args:
        task_id: a ManiSkill env id without the prefix, e.g. ``"PickCube-v1"``.
        config: options.
        seed: the seed used by the first ``reset()`` called without one.
    """

    def __init__(
        self, task_id: str, config: ManiSkillConfig | None = None, *, seed: int | None = None
    ) -> None:
        self.task_id = task_id
        self.config = cfg = config or ManiSkillConfig()
        ensure_vulkan_env()
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401 - registers the ManiSkill ids with gymnasium

        missing = missing_assets(task_id)
        if missing:  # ManiSkill itself would prompt on stdin (a worker would hang), then exit()
            raise FileNotFoundError(
                f"ManiSkill env {task_id!r} needs assets that are not downloaded: {missing}; "
                f"run: python -m mani_skill.utils.download_asset {task_id}"
            )
        kwargs = cfg.make_kwargs()
        self._env = gym.make(task_id, **kwargs)
        _keep_render_resources(kwargs["render_backend"])
        self._base = self._env.unwrapped
        self._instruction = task_instruction(task_id)
        self._tokens = encode_instruction(self._instruction, cfg.instruction_max_len)
        act = self._base.single_action_space
        self.action_space = spaces.Box(
            act.low.astype(np.float32), act.high.astype(np.float32), dtype=np.float32
        )
        self.observation_space = self._make_obs_space()
        self._pending_seed = seed
        # ManiSkill's own TimeLimitWrapper (outermost) holds the limit; gymnasium's spec does not
        self._max_steps: int | None = getattr(self._env, "_max_episode_steps", None)

    def _make_obs_space(self) -> spaces.Dict:
        single = self._base.single_observation_space
        if self.config.obs_mode == "state":
            n = spaces.flatdim(single)
            return spaces.Dict({"state": spaces.Box(-np.inf, np.inf, (n,), np.float32)})
        if self.config.camera not in single["sensor_data"].spaces:
            known = list(single["sensor_data"].spaces)
            raise KeyError(f"{self.task_id}: no camera {self.config.camera!r}; cameras: {known}")
        p = sum(spaces.flatdim(s) for s in single["agent"].values())
        if self.config.proprio_extra and "extra" in single.spaces:
            p += sum(spaces.flatdim(s) for s in single["extra"].values())
        s, n = self.config.image_size, self.config.instruction_max_len
        return spaces.Dict(
            {
                "image": spaces.Box(0, 255, (s, s, 3), np.uint8),
                "instruction": spaces.Box(0, 256, (n,), np.int32),
                "proprio": spaces.Box(-np.inf, np.inf, (p,), np.float32),
            }
        )

    @property
    def instruction(self) -> str | None:
        return self._instruction

    @property
    def max_episode_steps(self) -> int | None:
        return self._max_steps

    def _wrap(self, obs: Any) -> Obs:
        if self.config.obs_mode == "state":
            return {"state": _flat_f32([obs])}
        rgb = _to_numpy(obs["sensor_data"][self.config.camera]["rgb"])[..., :3]
        parts = list(obs["agent"].values())
        if self.config.proprio_extra:
            parts += list(obs.get("extra", {}).values())
        return {
            "image": _resize(np.ascontiguousarray(rgb, dtype=np.uint8), self.config.image_size),
            "instruction": self._tokens.copy(),
            "proprio": _flat_f32(parts),
        }

    def _info(self, info: dict[str, Any]) -> dict[str, Any]:
        out = _to_python(dict(info))
        out["success"] = bool(out.get("success", False))
        return out

    def reset(self, seed: int | None = None) -> tuple[Obs, dict[str, Any]]:
        """Start an episode. Returns ``(obs, info)``; ``info["instruction"]`` is the task text."""
        seed = self._reset_seed(seed)
        obs, info = self._env.reset(seed=seed)
        info = self._info(info)
        info["instruction"] = self._instruction
        return self._wrap(obs), info

    def step(self, action: Any) -> StepResult:
        """Apply ``float32[A]`` (clipped to the bounds). Returns ``(obs, reward, terminated,
        truncated, info)`` with python scalars and ``info["success"]`` a bool."""
        space = self.action_space
        arr = np.asarray(action, dtype=np.float32).reshape(space.shape)
        arr = np.clip(np.nan_to_num(arr), space.low, space.high)
        obs, reward, terminated, truncated, info = self._env.step(arr)
        return (
            self._wrap(obs),
            float(_to_numpy(reward)),
            bool(_to_numpy(terminated)),
            bool(_to_numpy(truncated)),
            self._info(info),
        )

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


def make_maniskill(env_id: str, *, seed: int, **kwargs: Any) -> ManiSkillAdapter:
    """``make_env`` hook: ``maniskill/<EnvId>`` plus :class:`ManiSkillConfig` fields as kwargs."""
    task_id = env_id.removeprefix(PREFIX)
    return ManiSkillAdapter(task_id, ManiSkillConfig(**kwargs), seed=seed)
