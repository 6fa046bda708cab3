"""Where a runner's trajectory chunks go: a PUSH socket to the trainers, the chunk ledger's
count of what was pushed (``rlvla3/runtime/chunk_ledger.py``), and a resend buffer that keeps
them until a trainer settles them (``roles/env/resend_buffer.py``)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields

import numpy as np

from rlvla3.runtime.chunk_ledger import pushed_field
from roles.env.peers import Peers
from roles.env.resend_buffer import ResendBuffer
from roles.env.role_counters import RoleCounters
from transport import sockets
from transport.chunk_auth import chunk_tag, tagged_header
from transport.messages import TrajectoryChunk

DELIVERY_S = 10.0
"""How long a closed sink's socket keeps sending the chunks it still queues (its ``LINGER``),
and so the longest an env worker waits for them at exit (``EnvWorker.shutdown``)."""


@dataclass(slots=True)
class ChunkStream:
    """One env's chunks: who produces them, their numbering and (GRPO) their group."""

    env_index: int
    """The env's index in its worker."""
    producer: str
    """``worker/env#incarnation``: the ledger's name for this env in this process start."""
    chunk_id: int = 0
    """Number of the env's next chunk (advanced only when one is sent)."""
    group: str = ""
    """GRPO: the group of the env's current episode ("" outside GRPO)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Transitions:
    """One env's consecutive transitions, ``T`` of them, as a chunk carries them: what the
    policy gave for each step, then what the env gave back."""

    obs: dict[str, np.ndarray]
    """Observations acted on, ``[T, ...]`` per key."""
    actions: np.ndarray
    """``[T, ...]``: the policy's actions."""
    log_probs: np.ndarray
    """float32 ``[T]``: log-probabilities of the actions under the acting weights."""
    values: np.ndarray
    """float32 ``[T]``: the critic's values of the observations."""
    policy_versions: np.ndarray
    """int64 ``[T]``: weight version of each action."""
    rewards: np.ndarray
    """float32 ``[T]``."""
    terminated: np.ndarray
    """bool ``[T]``."""
    truncated: np.ndarray
    """bool ``[T]`` (a simulator fault counts as a truncation)."""


@dataclass(kw_only=True, eq=False)
class ChunkSink:
    """Sends a runner's chunks to any trainer (PUSH round-robins), waiting while they are all
    busy (back-pressure), and counts each chunk sent; its socket lives in the runner's thread
    (``open``/``close`` there)."""

    counters: RoleCounters
    stop_event: threading.Event
    """The worker's stop: a chunk still waiting for a trainer then is given up."""
    peers: Peers
    worker_index: int
    trains: bool
    """Chunks reach a trainer (False: the worker only acts and records episodes)."""
    queue_hwm: int
    """Chunks queued towards the trainers before a send blocks (``chunk_queue_hwm``)."""
    resend: ResendBuffer
    """The chunks pushed and not settled yet, pushed again when a trainer restarts."""
    delivery: sockets.DeliveryContext | None = None
    """The worker's context for chunk sockets, waited for at exit so that every chunk counted
    as pushed leaves the process (None: the process-wide one, which nobody waits for)."""
    tag_key: bytes = b""
    """The worker's chunk-tag key (``transport/chunk_auth.py``); b"": a one-host run's, no tags."""
    socket: sockets.MessageSocket | None = field(default=None, init=False)

    def open(self) -> None:
        if self.socket is not None:  # (not closed by its runner)
            self.socket.close()
        self.socket = sockets.push(hwm=self.queue_hwm, delivery=self.delivery)
        # deliver pushed chunks after the close
        self.socket.raw.setsockopt(sockets.zmq.LINGER, int(DELIVERY_S * 1000))
        self.socket.connect(self.peers.trainers)

    def close(self) -> None:
        if self.socket is not None:
            if self._trainers_gone():
                self.socket.close()  # LINGER 0: see ``_to_trainers``
            else:
                self.socket.raw.close()  # lingers: what it queued is delivered at exit
            self.socket = None

    def resend_at_exit(self, deadline: float) -> None:
        """Push what a trainer restart made due and the runner did not resend (it was stopping,
        or held by back-pressure, when the restart was seen), from a socket of its own: the
        runner's thread has ended and closed its socket. The trainers stop after the env
        workers and take what is queued then, so these reach the restarted trainer instead of
        dying with this process. Gives up at ``deadline`` (``time.monotonic``)."""
        due = self.resend.take_resend()
        if not due or not self.trains:
            return
        self.open()
        try:
            for chunk in due:
                if not self._deliver(chunk, deadline=deadline):
                    break
                self.counters.count("chunks_resent")
        finally:
            self.close()

    def _trainers_gone(self) -> bool:
        """Every trainer the socket is connected to is one the worker no longer knows (killed:
        its successor published another address)."""
        assert self.socket is not None
        known = self.peers.trainers
        return bool(self.socket.addresses) and all(a not in known for a in self.socket.addresses)

    def _to_trainers(self) -> sockets.MessageSocket:
        """The socket, connected to the trainers the worker knows now. When every trainer it
        was connected to went away, it is closed without linger and opened again: what it
        queued was for them, their addresses take nothing any more, and a lingering queue
        would hold the worker's exit; the resend buffer keeps those chunks. (One trainer takes
        chunks, a data-parallel group's leader; were there more, a gone one is only
        disconnected, so nothing queued for a live one is dropped.)"""
        assert self.socket is not None, "ChunkSink.open() first"
        if self._trainers_gone():
            self.open()  # (closes this one without linger)
        else:
            self.socket.sync_peers(self.peers.trainers)
        return self.socket

    def push(self, stream: ChunkStream, steps: Transitions, bootstrap_value: float) -> None:
        """Send ``stream``'s next chunk: ``steps`` and the value of the observation after them."""
        names = {
            "worker_index": self.worker_index,
            "env_index": stream.env_index,
            "producer": stream.producer,
            "group": stream.group,
            "chunk_id": stream.chunk_id,
            "resend_from": self.resend.resend_from(stream.producer, stream.chunk_id),
        }
        tag = chunk_tag(self.tag_key, tagged_header(**names)) if self.tag_key else b""
        chunk = TrajectoryChunk(
            **names,
            bootstrap_value=bootstrap_value,
            tag=tag,
            **{f.name: getattr(steps, f.name) for f in fields(Transitions)},
        )
        self.send(stream, chunk)

    def send(self, stream: ChunkStream, chunk: TrajectoryChunk) -> None:
        """Push ``chunk`` to a trainer (waiting while they are all busy), then count it, keep it
        until it is settled and advance ``stream``'s numbering; a chunk not sent by the stop is
        not counted. What a restarted trainer should get again goes first, oldest first."""
        for kept in self.resend.take_resend():
            if not self._deliver(kept):
                self.resend.request_resend()  # still due: ``resend_at_exit`` sends them
                return
            self.counters.count("chunks_resent")
        if not self._deliver(chunk):
            return  # never sent: not counted as produced, its number not used
        with self.counters.counting_together():  # the counter and the ledger's mark agree
            self.counters.count("chunks_produced")
            self.counters.ledger_high(pushed_field(stream.producer), stream.chunk_id)
        stream.chunk_id += 1
        overflow = self.resend.add(chunk)
        if overflow:
            self.counters.count("chunks_resend_overflow", overflow)

    def _deliver(self, chunk: TrajectoryChunk, deadline: float | None = None) -> bool:
        """Push one chunk, waiting while the trainers are busy; False: the worker stopped first
        (after the stop, with a ``deadline``: that passed first)."""
        while not self._to_trainers().send(chunk, timeout_s=0.5):  # a busy trainer
            if self.stop_event.is_set() and (deadline is None or time.monotonic() >= deadline):
                return False
        return True
