"""The training group: a learner role's ``count`` ranks as one torch.distributed group.

Rank ``i`` is the role's instance ``i``; rank 0 leads. It runs a ``TCPStore`` on its node
address and advertises it in Redis (endpoint ``group``); the other ranks find it there and the
group is a gloo group on CPU, NCCL when the ranks train on CUDA. It is a group of its own, beside
the weight links (``transport/weights.py``), made the same way.

Beyond the collectives, the leader *posts* messages to the others: a JSON header in the store
(a kind, plain fields, the names, dtypes and shapes of the tensors that follow) and then one
broadcast per tensor. The followers poll the store for the next message, so their own loop keeps
beating while the leader waits for chunks, and nothing is ever unpickled: the header is JSON,
checked against ``_DTYPES`` and a size bound, and the tensors are raw collectives. A follower may
take a message's tensors one at a time as they arrive (``poll(lazy=True)``, ``receive``), so that
it never holds them all at once.
"""

from __future__ import annotations

import atexit
import datetime
import json
import math
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rlvla3.runtime.role import Role
from transport.weights import start_store

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")
}
STOP = "stop"
"""The kind of the leader's last message: the run stops (a leader that fails says nothing, so its
followers fail too and the whole group restarts)."""
POLL_IDLE_S = 0.02
"""The longest pause between a follower's polls of the leader's store: small beside a step of
many ms. The pauses start far shorter (``_FIRST_PAUSE_S``) and double, so a message posted soon
after a follower began waiting is seen within about a millisecond."""
_FIRST_PAUSE_S = 0.0005
_STOP_READ = "stop_read"  # the store's count of the ranks that read ``stop``
MAX_MESSAGE_BYTES = 8 * 2**30
"""The most a posted message's tensors may hold together (a bound on what a follower allocates)."""


class GroupError(RuntimeError):
    """The group cannot go on (a rank died or restarted, a message is malformed): every rank
    leaves with an error and the launchers restart the whole group."""


@dataclass(frozen=True, slots=True)
class Message:
    """One message the leader posted to the group."""

    kind: str
    """What the followers do with it (e.g. ``update``, ``state``, ``stop``)."""
    info: dict[str, Any]
    """Plain JSON fields."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Named tensors, on the group's device."""
    pending: tuple[tuple[str, torch.dtype, list[int]], ...] = ()
    """A message polled ``lazy``: the name, dtype and shape of each tensor still to come, in
    order (``TrainGroup.receive`` takes them; every one must be taken before the next message)."""


class TrainGroup:
    """The ranks of one learner role: collectives, and messages from rank 0.

    Args:
        store: rank 0's ``TCPStore`` (the server on rank 0, a client elsewhere).
        rank: this process's rank (its role index).
        world_size: the role's ``count``.
        device: where tensors live; ``cuda`` uses NCCL, anything else gloo.
        host: the node address gloo binds (see ``transport.weights.WeightLink``).
        timeout_s: how long a collective may wait for a rank before the group counts as broken.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        host: str,
        timeout_s: float,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.device = device
        self._seq = 0
        self._unread: list[str] = []  # headers posted that a rank may not have read yet
        self._on_close: list[Callable[[], None]] = []
        prefixed = dist.PrefixStore("train_group", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            self.backend = "nccl"
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            self.backend = "gloo"
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        _OPEN_GROUPS.add(self)

    @property
    def leader(self) -> bool:
        """Whether this is rank 0 (which publishes, checkpoints and owns the version)."""
        return self.rank == 0

    # --- collectives ---------------------------------------------------------------------------
    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.pg.allreduce([tensor], opts).wait()
        self._synchronize()
        self.all_read()  # an all-reduce needs every rank's part

    def all_read(self) -> None:
        """The leader, once every rank has entered a collective that needs its part (an
        all-reduce, FSDP's all-gathers): every rank has read the headers posted before it, so
        the store lets go of them (a broadcast does not tell: its root may finish before a
        receiver has even looked)."""
        for key in self._unread:
            self.store.delete_key(key)
        self._unread.clear()

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()
        self._synchronize()

    def _synchronize(self) -> None:
        if self.backend == "nccl":  # wait() only orders the stream; a collective must be done
            torch.cuda.current_stream(self.device).synchronize()

    # --- messages ------------------------------------------------------------------------------
    def post(self, kind: str, info: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
        """Rank 0: send a message to every other rank; returns the bytes its tensors took."""
        self._seq += 1
        specs = [
            [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
            for name, t in tensors.items()
        ]
        key = f"message/{self._seq}"
        self.store.set(key, json.dumps({"kind": kind, "info": info, "tensors": specs}))
        sent = 0
        for tensor in tensors.values():
            tensor = tensor.to(self.device).contiguous()
            self.broadcast_(tensor)
            sent += tensor.numel() * tensor.element_size()
        self._unread.append(key)
        return sent

    def poll(self, wait_s: float = 0.0, *, lazy: bool = False) -> Message | None:
        """A follower: the next message if the leader posts it within ``wait_s``, else None.
        ``lazy``: its tensors are left to ``receive``, one at a time."""
        key = f"message/{self._seq + 1}"
        if not self._posted(key, wait_s):
            return None
        self._seq += 1
        kind, info, specs = _parse_header(self.store.get(key))
        if kind == STOP:  # the leader keeps its store up until every rank has read this
            self.store.add(_STOP_READ, 1)
        message = Message(kind, info, pending=tuple(specs))
        return message if lazy else Message(kind, info, dict(self.receive(message)))

    def receive(self, message: Message) -> Iterator[tuple[str, torch.Tensor]]:
        """A follower: ``message``'s tensors by name: those it holds, then each pending one as
        it arrives (the caller keeps what it needs of one before taking the next)."""
        yield from message.tensors.items()
        for name, dtype, shape in message.pending:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            self.broadcast_(tensor)
            yield name, tensor

    def _posted(self, key: str, wait_s: float) -> bool:
        """Whether ``key`` is in the store, looking again until ``wait_s`` has passed. (The
        store's own blocking ``wait`` logs two C++ warnings at every timeout, so a follower
        polls instead, its pauses doubling from ``_FIRST_PAUSE_S`` to ``POLL_IDLE_S``.)"""
        deadline = time.monotonic() + wait_s
        pause = _FIRST_PAUSE_S
        while not self.store.check([key]):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(2 * pause, POLL_IDLE_S)
        return True

    def say_stop(self, timeout_s: float) -> bool:
        """The leader's last message: post ``stop`` and keep the store (which lives in this
        process) up until every other rank has read it, or ``timeout_s`` passes (a rank that
        is gone reads nothing). Returns whether every rank read it."""
        self.post(STOP, {}, {})
        deadline = time.monotonic() + timeout_s
        while self.store.add(_STOP_READ, 0) < self.world_size - 1:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_IDLE_S)
        return True

    def wait(
        self,
        should_stop: Callable[[], bool] = lambda: False,
        idle: Callable[[], None] = lambda: None,
        *,
        lazy: bool = False,
    ) -> Message | None:
        """A follower: poll until a message comes or ``should_stop`` (``idle`` between polls
        of ``POLL_IDLE_S`` each); ``lazy`` as ``poll``."""
        while not should_stop():
            message = self.poll(POLL_IDLE_S, lazy=lazy)
            if message is not None:
                return message
            idle()
        return None

    def follow_to_stop(self, follow: Callable[[Message], None], timeout_s: float) -> bool:
        """A follower asked to stop: go on following (``follow`` each message: the leader may
        have posted work this rank must take part in) until the leader says ``stop``, its store
        goes away (the leader is gone: no rank is left to wait for), or ``timeout_s`` passes.
        Returns whether the leader said ``stop``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                message = self.poll(POLL_IDLE_S)
            except dist.DistNetworkError:  # the leader's store is gone
                return False
            if message is not None and message.kind == STOP:
                return True
            if message is not None:
                follow(message)
        return False

    def on_close(self, teardown: Callable[[], None]) -> None:
        """Call ``teardown`` when the group closes, before its process group shuts down (what
        was built on the group, e.g. the default process group ``algo.sharding`` makes of it;
        the newest first)."""
        self._on_close.append(teardown)

    def close(self) -> None:
        """Leave the group: what was built on it goes first (``on_close``), then the process
        group shuts down, its threads stopped and its sockets closed while Python still runs.
        Dropping the reference alone is not enough where something else holds the process
        group (the default group of a sharded trainer does)."""
        pg, self.pg = self.pg, None
        _OPEN_GROUPS.discard(self)
        while self._on_close:
            self._on_close.pop()()
        if pg is not None:
            pg.shutdown()


_OPEN_GROUPS: weakref.WeakSet[TrainGroup] = weakref.WeakSet()
"""Groups not closed yet. A process that exits with one open tears gloo's threads down in the
interpreter's last C++ destructors, which can abort it (``terminate called without an active
exception``); closing them first, at exit, shuts each process group down while Python still
runs."""


@atexit.register
def _close_open_groups() -> None:
    for group in list(_OPEN_GROUPS):
        group.close()


def _parse_header(
    raw: bytes,
) -> tuple[str, dict[str, Any], list[tuple[str, torch.dtype, list[int]]]]:
    """A posted header's kind, fields and tensor specs; a ``GroupError`` naming what is wrong."""
    try:
        header = json.loads(raw)
        kind, info, specs = header["kind"], header["info"], header["tensors"]
    except (ValueError, KeyError, TypeError) as err:
        raise GroupError(f"group message: not a header ({err})") from None
    if not isinstance(kind, str) or not isinstance(info, dict) or not isinstance(specs, list):
        raise GroupError("group message: kind, info or tensors of the wrong type")
    parsed, total = [], 0
    for spec in specs:
        if not (isinstance(spec, list) and len(spec) == 3 and spec[1] in _DTYPES):
            raise GroupError(
                f"group message {kind}: tensor spec {spec!r:.80} not [name, dtype, shape]"
            )
        name, dtype, shape = spec[0], _DTYPES[spec[1]], spec[2]
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise GroupError(f"group message {kind}: tensor {name!r:.40} shape {shape!r:.80}")
        total += math.prod(shape) * dtype.itemsize
        parsed.append((str(name), dtype, shape))
    if total > MAX_MESSAGE_BYTES:
        raise GroupError(
            f"group message {kind}: {total} bytes of tensors, over {MAX_MESSAGE_BYTES}"
        )
    return kind, info, parsed


def leader_store(host: str, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, on a free port of ``host``."""
    return start_store(host, timeout_s=timeout_s)


def follower_store(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of rank 0's store at ``host:port``."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(
        host,
        int(port),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


# --- forming the group of a role's ranks ---------------------------------------------------------

_ENDPOINT = "group"


def join_group(
    role: Role, device: torch.device, join_timeout_s: float = 120.0
) -> TrainGroup | None:
    """Form the group of ``role``'s ``count`` ranks (None when it has one: no group). Rank 0
    starts the store and advertises it; the others find it in Redis. Collectives wait up to
    ``run.stall_timeout_s`` for a rank."""
    world_size = role.cfg.num_processes(role.name)
    if world_size < 2:
        return None
    timeout_s = role.cfg.run.stall_timeout_s
    if role.index == 0:
        store = leader_store(role.address, timeout_s=join_timeout_s)
        role.registry.publish_endpoint(role.name, 0, _ENDPOINT, f"{role.address}:{store.port}")
    else:
        store = _leader_store(role, join_timeout_s)
    with role.busy(f"forming the {role.name} group of {world_size} ranks", up_to_s=join_timeout_s):
        group = TrainGroup(store, role.index, world_size, device, role.address, timeout_s)
    role.log.info("rank %d of %d (%s)", role.index, world_size, group.backend)
    return group


def _leader_store(role: Role, join_timeout_s: float) -> dist.TCPStore:
    """A client of rank 0's store; a store that does not answer (a rank 0 that is going away,
    whose record still shows) is retried until ``join_timeout_s``."""
    deadline = time.monotonic() + join_timeout_s
    while True:
        address = role.wait_for_endpoints(role.name, _ENDPOINT, timeout_s=join_timeout_s)[0]
        try:
            return follower_store(address, timeout_s=min(10.0, join_timeout_s))
        except (RuntimeError, OSError) as err:  # DistNetworkError, DistStoreError
            if time.monotonic() > deadline:
                raise GroupError(f"rank 0's store at {address} does not answer: {err}") from None
            role.log.info("rank 0's store at %s does not answer yet (%s)", address, err)
            if role.stop_event.wait(0.5):
                raise InterruptedError("stopped while joining the group") from None
