"""The built-in table-top pushing task: a top-down 2-D scene rendered in pure numpy.

A square table (coordinates ``[-1, 1]^2``, x right, y up) holds a round end-effector (the
pusher), three blocks (red, green, blue) and three target zones (red, green, blue). Each episode
samples an instruction ``"push the <colour> block to the <colour> target"``; only the named block
and the named target count, so a policy must read the instruction.

Physics is kinematic: the action is the pusher's velocity, blocks are discs (drawn as squares)
that the pusher and other blocks push out of overlap; there is no friction or inertia.

Observations (``obs_mode``):

- ``"rgb"``: ``{"image": uint8[S, S, 3], "instruction": int32[L], "proprio": float32[4]}`` with
  proprio = pusher position (table units) and velocity (table units / s).
- ``"state"``: ``{"state": float32[22]}`` = pusher position (2), velocity (2), block positions
  (3x2, red/green/blue), target positions (3x2), named-block one-hot (3), named-target one-hot (3).
- ``"rgb+state"``: both: the ``"rgb"`` keys plus that ``"state"``, the simulator's privileged
  state for an asymmetric critic (``policy.token_vla.observation.critic``) that the policy does
  not read.
- ``"rgb+goal"``: the ``"rgb"`` keys plus ``"goal"``: float32[4] = the named block's and the
  named target's positions, the labels of a token VLA's plan (``policy.token_vla.plan``) in
  the demos it clones; the policy does not read it.

Action: ``float32[2]`` in ``[-1, 1]``, the pusher velocity as a fraction of its maximum speed.
Reward: potential shaping on the named block's distance to the named target (weight 3) and the
pusher's distance to the named block (weight 0.5), minus 0.01 per step, plus 5 on success.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from sim.adapter import Obs, SimAdapter, StepResult
from sim.tokenizer import encode_instruction

COLOURS = ("red", "green", "blue")
NUM_OBJECTS = len(COLOURS)
PUSHER_RADIUS = 0.08  # table units
BLOCK_RADIUS = 0.1  # contact radius; drawn as a square of half-size BLOCK_RADIUS
TARGET_RADIUS = 0.2  # success when the named block's centre is inside
MAX_SPEED = 1.0  # table units / s at |action| = 1
CONTROL_HZ = 10
MAX_STEP = MAX_SPEED / CONTROL_HZ  # table units per step
CONTACT = PUSHER_RADIUS + BLOCK_RADIUS
W_BLOCK, W_PUSHER, STEP_COST, SUCCESS_BONUS = 3.0, 0.5, 0.01, 5.0
STATE_DIM = 4 + 4 * NUM_OBJECTS + 2 * NUM_OBJECTS
SCENE_DIM = 4 + 4 * NUM_OBJECTS  # the state up to its one-hots
OBS_MODES = ("rgb", "state", "rgb+state", "rgb+goal", "rgb+scene")
GOAL_DIM = 4  # the named block's (x, y), then the named target's

TABLE_RGB = np.array([168, 150, 120], np.uint8)
OBJECT_RGB = np.array([[215, 40, 40], [40, 170, 60], [50, 70, 220]], np.uint8)
TARGET_RGB = ((OBJECT_RGB.astype(np.float32) + TABLE_RGB) / 2).astype(np.uint8)
PUSHER_RGB = np.array([25, 25, 25], np.uint8)


@dataclass(frozen=True, slots=True, kw_only=True)
class TableTopConfig:
    """Options of :class:`TableTopEnv`.

    Attributes:
        obs_mode: ``"rgb"`` (image + instruction tokens + proprio), ``"state"``,
            ``"rgb+state"`` (both: the state for a critic), ``"rgb+goal"`` (the named block's
            and target's positions beside the ``"rgb"`` keys: a plan's labels) or
            ``"rgb+scene"`` (every object's position beside them, no one-hots).
        image_size: side S of the square RGB image, pixels.
        instruction_max_len: token length L of the encoded instruction.
        max_episode_steps: episodes are truncated after this many steps.
        easy: spawn the named block 0.3-0.45 units from its target and the pusher just behind
            it, so a few straight pushes solve the episode (fast RL smoke runs on CPU).
    """

    obs_mode: str = "rgb"
    image_size: int = 64
    instruction_max_len: int = 64
    max_episode_steps: int = 60
    easy: bool = False

    def __post_init__(self) -> None:
        if self.obs_mode not in OBS_MODES:
            raise ValueError(f"obs_mode must be one of {OBS_MODES}, got {self.obs_mode!r}")
        if self.image_size < 16 or self.instruction_max_len < 1 or self.max_episode_steps < 1:
            raise ValueError(f"invalid TableTopConfig {self}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TableTopState:
    """Privileged simulator state (copies), for scripted experts and tests.

    Attributes:
        pusher_pos: float64[2], table units.
        pusher_vel: float64[2], table units / s.
        block_pos: float64[3, 2], rows red/green/blue.
        target_pos: float64[3, 2], rows red/green/blue.
        block_index: index of the named block in ``COLOURS``.
        target_index: index of the named target in ``COLOURS``.
        step: steps taken this episode.
    """

    pusher_pos: np.ndarray
    pusher_vel: np.ndarray
    block_pos: np.ndarray
    target_pos: np.ndarray
    block_index: int
    target_index: int
    step: int


def _sample_separated(
    rng: np.random.Generator, n: int, limit: float, min_sep: float, avoid: list[np.ndarray]
) -> np.ndarray:
    """``n`` points uniform in ``[-limit, limit]^2``, pairwise and from ``avoid`` >= min_sep."""
    points: list[np.ndarray] = []
    for _ in range(10_000):
        p = rng.uniform(-limit, limit, size=2)
        if all(np.hypot(*(p - q)) >= min_sep for q in points + avoid):
            points.append(p)
            if len(points) == n:
                return np.array(points)
    raise RuntimeError("could not place objects; relax the spawn constraints")


def _clamp(v: float, lim: float) -> float:
    return -lim if v < -lim else lim if v > lim else v


def _separate(a: list[float], b: list[float], dist: float, move_a: float, move_b: float) -> bool:
    """If discs at ``a`` and ``b`` overlap (centres closer than ``dist``), move them apart in
    place, ``a`` by ``move_a`` and ``b`` by ``move_b`` of the overlap. True if they overlapped."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    gap = math.hypot(dx, dy)
    if gap >= dist - 1e-12:
        return False
    nx, ny = (dx / gap, dy / gap) if gap > 1e-9 else (1.0, 0.0)
    depth = dist - gap
    a[0] -= nx * depth * move_a
    a[1] -= ny * depth * move_a
    b[0] += nx * depth * move_b
    b[1] += ny * depth * move_b
    return True


def _resolve_contacts(pusher: list[float], blocks: list[list[float]]) -> None:
    """Push blocks out of the pusher and each other, keep all inside the table (in place).

    Pure python floats: with three blocks this is several times faster than numpy."""
    block_lim, pusher_lim = 1.0 - BLOCK_RADIUS, 1.0 - PUSHER_RADIUS
    for _ in range(4):
        moved = False
        for b in blocks:
            moved |= _separate(pusher, b, CONTACT, 0.0, 1.0)
        for i in range(NUM_OBJECTS):
            for j in range(i + 1, NUM_OBJECTS):
                moved |= _separate(blocks[i], blocks[j], 2 * BLOCK_RADIUS, 0.5, 0.5)
        for b in blocks:
            b[0], b[1] = _clamp(b[0], block_lim), _clamp(b[1], block_lim)
        for b in blocks:  # a block pinned against a wall pushes the pusher back
            moved |= _separate(b, pusher, CONTACT, 0.0, 1.0)
        pusher[0], pusher[1] = _clamp(pusher[0], pusher_lim), _clamp(pusher[1], pusher_lim)
        if not moved:
            return


class TableTopEnv(SimAdapter):
    """The table-top pushing task (see the module docstring for obs, action and reward).

    Args:
        config: task options.
        seed: the seed used by the first ``reset()`` called without one.
    """

    def __init__(self, config: TableTopConfig | None = None, *, seed: int | None = None) -> None:
        self.config = cfg = config or TableTopConfig()
        self._rng = np.random.default_rng(seed)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.observation_space = self._make_obs_space()
        self._pusher = np.zeros(2)
        self._vel = np.zeros(2)
        self._blocks = np.zeros((NUM_OBJECTS, 2))
        self._targets = np.zeros((NUM_OBJECTS, 2))
        self._block_idx = self._target_idx = 0
        self._steps = 0
        self._done = True
        self._instruction = ""
        self._tokens = np.zeros(cfg.instruction_max_len, np.int32)
        self._background: np.ndarray | None = None  # targets; drawn lazily once per episode
        self._pix = np.arange(cfg.image_size, dtype=np.float32)

    def _make_obs_space(self) -> spaces.Dict:
        cfg = self.config
        high = np.ones(STATE_DIM, np.float32)
        low = -high
        low[-2 * NUM_OBJECTS :] = 0.0
        state = {"state": spaces.Box(low, high, dtype=np.float32)}
        if cfg.obs_mode == "state":
            return spaces.Dict(state)
        s, n = cfg.image_size, cfg.instruction_max_len
        goal = {"goal": spaces.Box(-1.0, 1.0, (GOAL_DIM,), np.float32)}
        scene = {"scene": spaces.Box(low[:SCENE_DIM], high[:SCENE_DIM], dtype=np.float32)}
        extra = {"rgb+state": state, "rgb+goal": goal, "rgb+scene": scene}.get(cfg.obs_mode, {})
        return spaces.Dict(
            extra
            | {
                "image": spaces.Box(0, 255, (s, s, 3), np.uint8),
                "instruction": spaces.Box(0, 256, (n,), np.int32),
                "proprio": spaces.Box(
                    np.array([-1, -1, -MAX_SPEED, -MAX_SPEED], np.float32),
                    np.array([1, 1, MAX_SPEED, MAX_SPEED], np.float32),
                    dtype=np.float32,
                ),
            }
        )

    @property
    def instruction(self) -> str | None:
        return self._instruction or None

    @property
    def max_episode_steps(self) -> int | None:
        return self.config.max_episode_steps

    def privileged_state(self) -> TableTopState:
        """A copy of the full simulator state (for scripted experts)."""
        return TableTopState(
            pusher_pos=self._pusher.copy(),
            pusher_vel=self._vel.copy(),
            block_pos=self._blocks.copy(),
            target_pos=self._targets.copy(),
            block_index=self._block_idx,
            target_index=self._target_idx,
            step=self._steps,
        )

    # ----------------------------------------------------------------------------- episode
    def reset(self, seed: int | None = None) -> tuple[Obs, dict[str, Any]]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        rng = self._rng
        self._block_idx, self._target_idx = (int(i) for i in rng.integers(NUM_OBJECTS, size=2))
        self._instruction = (
            f"push the {COLOURS[self._block_idx]} block to the {COLOURS[self._target_idx]} target"
        )
        self._tokens = encode_instruction(self._instruction, self.config.instruction_max_len)
        if self.config.easy:
            self._spawn_easy(rng)
        else:
            self._spawn_normal(rng)
        self._vel = np.zeros(2)
        self._steps = 0
        self._done = False
        self._background = None
        info = {"success": False, "instruction": self._instruction}
        return self._observe(), info

    def _spawn_normal(self, rng: np.random.Generator) -> None:
        self._targets = _sample_separated(rng, NUM_OBJECTS, 0.65, 2 * TARGET_RADIUS + 0.1, [])
        goal = self._targets[self._target_idx]
        for _ in range(1000):
            blocks = _sample_separated(rng, NUM_OBJECTS, 0.7, 2 * BLOCK_RADIUS + 0.06, [])
            if np.hypot(*(blocks[self._block_idx] - goal)) >= TARGET_RADIUS + 0.25:
                break
        self._blocks = blocks
        self._pusher = _sample_separated(rng, 1, 0.85, CONTACT + 0.05, list(blocks))[0]

    def _spawn_easy(self, rng: np.random.Generator) -> None:
        self._targets = _sample_separated(rng, NUM_OBJECTS, 0.6, 2 * TARGET_RADIUS + 0.1, [])
        goal = self._targets[self._target_idx]
        for _ in range(1000):
            angle = rng.uniform(-np.pi, np.pi)
            away = np.array([np.cos(angle), np.sin(angle)])
            block = goal + away * rng.uniform(0.3, 0.45)
            pusher = block + away * (CONTACT + rng.uniform(0.03, 0.12))
            if np.all(np.abs(block) <= 0.75) and np.all(np.abs(pusher) <= 0.9):
                break
        avoid = [block, pusher, (block + goal) / 2, goal]
        others = _sample_separated(rng, NUM_OBJECTS - 1, 0.7, CONTACT + 0.12, avoid)
        rest = iter(others)
        self._blocks = np.array(
            [block if i == self._block_idx else next(rest) for i in range(NUM_OBJECTS)]
        )
        self._pusher = pusher

    def step(self, action: Any) -> StepResult:
        if self._done:
            raise RuntimeError("step() called after the episode ended; call reset() first")
        ax, ay = (float(a) for a in np.asarray(action, dtype=np.float64).reshape(2))
        ax = _clamp(ax, 1.0) if math.isfinite(ax) else 0.0
        ay = _clamp(ay, 1.0) if math.isfinite(ay) else 0.0
        before = self._distances()
        old_x, old_y = self._pusher.tolist()
        lim = 1.0 - PUSHER_RADIUS
        pusher = [_clamp(old_x + ax * MAX_STEP, lim), _clamp(old_y + ay * MAX_STEP, lim)]
        blocks = self._blocks.tolist()
        _resolve_contacts(pusher, blocks)
        self._pusher = np.array(pusher)
        self._blocks = np.array(blocks)
        vx, vy = (pusher[0] - old_x) * CONTROL_HZ, (pusher[1] - old_y) * CONTROL_HZ
        self._vel = np.array([_clamp(vx, MAX_SPEED), _clamp(vy, MAX_SPEED)])
        self._steps += 1
        after = self._distances()
        success = after[0] <= TARGET_RADIUS
        reward = W_BLOCK * (before[0] - after[0]) + W_PUSHER * (before[1] - after[1]) - STEP_COST
        reward += SUCCESS_BONUS if success else 0.0
        truncated = not success and self._steps >= self.config.max_episode_steps
        self._done = success or truncated
        info = {"success": success, "block_to_target": after[0]}
        return self._observe(), float(reward), success, truncated, info

    def _distances(self) -> tuple[float, float]:
        """(named block to named target, pusher surface gap to named block), table units."""
        bx, by = self._blocks[self._block_idx].tolist()
        tx, ty = self._targets[self._target_idx].tolist()
        px, py = self._pusher.tolist()
        return math.hypot(tx - bx, ty - by), max(math.hypot(bx - px, by - py) - CONTACT, 0.0)

    # ----------------------------------------------------------------------------- observe
    def _observe(self) -> Obs:
        if self.config.obs_mode == "state":
            return {"state": self._state_vector()}
        proprio = np.concatenate([self._pusher, self._vel])
        obs = {
            "image": self.render(),
            "instruction": self._tokens.copy(),
            "proprio": proprio.astype(np.float32),
        }
        if self.config.obs_mode == "rgb+state":
            obs["state"] = self._state_vector()
        elif self.config.obs_mode == "rgb+goal":
            named = (self._blocks[self._block_idx], self._targets[self._target_idx])
            obs["goal"] = np.concatenate(named).astype(np.float32)
        elif self.config.obs_mode == "rgb+scene":
            obs["scene"] = self._state_vector()[:SCENE_DIM]
        return obs

    def _state_vector(self) -> np.ndarray:
        out = np.zeros(STATE_DIM, np.float32)
        out[0:2] = self._pusher
        out[2:4] = self._vel / MAX_SPEED
        k = 4 + 2 * NUM_OBJECTS
        out[4:k] = self._blocks.ravel()
        out[k : k + 2 * NUM_OBJECTS] = self._targets.ravel()
        k += 2 * NUM_OBJECTS
        out[k + self._block_idx] = 1.0
        out[k + NUM_OBJECTS + self._target_idx] = 1.0
        return out

    def _to_pixels(self, xy: np.ndarray) -> tuple[float, float]:
        """Table coordinates -> (column, row) in pixel units (row 0 at the top, y = +1)."""
        s = self.config.image_size
        x, y = xy.tolist()
        return (x + 1.0) * 0.5 * s - 0.5, (1.0 - y) * 0.5 * s - 0.5

    def _disc(self, img: np.ndarray, xy: np.ndarray, radius: float, rgb: np.ndarray) -> None:
        s = self.config.image_size
        col, row = self._to_pixels(xy)
        r = radius * 0.5 * s
        c0, c1 = max(int(col - r), 0), min(int(col + r) + 2, s)
        r0, r1 = max(int(row - r), 0), min(int(row + r) + 2, s)
        dc = self._pix[c0:c1] - col
        dr = self._pix[r0:r1, None] - row
        img[r0:r1, c0:c1][dr * dr + dc * dc <= r * r] = rgb

    def _square(self, img: np.ndarray, xy: np.ndarray, half: float, rgb: np.ndarray) -> None:
        s = self.config.image_size
        col, row = self._to_pixels(xy)
        h = half * 0.5 * s
        c0, c1 = max(math.floor(col - h + 1.0), 0), min(math.floor(col + h + 1.0), s)
        r0, r1 = max(math.floor(row - h + 1.0), 0), min(math.floor(row + h + 1.0), s)
        img[r0:r1, c0:c1] = rgb

    def _draw_background(self) -> np.ndarray:
        s = self.config.image_size
        img = np.empty((s, s, 3), np.uint8)
        img[:] = TABLE_RGB
        for i in range(NUM_OBJECTS):
            self._disc(img, self._targets[i], TARGET_RADIUS, TARGET_RGB[i])
        return img

    def render(self) -> np.ndarray:
        """The current scene: ``uint8[S, S, 3]`` RGB, top-down, y up."""
        if self._background is None:
            self._background = self._draw_background()
        img = self._background.copy()
        for i in range(NUM_OBJECTS):
            self._square(img, self._blocks[i], BLOCK_RADIUS, OBJECT_RGB[i])
        self._disc(img, self._pusher, PUSHER_RADIUS, PUSHER_RGB)
        return img
