"""A runner's line to the rollout servers: one observation request per group step, re-sent
until a live server answers it."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from rlvla3.algo.number_limits import MAX_MAGNITUDE, usable, usable_number
from roles.env.peers import Peers
from roles.env.role_counters import RoleCounters
from transport import sockets
from transport.messages import ActionBatchReply, ActionReply, ObsBatchRequest, ObsRequest
from transport.socket_limits import reply_limits


@dataclass(frozen=True, slots=True)
class Act:
    """One env's answer from a rollout server (an ``ActionReply`` or a row of an
    ``ActionBatchReply``)."""

    action: np.ndarray
    """The action as the policy chose it (what the trainer learns from)."""
    env_action: np.ndarray
    """The action as the env steps it."""
    log_prob: float
    """Log-probability of ``action`` under the acting weights."""
    value: float
    """The critic's value of the observation acted on."""
    version: int
    """Weight version that chose it."""
    greedy: bool
    """The policy's mode, not a sample."""


MAX_POLICY_VERSION = 2**62
"""Above any version a run reaches (the weight path refuses more, too): a reply claiming one
would overflow the chunks' int64 version arrays."""


def reply_problem(reply: ActionReply | ActionBatchReply, rows: int | None) -> str | None:
    """Why a rollout server's reply to a request of ``rows`` observations (None: one) cannot
    be acted on, naming the field; None if it can."""
    if not 0 <= reply.policy_version <= MAX_POLICY_VERSION:
        return f"policy_version {reply.policy_version}: outside [0, 2**62]"
    if isinstance(reply, ActionReply):
        if not (usable_number(reply.log_prob) and usable_number(reply.value)):
            return f"log_prob, value: not finite or beyond {MAX_MAGNITUDE:.0e}"
        return _float_actions_problem({"action": reply.action, "env_action": reply.env_action})
    fields = {"actions": reply.actions, "log_probs": reply.log_probs, "values": reply.values}
    if reply.env_actions is not None:
        fields["env_actions"] = reply.env_actions
    for name, arr in fields.items():
        if arr.ndim == 0 or len(arr) != rows:
            return f"{name}: {arr.dtype}{list(arr.shape)} for {rows} observations"
    for name in ("log_probs", "values"):
        arr = fields[name]
        if arr.ndim != 1 or arr.dtype.kind != "f" or not usable(arr, MAX_MAGNITUDE):
            return (
                f"{name}: {arr.dtype}{list(arr.shape)}, expected {rows} finite floats "
                f"within {MAX_MAGNITUDE:.0e}"
            )
    return _float_actions_problem({"actions": reply.actions, "env_actions": reply.env_actions})


def _float_actions_problem(actions: dict[str, np.ndarray | None]) -> str | None:
    """Why continuous actions cannot be stepped and trained on (NaN, inf, or beyond
    ``MAX_MAGNITUDE``: the trainer would refuse the whole chunk), None if they can."""
    for name, arr in actions.items():
        if arr is not None and arr.dtype.kind == "f" and not usable(arr, MAX_MAGNITUDE):
            return f"{name}: not finite or beyond {MAX_MAGNITUDE:.0e}"
    return None


def acts_of(reply: ActionReply | ActionBatchReply) -> list[Act]:
    """The reply's answers, one per env asked for."""
    if isinstance(reply, ActionReply):
        act = Act(
            reply.action,
            reply.env_step_action,
            reply.log_prob,
            reply.value,
            reply.policy_version,
            reply.greedy,
        )
        return [act]
    env_actions = reply.env_step_actions
    log_probs, values = reply.log_probs.tolist(), reply.values.tolist()
    return [
        Act(
            reply.actions[i],
            env_actions[i],
            log_probs[i],
            values[i],
            reply.policy_version,
            reply.greedy,
        )
        for i in range(len(log_probs))
    ]


@dataclass(kw_only=True, eq=False)
class PolicyClient:
    """Asks any live rollout server for actions (a DEALER round-robins over them), numbering
    its requests so that a late reply to an earlier one is skipped; re-sends on timeout; counts
    requests, their wait, timeouts and undecodable replies. Its socket lives in the runner's
    thread (``open``/``close`` there)."""

    env_key: str
    """Names the asking group in its requests (``worker/env`` or ``worker/env+count``)."""
    env_index: int
    """The group's first env (names it in logs)."""
    timeout_s: float
    """An unanswered request is re-sent after this long (``request_timeout_s``)."""
    rows: int = 1
    """Envs in the group: rows in each reply (bounds the reply socket's frames)."""
    peers: Peers
    counters: RoleCounters
    log: logging.Logger
    stop_event: threading.Event
    """The worker's stop: a request still unanswered then is given up (``InterruptedError``)."""
    request_id: int = field(default=0, init=False)
    answered: bool = field(default=False, init=False)
    """Any reply yet: before the first, waiting is expected (servers wait for weights)."""
    dealer: sockets.MessageSocket | None = field(default=None, init=False)

    def open(self) -> None:
        self.dealer = sockets.dealer(
            hwm=100, on_bad_frame=self.counters.count_bad_frame, limits=reply_limits(self.rows)
        )

    def close(self) -> None:
        if self.dealer is not None:
            self.dealer.close()

    def act(self, obs: list[dict[str, np.ndarray]]) -> list[Act]:
        """Actions for each env's observation in ``obs``, asked for in one message."""
        if len(obs) == 1:
            return acts_of(self.ask(obs[0], rows=None))
        batch = {key: np.stack([o[key] for o in obs]) for key in obs[0]}
        return acts_of(self.ask(batch, rows=len(obs)))

    def act_on_states(self, states: np.ndarray) -> ActionBatchReply:
        """The reply to ``states`` (``[envs, obs_dim]``, a vector env's observations)."""
        reply = self.ask({"state": states}, rows=len(states))
        assert isinstance(reply, ActionBatchReply)
        return reply

    def ask(self, obs: dict[str, np.ndarray], rows: int | None) -> ActionReply | ActionBatchReply:
        """The reply to one env's observation (``rows`` None: an ``ObsRequest``) or to ``rows``
        stacked ones (an ``ObsBatchRequest``)."""
        asked = time.perf_counter()
        try:
            return self._until_answered(obs, rows)
        finally:  # the action round trip as the envs see it (monitor / async benchmark)
            n = 1 if rows is None else rows
            self.counters.count("action_requests", n)
            self.counters.count("action_wait_us", round((time.perf_counter() - asked) * 1e6) * n)

    def _until_answered(
        self, obs: dict[str, np.ndarray], rows: int | None
    ) -> ActionReply | ActionBatchReply:
        assert self.dealer is not None, "PolicyClient.open() first"
        while True:
            self.dealer.sync_peers(self.peers.servers)
            self.request_id += 1
            if rows is None:
                request: ObsRequest | ObsBatchRequest = ObsRequest(
                    env_key=self.env_key, request_id=self.request_id, obs=obs
                )
            else:
                request = ObsBatchRequest(env_key=self.env_key, request_id=self.request_id, obs=obs)
            self.dealer.send(request)
            reply = self._reply(rows, deadline=time.monotonic() + self.timeout_s)
            if reply is not None:
                self.answered = True
                return reply
            self._timed_out()

    def _reply(self, rows: int | None, deadline: float) -> ActionReply | ActionBatchReply | None:
        """The reply to the request just sent, or None if none came by ``deadline``."""
        assert self.dealer is not None
        warned = False
        while time.monotonic() < deadline:
            if self.stop_event.is_set():
                raise InterruptedError
            reply = self.dealer.recv(timeout_s=0.2)
            if getattr(reply, "request_id", None) != self.request_id:
                continue  # a late reply to an earlier request, or nothing yet
            if (rows is None and isinstance(reply, ActionReply)) or (
                rows is not None and isinstance(reply, ActionBatchReply)
            ):
                problem = reply_problem(reply, rows)
                if problem is None:
                    return reply
                # a broken or hostile server's: waited out, then asked again (any server)
                self.counters.count("bad_replies")
                if not warned:  # (once per request: a hostile server could send many)
                    warned = True
                    self.log.warning("env %d: refused a reply: %s", self.env_index, problem)
        return None

    def _timed_out(self) -> None:
        self.counters.count("request_timeouts")
        if self.answered:
            self.log.warning(
                "env %d: no reply in %.1fs; re-sending", self.env_index, self.timeout_s
            )
        else:  # servers answer once a trainer has published weights (SFT: after its data)
            self.log.info(
                "env %d: no action yet (servers wait for the first weights); asking again",
                self.env_index,
            )
