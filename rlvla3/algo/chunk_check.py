"""Checks a received trajectory chunk before the trainer buffers it.

The codec already guarantees a well-formed ``TrajectoryChunk`` (fields present, arrays
decodable). What it cannot know is whether the arrays fit this run: one chunk with a wrong
length, shape or dtype would crash the trainer at its next update (losing the buffered good
chunks), an action outside the policy's range would index past its logits, and a single NaN
reward or observation would turn every weight into NaN from then on. So each chunk is checked
against the env's observation space and the policy's action spec, and a chunk that fails is
dropped with the reason.
"""

from __future__ import annotations

import numpy as np
from gymnasium import spaces

from rlvla3.algo.number_limits import MAX_MAGNITUDE, MAX_OBS_MAGNITUDE
from rlvla3.policy.base import ActionSpec
from transport.messages import TrajectoryChunk

_PER_STEP = {  # field -> the kind of numbers it must hold
    "rewards": "f",
    "log_probs": "f",
    "values": "f",
    "terminated": "b",
    "truncated": "b",
    "policy_versions": "iu",
}


_LOG_PROB_SLACK = 1e-3
"""How far above 0 a discrete action's log-prob may be (float32 sums of per-token log-probs
round a certain action's to a few 1e-7 above it)."""


def chunk_problem(
    chunk: TrajectoryChunk,
    observation_space: spaces.Dict,
    action_spec: ActionSpec,
    *,
    chunk_len: int,
) -> str | None:
    """Why ``chunk`` cannot be trained on, naming the field; None if it can. A chunk has at
    most ``chunk_len`` steps (``env.chunk_len``): a longer one, however consistent, would
    stall an update for as long as its sender pleased."""
    if not -1 <= chunk.resend_from <= chunk.chunk_id:
        # above its own number it would give up chunks its producer has not pushed yet
        return f"resend_from: {chunk.resend_from}, expected -1 to chunk_id ({chunk.chunk_id})"
    steps = np.shape(chunk.rewards)[0] if np.ndim(chunk.rewards) == 1 else -1
    if steps < 1:
        return f"rewards: shape {np.shape(chunk.rewards)}, expected [T] with T >= 1"
    if steps > chunk_len:
        return f"rewards: {steps} steps, over env.chunk_len={chunk_len}"
    for name, kinds in _PER_STEP.items():
        arr = getattr(chunk, name)
        if arr.shape != (steps,) or arr.dtype.kind not in kinds:
            return f"{name}: {arr.dtype}{list(arr.shape)}, expected [{steps}] of kind {kinds!r}"
        if kinds == "f":
            problem = _magnitude_problem(arr, MAX_MAGNITUDE)
            if problem is not None:
                return f"{name}: {problem}"
    problem = _magnitude_problem(np.asarray(chunk.bootstrap_value), MAX_MAGNITUDE)
    if problem is not None:
        return f"bootstrap_value: {problem}"
    if action_spec.num_choices is not None and chunk.log_probs.max() > _LOG_PROB_SLACK:
        # a discrete action's probability is at most 1: a positive log-prob would make PPO's
        # ratio vanish, or an inf, for its whole minibatch
        return f"log_probs: {chunk.log_probs.max():.3g} above 0 for a discrete action"
    expected_keys = set(observation_space.spaces)
    if set(chunk.obs) != expected_keys:
        return f"obs: keys {sorted(chunk.obs)}, expected {sorted(expected_keys)}"
    problem = obs_problem(chunk.obs, observation_space, leading=(steps,))
    if problem is not None:
        return problem
    for key, arr in chunk.obs.items():
        if arr.dtype.kind == "f":
            problem = _magnitude_problem(arr, MAX_OBS_MAGNITUDE)
            if problem is not None:
                return f"obs[{key!r}]: {problem}"
    return _action_problem(chunk.actions, steps, action_spec)


def _magnitude_problem(arr: np.ndarray, limit: float) -> str | None:
    """Why float numbers cannot be trained on (not finite, or beyond ``limit`` in magnitude),
    None if they can."""
    if not arr.size:
        return None
    if not np.isfinite(arr).all():
        return "not finite"
    largest = float(np.abs(arr).max())
    if largest > limit:
        return f"magnitude {largest:.3g}, over {limit:.0e}"
    return None


def observation_bytes(observation_space: spaces.Dict) -> int:
    """Bytes of one observation of the space (bounds the sockets that carry observations)."""
    return sum(
        int(np.prod(space.shape)) * np.dtype(space.dtype).itemsize
        for space in observation_space.spaces.values()
    )


def obs_problem(
    obs: dict[str, np.ndarray], observation_space: spaces.Dict, leading: tuple[int, ...] = ()
) -> str | None:
    """Which of the space's observations is missing or not ``leading + space.shape`` of the
    space's dtype (None: all fit). Shared by the trainer (a chunk: ``leading=(T,)``) and the
    rollout servers (one request)."""
    for key, space in observation_space.spaces.items():
        arr = obs.get(key)
        if arr is None:
            return f"obs[{key!r}]: missing"
        if arr.shape != (*leading, *space.shape) or arr.dtype != space.dtype:
            return (
                f"obs[{key!r}]: {arr.dtype}{list(arr.shape)}, expected "
                f"{space.dtype}{[*leading, *space.shape]}"
            )
        outside = _integers_outside(arr, space)
        if outside:
            return f"obs[{key!r}]: {outside}"
    return None


_CHECKED_BOUNDS: dict[int, tuple[spaces.Box, bool]] = {}
"""Per integer Box (by identity, the space kept alive with it): whether its bounds are
narrower than its dtype's, i.e. whether values can leave them (worked out once per space: a
rollout server checks every request)."""


def _integers_outside(arr: np.ndarray, space: spaces.Space) -> str | None:
    """Why integer observations leave their Box's bounds (token ids index an embedding: one
    out of range would crash the policy's forward), None when they do not. Floats are not
    held to their bounds: simulators' declared bounds are often loose."""
    if not isinstance(space, spaces.Box) or arr.dtype.kind not in "iu" or not arr.size:
        return None
    known = _CHECKED_BOUNDS.get(id(space))
    if known is None or known[0] is not space:
        info = np.iinfo(arr.dtype)
        narrower = bool(space.low.min() > info.min or space.high.max() < info.max)
        known = _CHECKED_BOUNDS[id(space)] = (space, narrower)
    if not known[1]:
        return None  # (a uint8 image in [0, 255]: nothing to check)
    if (arr < space.low).any() or (arr > space.high).any():
        return (
            f"values {arr.min()}..{arr.max()} outside the space's "
            f"[{space.low.min()}, {space.high.max()}]"
        )
    return None


def _action_problem(actions: np.ndarray, steps: int, spec: ActionSpec) -> str | None:
    if actions.shape != (steps, *spec.shape):
        return f"actions: shape {list(actions.shape)}, expected {[steps, *spec.shape]}"
    if spec.num_choices is None:
        if actions.dtype.kind != "f":
            return f"actions: expected finite floats, got {actions.dtype}"
        problem = _magnitude_problem(actions, MAX_MAGNITUDE)
        return None if problem is None else f"actions: {problem}"
    if actions.dtype.kind not in "iu":
        return f"actions: expected integers in [0, {spec.num_choices}), got {actions.dtype}"
    if actions.size and (actions.min() < 0 or actions.max() >= spec.num_choices):
        return f"actions: values {actions.min()}..{actions.max()} outside [0, {spec.num_choices})"
    return None
