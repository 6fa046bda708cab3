"""Where one launcher stands in a run: which node it is, whether it is the head, its address.

``rlvla3 launch cfg.yaml`` alone runs every node's roles on this host (a rehearsal of a
multi-node YAML on one machine: every node is loopback). ``--node NAME``, or a Slurm step
(``launch/slurm.sbatch`` runs one launcher per allocated host), starts one node's roles: then
the run spans hosts, and every node needs an address the others reach.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from rlvla3.config.nodes import Node
from rlvla3.config.run_config import Config
from rlvla3.config.typed_load import ConfigError
from rlvla3.launch import netaddr
from rlvla3.launch.slurm import HostListError, SlurmStep

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True, kw_only=True)
class Seat:
    """This launcher's place in the run.

    Attributes:
        node: the node whose roles it starts (None: every node's, all on this host).
        multi_host: the run spans hosts (addresses must be routable, traffic authenticated).
        head: the run's head node (it starts the run's Redis and decides when the run ends).
        slurm: the Slurm step it runs in, when its node came from Slurm.
        single_node: the config has one node only.
    """

    node: Node | None
    multi_host: bool
    head: Node
    slurm: SlurmStep | None = None
    single_node: bool = False

    @property
    def is_head(self) -> bool:
        """Whether this launcher starts and ends the run (a one-host launcher always does)."""
        return self.node is None or self.node.name == self.head.name

    @property
    def label(self) -> str:
        """The node's name, or ``local`` for a one-host launcher."""
        return self.node.name if self.node is not None else "local"


def find_seat(
    cfg: Config,
    node_arg: str | None,
    env: Mapping[str, str] = os.environ,
    *,
    alone_on_host: bool = True,
) -> Seat:
    """This launcher's seat: ``--node`` when given, else Slurm's node id for a multi-node YAML,
    else every node on this host. ``alone_on_host``: a second task of a Slurm step on this host
    is refused (``rlvla3 launch``: it would be a second head of the same run); ``rlvla3 eval``
    passes False, several evaluations into their own ``--out`` sharing a host being fine.

    Raises:
        ConfigError: an unknown node, or an allocation that does not fit the YAML's nodes (one
            line naming the node or group).
    """
    nodes = cfg.all_nodes()
    head = cfg.head_node()
    if node_arg is not None:
        node = cfg.node(node_arg)
        return Seat(node=node, multi_host=len(nodes) > 1, head=head, single_node=len(nodes) == 1)
    try:
        step = SlurmStep.from_env(env)
    except HostListError as err:
        raise ConfigError(f"Slurm: {err}") from None
    local_task = env.get("SLURM_LOCALID", "0")
    if alone_on_host and step is not None and local_task != "0":
        # `srun -n 2` on one host: a second launcher of the whole run, a second head, into
        # the same run dir. Local task 0 runs it; the others stop here, saying why.
        raise ConfigError(
            f"Slurm: this is task {local_task} of this host's step; one launcher runs per "
            "host (its task 0): start the step with srun --ntasks-per-node=1"
        )
    if step is None or len(step.hosts) == 1:  # no Slurm, or a one-host step (salloc, srun --pty)
        return Seat(node=None, multi_host=False, head=head, single_node=len(nodes) == 1)
    if len(step.hosts) != len(nodes):
        names = ", ".join(n.name for n in nodes)
        raise ConfigError(
            f"nodes: the Slurm allocation has {len(step.hosts)} hosts "
            f"({','.join(step.hosts)}) but the YAML's nodes are {len(nodes)} "
            f"({names}); submit with sbatch --nodes={len(nodes)}"
        )
    tasks = env.get("SLURM_STEP_NUM_TASKS")
    if tasks is not None and tasks != str(len(step.hosts)):
        raise ConfigError(
            f"Slurm: the step runs {tasks} tasks on {len(step.hosts)} hosts; a run "
            "needs one launcher per node (srun --ntasks-per-node=1)"
        )
    return Seat(node=nodes[step.node_id], multi_host=True, head=head, slurm=step)


def head_address(seat: Seat) -> str | None:
    """The head node's address when the YAML or Slurm tells it (None: find it in the run dir)."""
    if seat.head.host is not None:
        return netaddr.resolve(seat.head.host)
    if seat.slurm is None:
        return None
    name = seat.slurm.hosts[seat.head.rank]
    try:
        address = netaddr.resolve(name)
    except netaddr.AddressError:
        address = None
    if (address is None or netaddr.is_loopback(address)) and seat.head.rank == 0:
        # the batch script (and its srun) runs on the first host: Slurm knows its address
        address = seat.slurm.launch_address or address
    if address is None:
        raise netaddr.AddressError(
            f"head node {seat.head.name!r}: its Slurm host {name!r} does not resolve"
        )
    return address


def own_address(seat: Seat, head: str | None) -> str:
    """The address this node binds and advertises.

    One host: the node's configured host, else loopback. Multi-host: the configured host, else
    the address of the interface that routes to the head (the head itself: the interface that
    routes to another node of the allocation, or its host name's address); loopback is refused.

    Raises:
        netaddr.AddressError: no address other nodes can reach (names the node).
    """
    node = seat.node
    if not seat.multi_host:
        # a one-host run of several nodes ignores their hosts: those are other machines'
        host = node.host if node is not None else (seat.head.host if seat.single_node else None)
        return (
            netaddr.require_bindable(netaddr.resolve(host), f"nodes[].host {host!r}")
            if host
            else LOOPBACK
        )
    if node.host is not None:
        return netaddr.require_routable(
            node.name, netaddr.resolve(node.host), f"nodes[].host {node.host!r}"
        )
    if not seat.is_head and head is not None:
        return netaddr.require_routable(
            node.name, netaddr.route_address(head), f"the route to the head node ({head})"
        )
    if seat.is_head and seat.slurm is not None:
        # what the other nodes resolve the head's Slurm host name to, where that is routable
        # (on a host with several interfaces, the one its name points at)
        try:
            address = head_address(seat)
        except netaddr.AddressError:
            address = None
        if address is not None and not netaddr.is_loopback(address):
            return address
    peer = _another_slurm_host(seat)
    if peer is not None:
        return netaddr.require_routable(
            node.name, netaddr.route_address(peer), f"the route to {peer}"
        )
    name = socket.gethostname()
    return netaddr.require_routable(node.name, netaddr.resolve(name), f"its host name {name!r}")


def needs_secret(seat: Seat, address: str) -> bool:
    """Whether the run's roles here authenticate (CURVE, and Redis AUTH across hosts): always
    across hosts, and on one host whose address other hosts can reach (a configured LAN
    address), so that nothing a run binds beyond loopback is open."""
    return seat.multi_host or not netaddr.is_loopback(address)


def _another_slurm_host(seat: Seat) -> str | None:
    if seat.slurm is None:
        return None
    for i, host in enumerate(seat.slurm.hosts):
        if i != seat.slurm.node_id:
            try:
                address = netaddr.resolve(host)
            except netaddr.AddressError:
                continue
            if not netaddr.is_loopback(address):
                return address
    return None


def redis_port(cfg: Config, seat: Seat) -> int:
    """The port of the head's Redis: ``run.redis_port``, else Slurm's job-derived port, else 0
    (a free port, which the other nodes read from the shared run dir)."""
    if cfg.run.redis_port:
        return cfg.run.redis_port
    return seat.slurm.redis_port() if seat.slurm is not None else 0
