"""One batch of the rollout server's requests: their observations stacked into one policy batch,
the requests whose observations are not usable (NaN, inf, absurdly large) taken out, and each request's reply cut from the
batch's actions.

A batch mixes single-env requests (``ObsRequest``, one row) and group requests
(``ObsBatchRequest``, one row per env of the group); ``rows`` lists each request's row count, in
batch order, so the batch's rows ``sum(rows[:i]) : sum(rows[:i + 1])`` belong to request ``i``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from rlvla3.algo.number_limits import usable_obs, usable_rows
from rlvla3.policy.base import NumpyActOutput
from transport.messages import ActionBatchReply, ActionReply, ObsBatchRequest, ObsRequest

Batch = list[tuple[bytes, Any]]
"""``(sender identity, ObsRequest or ObsBatchRequest)`` pairs, in arrival order."""


def all_usable(obs: dict[str, np.ndarray]) -> bool:
    """Whether every float observation is finite and of a sane magnitude
    (``rlvla3/algo/number_limits.py``: a 3e38 observation overflows a model's activations
    until its sampling fails)."""
    return usable_obs(obs)


def request_rows(req: ObsBatchRequest) -> int | None:
    """How many observations a group's request carries (None: none, or keys disagree)."""
    counts = {len(arr) if getattr(arr, "ndim", 0) else -1 for arr in req.obs.values()}
    if len(counts) != 1 or next(iter(counts)) < 1:
        return None
    return next(iter(counts))


def stack_observations(
    batch: Batch, keys: Iterable[str]
) -> tuple[dict[str, np.ndarray], list[int]]:
    """The batch's observations under ``keys`` stacked into one array each, and each request's
    row count (the requests' observations already checked against the observation space)."""
    keys = list(keys)
    rows = [1 if isinstance(req, ObsRequest) else request_rows(req) for _, req in batch]
    if all(isinstance(req, ObsRequest) for _, req in batch):
        # np.array, not np.stack: same result for the equal shapes the checks allowed, 2-5x
        # less overhead for the few small arrays of a typical batch.
        return {key: np.array([req.obs[key] for _, req in batch]) for key in keys}, rows
    obs = {
        key: np.concatenate(
            [
                req.obs[key][None] if isinstance(req, ObsRequest) else req.obs[key]
                for _, req in batch
            ]
        )
        for key in keys
    }
    return obs, rows


def without_unusable(
    batch: Batch, obs: dict[str, np.ndarray], rows: list[int]
) -> tuple[Batch, dict[str, np.ndarray], list[int], list[Any]]:
    """The batch, its observations and row counts without the requests any of whose float
    observations are not ``all_usable`` (NaN, inf or absurdly large: their actions would be NaN
    too), and those requests. One check per batch; rows are only looked at when it fails."""
    if all_usable(obs):
        return batch, obs, rows, []
    total = sum(rows)
    bad = np.zeros(total, bool)
    for arr in obs.values():
        if arr.dtype.kind == "f":
            bad |= ~usable_rows(arr, total)
    starts = np.cumsum([0, *rows])
    keep_requests, refused, keep_rows = [], [], np.ones(total, bool)
    for i, (start, n) in enumerate(zip(starts[:-1], rows, strict=True)):
        if bad[start : start + n].any():
            refused.append(batch[i][1])
            keep_rows[start : start + n] = False
        else:
            keep_requests.append(i)
    return (
        [batch[i] for i in keep_requests],
        {key: arr[keep_rows] for key, arr in obs.items()},
        [rows[i] for i in keep_requests],
        refused,
    )


def batch_replies(
    batch: Batch, rows: list[int], out: NumpyActOutput, *, policy_version: int, greedy: bool
) -> Iterator[tuple[bytes, ActionReply | ActionBatchReply]]:
    """Each request's reply, with its sender's identity: its rows of the batch's policy output
    ``out``, produced by weights ``policy_version`` (``greedy``: the policy's mode)."""
    actions, env_actions = out.action, out.env_action
    same = env_actions is actions  # the env steps with the action itself: send it once
    log_probs, values = out.log_prob.tolist(), out.value.tolist()  # (not a[i]: slow)
    row = 0
    for (identity, req), n in zip(batch, rows, strict=True):
        if isinstance(req, ObsRequest):
            reply: ActionReply | ActionBatchReply = ActionReply(
                request_id=req.request_id,
                action=np.asarray(actions[row]),
                env_action=None if same else np.asarray(env_actions[row]),
                log_prob=log_probs[row],
                value=values[row],
                policy_version=policy_version,
                greedy=greedy,
            )
        else:
            reply = ActionBatchReply(
                request_id=req.request_id,
                actions=np.asarray(actions[row : row + n]),
                env_actions=None if same else np.asarray(env_actions[row : row + n]),
                log_probs=np.asarray(out.log_prob[row : row + n], np.float32),
                values=np.asarray(out.value[row : row + n], np.float32),
                policy_version=policy_version,
                greedy=greedy,
            )
        yield identity, reply
        row += n
