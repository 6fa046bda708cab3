"""Versioned weight broadcast: flat bucketed buffers over torch.distributed (gloo / NCCL).

The broadcaster runs a ``TCPStore`` and forms one two-rank process group with each rollout server
(``WeightLink``). A pair per server, instead of one group of all, means a server that joins late
or restarts gets its own fresh group and the current version at once, and a server that dies only
breaks its own link: nobody else's broadcast hangs. The broadcaster drives all links in parallel
threads, so a sync costs about one broadcast of the flat buffer.

Weights travel as one flat float32 buffer (``FlatLayout`` says which slice is which parameter),
sent in a few large buckets — not one call per tensor. Trainers hand each version to the
broadcaster over ZeroMQ (``transport/weight_publisher.py``).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from transport.weight_auth import NO_TAG, TAG_BYTES

BUCKET_BYTES = 64 << 20
_TAG_WORDS = TAG_BYTES // 8
_HEADER_LEN = 2 + _TAG_WORDS  # [version, numel, tag as int64 words]


class LinkHeader(NamedTuple):
    """What precedes each version's weights on a link.

    Attributes:
        version: the weight version.
        numel: how many float32 values follow.
        tag: the version's HMAC (``transport/weight_auth.py``), checked by the receiver.
    """

    version: int
    numel: int
    tag: bytes


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Where each tensor of a module's state dict lives in the flat buffer.

    Attributes:
        names: state-dict keys, in order.
        shapes: their shapes.
        numel: total number of elements.
        digest: short hash of names and shapes; both sides must agree on it.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    digest: str

    @staticmethod
    def of(module: nn.Module) -> FlatLayout:
        """The layout of ``module``'s floating-point state (parameters and float buffers), or,
        where the module trains only part of it (``trained_state_names``: a policy with LoRA),
        of that part alone: the rest is frozen, and each side loads it itself."""
        state = module.state_dict()
        trained = trained_state_names(module)
        keys = state if trained is None else trained
        items = [(k, tuple(state[k].shape)) for k in keys if state[k].is_floating_point()]
        text = ";".join(f"{k}:{'x'.join(map(str, s))}" for k, s in items)
        numel = sum(int(torch.Size(s).numel()) for _, s in items)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return FlatLayout(tuple(k for k, _ in items), tuple(s for _, s in items), numel, digest)

    def flatten(self, module: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the module's state into one float32 buffer (``out`` reused when given)."""
        state = module.state_dict()
        first = state[self.names[0]]
        flat = (
            out
            if out is not None
            else torch.empty(self.numel, dtype=torch.float32, device=first.device)
        )
        offset = 0
        for name in self.names:
            t = state[name]
            flat[offset : offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        return flat

    def bind(self, module: nn.Module) -> torch.Tensor:
        """Make the module's floating-point parameters and buffers views of one new flat buffer.

        Returns the buffer (float32, on the module's device, holding the current values): a
        receive into it updates the module in place, with no second copy. Call it after the
        module has reached its device (``.to()`` would make new, unbound tensors), and before
        anything (an optimizer) holds its parameters: they are replaced by new ``Parameter``
        objects, which share the buffer's version counter.

        Raises:
            ValueError: the module's tensors are not float32, or share storage (tied weights
                would be untied).
        """
        tensors = dict(module.state_dict(keep_vars=True))
        missing = [name for name in self.names if name not in tensors]
        if missing or len({tensors[n].data_ptr() for n in self.names}) != len(self.names):
            raise ValueError(f"cannot bind: missing {missing} or tensors share storage")
        if any(tensors[n].dtype != torch.float32 for n in self.names):
            raise ValueError("cannot bind: only float32 modules can be views of a float32 buffer")
        flat = self.flatten(module)
        owners = dict(module.named_modules())
        offset = 0
        with torch.no_grad():
            for name, shape in zip(self.names, self.shapes, strict=True):
                view = flat[offset : offset + torch.Size(shape).numel()].view(shape)
                offset += view.numel()
                owner_name, _, attr = name.rpartition(".")
                owner = owners[owner_name]
                if attr in owner._parameters:
                    # A new Parameter over the view, not ``.data = view``: it shares the
                    # buffer's version counter, so a write into the buffer counts as an
                    # in-place update of the parameter (caches keyed on it see the change).
                    requires_grad = owner._parameters[attr].requires_grad
                    owner._parameters[attr] = nn.Parameter(view, requires_grad=requires_grad)
                else:
                    owner._buffers[attr] = view
        return flat

    def load(self, module: nn.Module, flat: torch.Tensor) -> None:
        """Copy a flat buffer back into the module's tensors, in place."""
        if flat.numel() != self.numel:
            raise ValueError(
                f"flat weights have {flat.numel()} elements, layout needs {self.numel}"
            )
        state = module.state_dict()
        offset = 0
        with torch.no_grad():
            for name, shape in zip(self.names, self.shapes, strict=True):
                t = state[name]
                t.copy_(flat[offset : offset + t.numel()].view(shape))
                offset += t.numel()


@dataclass(slots=True)
class WeightTarget:
    """Where a receiver's module takes a flat weight buffer: the module's own tensors when
    they are float32 (``FlatLayout.bind``: a receive lands in them, no copy), else a float32
    buffer that ``commit`` copies into them (a bfloat16 model: float32 holds every bfloat16
    value exactly, so the copy back loses nothing).

    Attributes:
        layout: the flat layout.
        module: the receiving module.
        flat: the float32 buffer a receive writes.
        bound: whether ``flat`` is the module's own storage (``commit`` then does nothing).
    """

    layout: FlatLayout
    module: nn.Module
    flat: torch.Tensor
    bound: bool

    @staticmethod
    def of(
        layout: FlatLayout, module: nn.Module, receive: torch.Tensor | None = None
    ) -> WeightTarget:
        """Bind a float32 module; give any other the float32 buffer ``receive`` (shared by
        copies that never receive at once), or a new one of its current values."""
        state = module.state_dict()
        if all(state[name].dtype == torch.float32 for name in layout.names):
            return WeightTarget(layout, module, layout.bind(module), bound=True)
        flat = layout.flatten(module) if receive is None else receive
        return WeightTarget(layout, module, flat, bound=False)

    def commit(self) -> None:
        """Make the module hold the buffer's values (a no-op when bound)."""
        if not self.bound:
            self.layout.load(self.module, self.flat)


def trained_state_names(module: nn.Module) -> list[str] | None:
    """The state-dict keys training changes, when the module says it trains only part of its
    state (``ActorCritic.trained_state_names``: a policy with LoRA, its adapters and heads);
    None: the whole state."""
    method = getattr(module, "trained_state_names", None)
    return None if method is None else method()


def _buckets(flat: torch.Tensor) -> list[torch.Tensor]:
    step = max(1, BUCKET_BYTES // flat.element_size())
    return [flat[i : i + step] for i in range(0, flat.numel(), step)]


def start_store(host: str, timeout_s: float = 60.0) -> dist.TCPStore:
    """A ``TCPStore`` server on a free port of ``host`` (read the port from ``store.port``).

    It listens on ``host`` alone: given only a port, a TCPStore listens on every interface, so
    the socket is bound here and handed over (``master_listen_fd``)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as listener:
        listener.bind(address)
        listener.listen(128)
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=listener.fileno(),
        )
        listener.detach()  # the store owns the socket now; closed here only if it failed
    return store


class WeightLink:
    """One two-rank process group: rank 0 the broadcaster, rank 1 one rollout server.

    Args:
        store: the broadcaster's store (rank 0) or a client of it (rank 1).
        link_id: unique name of this link (the server's id); both sides use the same.
        rank: 0 on the broadcaster, 1 on the server.
        device: ``cpu`` uses gloo; ``cuda`` uses NCCL between two GPUs. When both ends sit on
            the same GPU, NCCL refuses ("Duplicate GPU detected") unless each process tells it
            a different ``NCCL_HOSTID``: then it takes them for two hosts and links them over
            its socket transport. So on one GPU the link is NCCL when both ends' ``NCCL_HOSTID``
            are set and differ, and gloo (on the CUDA tensors) otherwise.
        timeout_s: how long a broadcast may take before the link counts as broken.
        form_timeout_s: how long forming the link may wait for the other end (default
            ``timeout_s``): a server receiving from a store where no one forms its link (a
            stale or hostile record) gives up after it, yet waits ``timeout_s`` for a version.
            (NCCL forms its links at their first broadcast: there ``timeout_s`` bounds both.)
        host: the address this end listens on and advertises to the other (gloo binds its
            pair there; without it gloo takes the address the host name resolves to, which
            on many hosts is loopback and unreachable from another node). NCCL's own
            bootstrap follows ``NCCL_SOCKET_IFNAME``, which the launcher sets to the
            interface holding this address.

    ``backend`` says which library the link uses.
    """

    def __init__(
        self,
        store: dist.Store,
        link_id: str,
        rank: int,
        device: str = "cpu",
        timeout_s: float = 60.0,
        host: str = "127.0.0.1",
        form_timeout_s: float | None = None,
    ) -> None:
        self.link_id = link_id
        self.rank = rank
        self.device = torch.device(device)
        prefixed = dist.PrefixStore(f"weights/{link_id}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.backend = "gloo"
        self.group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None
        if self.device.type == "cuda" and _nccl_can_link(prefixed, rank, self.device):
            self.backend = "nccl"
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = (
                timeout  # NCCL's watchdog default (10 min) would end a waiting server
            )
            self.group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            # gloo meets the other end inside its constructor, under the options' timeout
            options._timeout = datetime.timedelta(seconds=form_timeout_s or timeout_s)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self.group = dist.ProcessGroupGloo(prefixed, rank, 2, options)
            self.group.set_timeout(timeout)
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    def close(self) -> None:
        """Leave the link: its connections close, so the other end's pending broadcast fails
        at once (gloo's ``abort`` and ``shutdown`` leave them open)."""
        self.group = None  # the last reference: the group is destroyed and its sockets closed

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self.group is None:
            raise ConnectionError(f"link {self.link_id} is closed")
        self.group.broadcast([tensor], self._opts).wait()
        if self.backend == "nccl":
            # NCCL's wait() only orders the current stream after the collective; block until the
            # bytes are there, so a send means delivered (or raises) as it does over gloo.
            torch.cuda.current_stream(self.device).synchronize()

    def send(self, version: int, flat: torch.Tensor, tag: bytes = NO_TAG) -> None:
        """Rank 0: send ``flat`` as weight ``version``, with its ``tag`` (HMAC)."""
        padded = bytearray(tag[:TAG_BYTES].ljust(TAG_BYTES, b"\0"))
        words = torch.frombuffer(padded, dtype=torch.int64)
        header = torch.cat([torch.tensor([version, flat.numel()], dtype=torch.int64), words])
        self._broadcast(header.to(self.device))
        for bucket in _buckets(flat):
            self._broadcast(bucket)

    def recv(self, out: torch.Tensor) -> int:
        """Rank 1: receive the next version into ``out``; returns its version number."""
        header = self.recv_header()
        self.recv_body(out, header.version, header.numel)
        return header.version

    def recv_header(self) -> LinkHeader:
        """Rank 1: wait for the next version's header. The weights follow and must be taken
        with ``recv_body`` (split so a receiver can lock its buffer only while the bytes
        arrive, not while it waits for the trainer)."""
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
        self._broadcast(header)
        header = header.cpu()
        return LinkHeader(int(header[0]), int(header[1]), header[2:].numpy().tobytes())

    def recv_body(self, out: torch.Tensor, version: int, numel: int) -> None:
        """Rank 1: receive the weights announced by ``recv_header`` into ``out``, in place."""
        if numel != out.numel():
            raise ValueError(
                f"weights version {version} has {numel} elements, expected {out.numel()}"
            )
        for bucket in _buckets(out):
            self._broadcast(bucket)
        # The collective wrote ``out`` behind autograd's back: count it as the in-place write
        # it is, so whatever caches values of ``out`` or of its views (the numpy serving path's
        # fused weights, ``rlvla3/policy/mlp_numpy.py``) sees the new version.
        torch.autograd.graph.increment_version(out)


def _nccl_can_link(store: dist.Store, rank: int, device: torch.device) -> bool:
    """Whether NCCL accepts both ends of a link (see ``nccl_accepts``). Each end publishes its
    GPU's UUID and ``NCCL_HOSTID`` in the link's store and reads the other's (waiting up to the
    store's timeout)."""
    mine = (str(torch.cuda.get_device_properties(device).uuid), os.environ.get("NCCL_HOSTID", ""))
    store.set(f"gpu_uuid/{rank}", mine[0])
    store.set(f"nccl_hostid/{rank}", mine[1])
    theirs = (
        store.get(f"gpu_uuid/{1 - rank}").decode(),
        store.get(f"nccl_hostid/{1 - rank}").decode(),
    )
    return nccl_accepts(mine, theirs)


def nccl_accepts(mine: tuple[str, str], theirs: tuple[str, str]) -> bool:
    """Whether NCCL links two ends given as ``(GPU UUID, NCCL_HOSTID or "")``: different GPUs,
    or one GPU shared by processes that set different host ids."""
    (my_gpu, my_host), (their_gpu, their_host) = mine, theirs
    if my_gpu != their_gpu:
        return True
    return bool(my_host) and bool(their_host) and my_host != their_host
