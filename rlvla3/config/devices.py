"""Which device each role instance runs on: its ``settings.device`` read against its node's
``devices``, decided once by the launcher and handed to the process (``--device``).

The rule, as ``torchrun`` (``cuda:LOCAL_RANK``) and Ray (a GPU of the node per actor) place
workers:

- ``cpu`` stays ``cpu``.
- A device with an index (``cuda:1``) is that device: an explicit choice wins. When the node
  lists its ``devices``, it must be one of them.
- A device type alone (``cuda``) takes the node's devices of that type in turn: the ``i``-th
  instance of the role on that node gets the ``i % n``-th of its ``n``. A node whose list has
  none of that type cannot serve it (a config error naming ``nodes[k].devices``). A node that
  lists no ``devices`` leaves the device as written (torch's current device of that type).

Ranks of one training group (``trainer``, ``sft_trainer``) on one node must not share a GPU:
NCCL refuses two ranks on one device ("Duplicate GPU detected") unless every process has its
own ``NCCL_HOSTID`` (``run.nccl_shared_gpu``). Such a placement is a config error naming the
field to change.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlvla3.config import nodes as node_groups
from rlvla3.config.typed_load import ConfigError

TRAINING_GROUP_ROLES = ("trainer", "sft_trainer")
"""Roles whose instances form one torch.distributed group (docs/data-parallel.md)."""


def device_type(device: str) -> str:
    """``cuda`` of ``cuda:1`` (and of ``cuda``)."""
    return device.partition(":")[0]


def has_index(device: str) -> bool:
    """Whether ``device`` names one device (``cuda:1``), not only a type (``cuda``)."""
    return ":" in device


def device_plan(
    groups: Sequence[node_groups.NodeGroup],
    role: str,
    requested: str,
    placement: Sequence[str],
) -> list[str]:
    """The device of every instance of ``role`` (by index), whose ``settings.device`` is
    ``requested`` and whose instance ``i`` runs on node ``placement[i]``.

    Raises:
        ConfigError: a node cannot serve ``requested`` (naming the field to change).
    """
    nodes = {n.name: n for n in node_groups.expand(groups)}
    on_node: dict[str, int] = {}
    plan = []
    for node_name in placement:
        local_index = on_node.get(node_name, 0)
        on_node[node_name] = local_index + 1
        plan.append(_device_on(groups, nodes[node_name], role, requested, local_index))
    return plan


def _device_on(
    groups: Sequence[node_groups.NodeGroup],
    node: node_groups.Node,
    role: str,
    requested: str,
    local_index: int,
) -> str:
    if device_type(requested) == "cpu" or not node.devices:
        return requested
    listed = f"{_devices_field(groups, node)} {list(node.devices)}"
    if has_index(requested):
        if requested not in node.devices:
            raise ConfigError(
                f"roles.{role}.settings.device: {requested!r} is not among node "
                f"{node.name!r}'s devices ({listed}); name one of them, or the type alone "
                f"({device_type(requested)!r}) to take the node's in turn"
            )
        return requested
    of_type = [d for d in node.devices if has_index(d) and device_type(d) == requested]
    if not of_type:
        raise ConfigError(
            f"{_devices_field(groups, node)}: node {node.name!r} lists no {requested} device "
            f"({list(node.devices)}), but roles.{role}.settings.device asks for one"
        )
    return of_type[local_index % len(of_type)]


def check_node_devices(groups: Sequence[node_groups.NodeGroup]) -> None:
    """Each ``nodes[k].devices`` that is given: a non-empty list of distinct devices, each
    ``cpu`` or a type with an index (``cuda:0``).

    Raises:
        ConfigError: naming the entry.
    """
    for k, group in enumerate(groups):
        if group.devices is None:
            continue
        bad = [d for d in group.devices if not (d == "cpu" or _indexed(d))]
        if not group.devices or bad or len(set(group.devices)) < len(group.devices):
            raise ConfigError(
                f"nodes[{k}].devices: {group.devices} must list distinct devices, each "
                "cpu or a type with an index (cuda:0); leave it out to take every role's "
                "settings.device as written"
            )


def _indexed(device: str) -> bool:
    kind, _, index = device.partition(":")
    return bool(kind) and index.isdigit()


def check_group_devices(
    groups: Sequence[node_groups.NodeGroup],
    role: str,
    requested: str,
    placement: Sequence[str],
    plan: Sequence[str],
) -> None:
    """Refuse two ranks of a training group given one GPU of one node (NCCL would refuse them
    at start) unless ``run.nccl_shared_gpu``; the caller knows whether it is set.

    Raises:
        ConfigError: naming ``nodes[k].devices`` (too few listed for the ranks placed there) or
            ``roles.<role>.settings.device`` (one device named for several ranks).
    """
    seen: dict[tuple[str, str], int] = {}
    nodes = {n.name: n for n in node_groups.expand(groups)}
    for rank, (node_name, device) in enumerate(zip(placement, plan, strict=True)):
        if device_type(device) != "cuda":
            continue
        first = seen.setdefault((node_name, device), rank)
        if first == rank:
            continue
        ranks = placement.count(node_name)
        node = nodes[node_name]
        where = f"{role} ranks {first} and {rank} would share {device} on node {node_name!r}"
        fix = "or set run.nccl_shared_gpu: true (NCCL over sockets on one GPU)"
        if has_index(requested) or not node.devices:
            raise ConfigError(
                f"roles.{role}.settings.device: {where}; give the ranks a node each, list "
                f"the node's devices and ask for {device_type(device)!r} (one each), {fix}"
            )
        raise ConfigError(
            f"{_devices_field(groups, node)}: {where}: {ranks} ranks on that node, "
            f"{list(node.devices)} listed; list a device per rank, {fix}"
        )


def _devices_field(groups: Sequence[node_groups.NodeGroup], node: node_groups.Node) -> str:
    """``nodes[k].devices`` of the ``nodes`` entry ``node`` belongs to."""
    k = next(i for i, group in enumerate(groups) if group.name == node.group)
    return f"nodes[{k}].devices"
