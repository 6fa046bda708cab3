"""How large the numbers of an env step may be before they count as a simulator fault.

NaN and inf break training outright. So do finite numbers far beyond anything real: a 1e20
reward's square overflows float32, zeroing every other advantage of its batch, and a 3e38
observation overflows a transformer's activations until its sampling fails. A simulator
whose physics blew up returns either kind. Env workers cut the episode at such a step as at a
NaN (``sim_faults``), rollout servers refuse such an observation (``bad_requests``), and the
trainer refuses a chunk that holds one (``bad_chunks``); all three use these limits.
"""

from __future__ import annotations

import math

import numpy as np

MAX_MAGNITUDE = 1e6
"""Largest magnitude of a reward, value, log-prob or continuous action. No env's reward or
critic's value comes near it."""

MAX_OBS_MAGNITUDE = 1e9
"""Largest magnitude of a float observation: simulators' declared bounds are often loose, so
floats are held only to this (squares of anything below it stay finite in float32)."""

_PYTHON_MAX = 32
"""Float arrays up to this size are checked as Python floats (at a rollout server's batch of
one, numpy's per-call overhead costs more; beyond about 32 values numpy is faster)."""


def usable(arr: np.ndarray, limit: float = MAX_OBS_MAGNITUDE) -> bool:
    """Whether every number of a float array is finite and at most ``limit`` in magnitude."""
    if arr.size <= _PYTHON_MAX:
        values = arr.ravel().tolist()
        # a NaN or inf makes the sum non-finite (finite values this few cannot overflow it)
        return math.isfinite(sum(values)) and -limit <= min(values) and max(values) <= limit
    return bool((np.abs(arr) <= _bound(arr, limit)).all())


def usable_rows(arr: np.ndarray, rows: int, limit: float = MAX_OBS_MAGNITUDE) -> np.ndarray:
    """bool[rows]: which of ``arr``'s leading ``rows`` rows are ``usable`` (all of them for an
    array that is not float: integers are exact)."""
    if arr.dtype.kind != "f":
        return np.ones(rows, bool)
    return (np.abs(arr.reshape(rows, -1)) <= _bound(arr, limit)).all(axis=1)


def _bound(arr: np.ndarray, limit: float) -> np.generic:
    """``limit`` as the scalar to compare ``arr`` with: in the array's own float type (no
    upcast of a large float32 array), float64 for float16 (whose largest is 65504: a Python
    float would be cast to inf)."""
    return np.float64(limit) if arr.dtype.itemsize < 4 else arr.dtype.type(limit)


def usable_number(value: float) -> bool:
    """Whether a reward, log-prob or value is finite and at most ``MAX_MAGNITUDE`` in
    magnitude."""
    return -MAX_MAGNITUDE <= value <= MAX_MAGNITUDE


def usable_obs(obs: dict[str, np.ndarray]) -> bool:
    """Whether every float observation of ``obs`` is ``usable`` (other dtypes are exact)."""
    return all(usable(arr) for arr in obs.values() if arr.dtype.kind == "f")


def usable_step(obs: dict[str, np.ndarray], reward: float) -> bool:
    """Whether an env step's observation and reward can be acted and trained on (else the
    simulator faulted)."""
    return usable_number(reward) and usable_obs(obs)
