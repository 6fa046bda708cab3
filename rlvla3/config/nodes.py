"""Node groups: the YAML's ``nodes`` entries expanded into the concrete nodes of a run.

A ``nodes`` entry is a group of ``count`` nodes (``{name: sim, count: 2}``). A group of one is
a node called by the group's name; a larger group's nodes are ``NAME-0``, ``NAME-1``... The
run's nodes are the groups' nodes in YAML order, and that order is the one a Slurm allocation
fills: the job's first host is node 0, and so on. A role placed on a group spreads its
instances over the group's nodes round-robin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class NodeGroup(Protocol):
    """What a ``nodes`` entry of the config provides (``rlvla3.config.run_config.NodeConfig``)."""

    name: str
    count: int
    host: str | None
    devices: list[str] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """One node (host) of the run.

    Attributes:
        name: the node's name (``sim-1``, or the group's name for a group of one).
        group: the name of the ``nodes`` entry it belongs to.
        rank: its position among all nodes of the run (Slurm's node id under Slurm).
        host: the address configured for it, or None (found from the network at launch).
        devices: the devices its roles may use (``rlvla3/config/devices.py``); empty when
            the YAML lists none.
    """

    name: str
    group: str
    rank: int
    host: str | None
    devices: tuple[str, ...]


def expand(groups: Sequence[NodeGroup]) -> list[Node]:
    """The concrete nodes of ``groups``, in run order."""
    nodes: list[Node] = []
    for group in groups:
        for i in range(group.count):
            name = group.name if group.count == 1 else f"{group.name}-{i}"
            nodes.append(
                Node(
                    name=name,
                    group=group.name,
                    rank=len(nodes),
                    host=group.host,
                    devices=tuple(group.devices or ()),
                )
            )
    return nodes


def members(nodes: Sequence[Node], name: str) -> list[str]:
    """The node names ``name`` stands for: a group's nodes, or the one node of that name.

    Raises:
        KeyError: no group or node is called ``name``.
    """
    in_group = [n.name for n in nodes if n.group == name]
    if in_group:
        return in_group
    if any(n.name == name for n in nodes):
        return [name]
    raise KeyError(name)


def spread(nodes: Sequence[Node], placed: Sequence[str], count: int) -> list[str]:
    """The node of each of ``count`` instances placed on ``placed`` (groups or nodes),
    round-robin over their nodes."""
    targets: list[str] = []
    for name in placed:
        targets.extend(n for n in members(nodes, name) if n not in targets)
    return [targets[i % len(targets)] for i in range(count)]
