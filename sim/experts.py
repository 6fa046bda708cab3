"""Scripted experts that solve our built-in tasks from privileged simulator state."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.tabletop import CONTACT, MAX_STEP, TableTopState


@dataclass(frozen=True, slots=True, kw_only=True)
class TableTopExpertConfig:
    """Gains of :class:`TableTopExpert` (table units unless noted).

    Attributes:
        standoff: how far behind the block surface the pusher lines up before pushing.
        align_tol: lateral offset (from the block-target line) tolerated while pushing.
        clearance: extra distance kept from the block while walking around it.
        steer_gain: lateral correction per unit offset while pushing (dimensionless).
        noise: std of Gaussian noise added to the executed action (0 = deterministic expert);
            ``act_with_label`` also returns the clean action, the DART label.
    """

    standoff: float = 0.03
    align_tol: float = 0.06
    clearance: float = 0.06
    steer_gain: float = 4.0
    noise: float = 0.0


def _unit(v: np.ndarray) -> np.ndarray:
    n = math.hypot(float(v[0]), float(v[1]))
    return v / n if n > 1e-9 else np.zeros(2)


def _toward(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Velocity command reaching ``dst`` without overshoot: ``float64[2]`` in [-1, 1]."""
    delta = (dst - src) / MAX_STEP
    n = math.hypot(float(delta[0]), float(delta[1]))
    return delta / n if n > 1.0 else delta


class TableTopExpert:
    """Push-from-behind controller for ``rlvla3/TableTop-v0``.

    Three phases, chosen from the pusher's position in the frame of the named block (``along``
    the block→target direction, ``lateral`` to it):

    1. pusher on the target side or level with the block: walk around it via a side waypoint;
    2. pusher behind the block but off the line: go to the stand-off point behind it;
    3. lined up: push along the line, steering the lateral offset back to zero.

    Args:
        config: controller gains; default solves >= 95% of episodes.
        seed: seed of the action noise (only used when ``config.noise > 0``).
    """

    def __init__(self, config: TableTopExpertConfig | None = None, *, seed: int = 0) -> None:
        self.config = config or TableTopExpertConfig()
        self._rng = np.random.default_rng(seed)

    def act(self, state: TableTopState) -> np.ndarray:
        """The action to execute in ``state`` (from ``TableTopEnv.privileged_state()``), noise
        included: ``float32[2]``."""
        return self.act_with_label(state)[0]

    def act_with_label(self, state: TableTopState) -> tuple[np.ndarray, np.ndarray]:
        """``(executed, clean)``, both ``float32[2]`` in [-1, 1]: the clean expert action plus
        ``config.noise`` Gaussian noise, and the clean action itself.

        DART (Laskey et al. 2017): execute the noisy action so demonstrations visit the states a
        slightly imperfect learner drifts into, but label every state with the clean action, which
        shows how to recover from them."""
        clean = self._plan(state)
        executed = clean
        if self.config.noise > 0.0:
            executed = clean + self._rng.normal(0.0, self.config.noise, size=2)
        return (
            np.clip(executed, -1.0, 1.0).astype(np.float32),
            np.clip(clean, -1.0, 1.0).astype(np.float32),
        )

    def _plan(self, state: TableTopState) -> np.ndarray:
        cfg = self.config
        pusher = state.pusher_pos
        block = state.block_pos[state.block_index]
        goal = state.target_pos[state.target_index]
        d = _unit(goal - block)
        n = np.array([-d[1], d[0]])
        rel = pusher - block
        along, lateral = float(rel @ d), float(rel @ n)
        behind = block - d * (CONTACT + cfg.standoff)
        if along > -0.5 * CONTACT:  # walk around: first sideways, then back
            offset = n * (1.0 if lateral >= 0.0 else -1.0) * (CONTACT + cfg.clearance)
            if abs(lateral) < CONTACT + 0.5 * cfg.clearance:
                return _toward(pusher, block + d * max(along, 0.0) + offset)
            return _toward(pusher, behind + offset)
        if abs(lateral) > cfg.align_tol or along < -(CONTACT + cfg.standoff + 0.1):
            return _toward(pusher, behind)
        correction = -cfg.steer_gain * lateral
        return _unit(d + n * correction)
