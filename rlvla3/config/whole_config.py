"""The whole run configuration, ``Config``: one YAML file's sections
(``rlvla3/config/sections.py``) and what they say together: process counts, nodes, placement,
each role's settings and devices. Loading and the checks across sections live beside it
(``run_config.py``, ``checks.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlvla3.config import devices
from rlvla3.config import nodes as node_groups
from rlvla3.config.role_settings import RoleSettings
from rlvla3.config.role_table import ROLE_TABLE
from rlvla3.config.sections import (
    AlgoConfig,
    EnvConfig,
    NodeConfig,
    PolicyConfig,
    RoleConfig,
    RunConfig,
    SftConfig,
)
from rlvla3.config.typed_load import ConfigError, from_dict


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The whole run, as one YAML file describes it."""

    run: RunConfig = field(default_factory=RunConfig)
    """Identity, mode, bookkeeping and stop rules."""
    nodes: list[NodeConfig] = field(default_factory=lambda: [NodeConfig(name="local")])
    """The hosts (or groups of hosts) of the run."""
    roles: dict[str, RoleConfig] = field(default_factory=dict)
    """Role name -> how many processes, where, with which settings."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The simulator."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The policy network."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The RL algorithm."""
    sft: SftConfig = field(default_factory=SftConfig)
    """Supervised pretraining."""

    def role_settings(self, role: str) -> RoleSettings:
        """The typed settings dataclass of ``role``, validated against its schema."""
        raw = self.roles[role].settings if role in self.roles else {}
        return from_dict(ROLE_TABLE[role].settings, raw, f"roles.{role}.settings")

    def num_processes(self, role: str) -> int:
        """How many processes of ``role`` the run has (0: the role is not in ``roles``)."""
        return self.roles[role].count if role in self.roles else 0

    def round_steps(self) -> int:
        """Env steps of one rollout round: every training env's ``chunk_len`` steps (a run
        without env workers counts one worker)."""
        workers = self.num_processes("env_worker") or 1
        return workers * self.env.num_envs_per_worker * self.env.chunk_len

    def total_processes(self) -> int:
        """How many role processes the run has, every role on every node together."""
        return sum(rc.count for rc in self.roles.values())

    def all_nodes(self) -> list[node_groups.Node]:
        """Every node of the run (groups expanded), in the order an allocation fills them."""
        return node_groups.expand(self.nodes)

    def node(self, name: str) -> node_groups.Node:
        """The node called ``name`` (a group of one is also found by the group's name)."""
        found = self.all_nodes()
        for node in found:
            if node.name == name:
                return node
        known = ", ".join(n.name for n in found)
        raise ConfigError(f"nodes: no node named {name!r} (nodes: {known})")

    def head_node(self) -> node_groups.Node:
        """The node whose launcher starts the run (``run.head``, else the first node)."""
        if self.run.head is None:
            return self.all_nodes()[0]
        return self.node(node_groups.members(self.all_nodes(), self.run.head)[0])

    def placement(self, role: str) -> list[str]:
        """Node name of every instance of ``role``, by index."""
        rc = self.roles[role]
        placed = [rc.node] if isinstance(rc.node, str) else rc.node
        if not placed:
            placed = [self.all_nodes()[0].name]
        return node_groups.spread(self.all_nodes(), placed, rc.count)

    def device_plan(self, role: str) -> list[str | None]:
        """The device of every instance of ``role``, by index (``rlvla3/config/devices.py``:
        its ``settings.device`` against its node's ``devices``); None for a role without a
        ``device`` setting (env workers)."""
        requested = getattr(self.role_settings(role), "device", None)
        if requested is None:
            return [None] * self.num_processes(role)
        return list(devices.device_plan(self.nodes, role, requested, self.placement(role)))

    def placed_settings(self, role: str, index: int, device: str | None = None) -> RoleSettings:
        """The settings of ``role``'s instance ``index``, its ``device`` the one it was placed
        on: ``device`` (what the launcher handed over), else the device plan's."""
        settings = self.role_settings(role)
        if not hasattr(settings, "device"):
            return settings
        if device is None and index < self.num_processes(role):
            device = self.device_plan(role)[index]
        return settings if device is None else replace(settings, device=device)
