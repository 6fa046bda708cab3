"""Every message that crosses a socket, in one schema with one version.

Messages are frozen, slotted, keyword-only structs (``Message``). Array fields are numpy arrays
(CPU torch tensors are accepted when encoding); ``transport/codec.py`` carries small ones inline
in the msgpack header and large ones as raw zero-copy frames. Bump ``SCHEMA_VERSION`` whenever a
field changes meaning or shape, or the wire layout changes (2: positional fields, inline arrays;
3: ``ActionReply.env_action`` optional; 4: ``WeightsRequest``, ``TrajectoryChunk.producer``;
5: ``TrajectoryChunk.group``; 6: ``ObsBatchRequest``, ``ActionBatchReply``; 7: ``WeightsUpdate.tag``;
8: ``TrajectoryChunk.resend_from``; 9: ``TrajectoryChunk.tag``).

Observation dicts (``Obs``) use the same keys as ``rlvla3/policy/base.py``: ``state`` for classic
control; ``image`` (uint8[H, W, 3]), ``instruction`` (int32[L] byte tokens, 0 = pad) and
``proprio`` (float32[P]) for VLA tasks.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np

SCHEMA_VERSION = 9

Obs = dict[str, np.ndarray]


class Message(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    array_like=True,
    tag=True,
    forbid_unknown_fields=True,  # extra trailing values are an error, not silently dropped
):
    """Base of every message: frozen, slotted, keyword-only, typed fields.

    ``msgspec.Struct`` rather than a dataclass (the same contract) because its C codec checks
    every field's type while decoding: a received message is validated in ~1 µs instead of
    ~10 µs of Python per message (see ``transport/codec.py``). On the wire a message is an array
    ``[class name, *field values]`` (``array_like``, ``tag``).
    """


class ObsRequest(Message):
    """An env asks a rollout server for its next action.

    Attributes:
        env_key: which env, ``"{worker_index}/{env_index}"``; echoed nowhere, used for stats.
        request_id: unique per env worker, echoed in the reply to match it.
        obs: one observation (no batch dimension).
    """

    env_key: str
    request_id: int
    obs: Obs


class ActionReply(Message):
    """A rollout server's answer to one ``ObsRequest``.

    Attributes:
        request_id: the request's id.
        action: the policy's action, as the trainer re-scores it: int64[] (discrete), int64[D]
            (action bins), float32[D] (continuous), or int64[K, D] (an action chunk of K steps,
            ``policy.token_vla.action_steps``: its env action is ``[K, ...]``, one per step).
        log_prob: log-probability of ``action`` under the behaviour policy (nats).
        value: the critic's value estimate of the observation.
        policy_version: version of the weights that produced this reply.
        env_action: what the env steps with when it differs from ``action`` (bin centres for
            binned actions, clipped Gaussian samples); None when the env steps with ``action``
            itself, as for discrete actions: one array less to encode and decode on the hottest
            message. Read it through ``env_step_action``.
        greedy: the action is the policy's mode, not a sample (the end-of-run evaluation
            counts only episodes acted on greedily throughout).
    """

    request_id: int
    action: np.ndarray
    log_prob: float
    value: float
    policy_version: int
    env_action: np.ndarray | None = None  # last: defaults follow the required fields
    greedy: bool = False

    @property
    def env_step_action(self) -> np.ndarray:
        """What the env steps with: ``env_action``, or ``action`` when that is None."""
        return self.action if self.env_action is None else self.env_action


class ObsBatchRequest(Message):
    """A group of envs (``env.envs_per_request``) asks for its next actions in one message.

    Attributes:
        env_key: which group, ``"{worker_index}/{first env index}+{count}"``; used for stats.
        request_id: unique per env worker, echoed in the reply to match it.
        obs: the group's observations, each key stacked to [count, ...].
    """

    env_key: str
    request_id: int
    obs: Obs


class ActionBatchReply(Message):
    """A rollout server's answer to one ``ObsBatchRequest``: one row per observation, in order.

    Attributes:
        request_id: the request's id.
        actions: [count, ...] actions (dtype as in ``ActionReply.action``).
        log_probs: float32[count], of ``actions`` under the behaviour policy.
        values: float32[count], the critic's estimates.
        policy_version: version of the weights that produced every row.
        env_actions: [count, ...] what the envs step with, when it differs from ``actions``.
        greedy: every row is the policy's mode, not a sample.
    """

    request_id: int
    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    policy_version: int
    env_actions: np.ndarray | None = None
    greedy: bool = False

    @property
    def env_step_actions(self) -> np.ndarray:
        """What the envs step with: ``env_actions``, or ``actions`` when that is None."""
        return self.actions if self.env_actions is None else self.env_actions


class TrajectoryChunk(Message):
    """Up to ``T`` consecutive steps of one env, cut at episode ends; env worker → trainer.

    Attributes:
        worker_index: index of the env worker that produced it.
        env_index: env slot within that worker.
        chunk_id: the producer's sequence number: 0, 1, 2... per ``producer``.
        obs: each key stacked to [T, ...]; ``obs[t]`` is the observation acted on at step t.
        actions: [T, ...] actions taken (dtype as in ``ActionReply.action``).
        rewards: float32[T].
        terminated: bool[T]; true where the episode ended in a terminal state.
        truncated: bool[T]; true where the episode was cut by a time limit.
        log_probs: float32[T] behaviour log-probabilities.
        values: float32[T] behaviour value estimates.
        policy_versions: int64[T] weight version that chose each action.
        bootstrap_value: value of the observation after the last step (0 if terminated).
        producer: who made it, ``worker/env#incarnation`` (unique per process start); with
            ``chunk_id`` it keeps the chunk accounting exact across crashes
            (``rlvla3/runtime/chunk_ledger.py``).
        group: GRPO only (``algo.kind: grpo``): the group of the episode these steps belong to,
            shared by the ``algo.group_size`` episodes started from the same state; "" otherwise.
        resend_from: the lowest of the producer's numbers it could still push again when this
            chunk was pushed (its resend buffer's oldest, else ``chunk_id``): one below it
            that a trainer neither holds nor settled will never arrive
            (``rlvla3/runtime/chunk_acks.py``); -1: not said.
        tag: HMAC-SHA256 of the names and numbers above under the producing env worker's key
            (``transport/chunk_auth.py``): the trainer of a multi-host run refuses a chunk
            without its producer's tag. Empty in a one-host run (no keys).
    """

    worker_index: int
    env_index: int
    chunk_id: int
    obs: Obs
    actions: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    policy_versions: np.ndarray
    bootstrap_value: float
    producer: str = ""  # last: defaults follow the required fields
    group: str = ""
    resend_from: int = -1
    tag: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class WeightsUpdate(Message):
    """Trainer → weight broadcaster: a new version of the policy weights.

    Attributes:
        version: the weight version, increasing from 0.
        layout: digest of the flat layout (``transport.weights.FlatLayout.digest``).
        flat: float32[N], every floating-point tensor of the policy's state dict, concatenated.
        tag: HMAC-SHA256 of ``version`` and a digest of ``flat`` under the run's weights key
            (``transport/weight_auth.py``); a receiver refuses a version whose tag does not
            match. Empty: unsigned (refused).
    """

    version: int
    layout: str
    flat: np.ndarray
    tag: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class WeightsRequest(Message):
    """A restarted trainer → the weight broadcaster: send the weights you hold if newer than
    ``after_version``. The answer is a ``WeightsUpdate``; version -1 with no values when the
    broadcaster holds nothing newer.

    Attributes:
        after_version: the newest version the asker already has (-1: none).
    """

    after_version: int


MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        ObsRequest,
        ActionReply,
        ObsBatchRequest,
        ActionBatchReply,
        TrajectoryChunk,
        WeightsUpdate,
        WeightsRequest,
    )
}
