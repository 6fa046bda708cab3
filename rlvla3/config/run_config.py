"""The run configuration: typed dataclasses loaded from one YAML file (the sections in
``rlvla3/config/sections.py``, the whole and its cross-field checks here).

Unknown or mistyped keys fail with one line naming the key path; ``--set a.b=c`` overrides are
applied to the raw YAML before validation, so they are checked exactly like file values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlvla3.config import devices
from rlvla3.config import nodes as node_groups
from rlvla3.config.role_settings import RoleSettings
from rlvla3.config.role_table import EVAL_ROLES, ROLE_TABLE, known_roles
from rlvla3.config.sections import (
    AlgoConfig,
    EnvConfig,
    NodeConfig,
    PolicyConfig,
    RoleConfig,
    RunConfig,
    SftConfig,
)
from rlvla3.config.typed_load import ConfigError, from_dict, to_dict
from rlvla3.config.vla import VLAConfig
from rlvla3.config.yaml12 import YamlError, dump_yaml, parse_yaml
from transport.bind_policy import is_wildcard

__all__ = ["AlgoConfig", "Config", "ConfigError", "config_from_dict", "load_config"]


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


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML file (or embedded defaults when ``path`` is None) and apply ``a.b=c`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = parse_yaml(Path(path).read_text()) or {}
        except YamlError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        except (OSError, UnicodeDecodeError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else err
            raise ConfigError(f"{path}: cannot read the launch YAML ({reason})") from None
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping (run:, roles:, ...), "
                f"got a {type(raw).__name__}"
            )
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Validate plain data into a Config, checking cross-references too."""
    cfg = from_dict(Config, raw)
    _validate(cfg)
    return cfg


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``dotted.key=value`` override in place; the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. run.mode=sync")
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a mapping, cannot set {key}")
        node = child
    try:
        node[parts[-1]] = parse_yaml(text) if text else ""
    except YamlError as err:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML: {err}") from None


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML, as saved beside the run's logs."""
    return dump_yaml(_plain(cfg))  # read back by the roles: the same YAML 1.2 rules both ways


def dump_config_with_defaults(cfg: Config) -> str:
    """``dump_config`` plus every default the roles will apply: each role's ``settings`` in
    full and, for a VLA policy, every ``policy.vla`` field but those the env's spaces will
    decide (left null). What ``rlvla3 config`` prints; loads back to the same run."""
    raw = _plain(cfg)
    for role in cfg.roles:
        raw["roles"][role]["settings"] = to_dict(cfg.role_settings(role))
    if cfg.policy.kind == "vla":
        vla = to_dict(cfg.policy.vla)
        raw["policy"]["vla"] = {k: v for k, v in vla.items() if v is not None}
    return dump_yaml(raw)


def _plain(cfg: Config) -> dict[str, Any]:
    """``cfg`` as plain data, ``policy.vla`` with only the fields that differ from their defaults
    (an MLP run's config does not list the VLA's architecture)."""
    raw = to_dict(cfg)
    defaults = to_dict(VLAConfig())
    raw["policy"]["vla"] = {k: v for k, v in raw["policy"]["vla"].items() if v != defaults[k]}
    if cfg.policy.kind != "token_vla":
        del raw["policy"]["token_vla"]  # only a token-VLA run's config lists its section
    return raw


def _validate_token_vla(cfg: Config) -> None:
    tv = cfg.policy.token_vla
    if not tv.path:
        raise ConfigError(
            "policy.token_vla.path: policy.kind: token_vla needs the model's directory"
        )


def _validate_action_steps(cfg: Config) -> None:
    steps = cfg.policy.token_vla.action_steps
    if steps > 1 and cfg.policy.kind != "token_vla":
        raise ConfigError(
            f"policy.token_vla.action_steps: {steps} steps per call need policy.kind: token_vla "
            f"(policy.kind {cfg.policy.kind} acts one step per call)"
        )
    if steps > 1 and cfg.env.vectorized:
        raise ConfigError(
            f"policy.token_vla.action_steps: {steps} steps per call are executed by the per-env "
            "runner; env.vectorized steps every env of its group together, one step per call"
        )


def _validate(cfg: Config) -> None:
    name = cfg.run.name
    bad_char = any(c in ":/\\" or c.isspace() or not c.isprintable() for c in name)
    if not name or name.startswith(".") or bad_char:
        raise ConfigError(
            f"run.name: {name!r} must be non-empty, not start with '.', without spaces, ':' or '/' "
            "(it names the run dir and the run's Redis keys)"
        )
    _validate_nodes(cfg)
    names = sorted({n.name for n in cfg.nodes} | {n.name for n in cfg.all_nodes()})
    for role, rc in cfg.roles.items():
        if role not in ROLE_TABLE:
            raise ConfigError(f"roles.{role}: unknown role (known roles: {known_roles()})")
        placed = [rc.node] if isinstance(rc.node, str) else (rc.node or [])
        for node in placed:
            if node not in names:
                raise ConfigError(
                    f"roles.{role}.node: no node or group named {node!r} (nodes: {names})"
                )
        if rc.cpus is not None and (not rc.cpus or any(c < 0 for c in rc.cpus)):
            raise ConfigError(f"roles.{role}.cpus: a non-empty list of CPU ids >= 0, got {rc.cpus}")
        cfg.role_settings(role)
    _validate_devices(cfg)
    if cfg.algo.ref_kl_coef > 0 and not cfg.policy.init_checkpoint:
        raise ConfigError(
            "algo.ref_kl_coef: needs policy.init_checkpoint (the reference policy's weights)"
        )
    if cfg.algo.kind == "grpo":
        _validate_grpo(cfg)
    _validate_eval(cfg)
    _validate_env_groups(cfg)
    _validate_sync_round(cfg)
    _validate_weight_path(cfg)
    if cfg.policy.kind == "token_vla":
        _validate_token_vla(cfg)
    _validate_action_steps(cfg)
    if cfg.policy.init_launch and not cfg.policy.init_checkpoint:
        raise ConfigError(
            "policy.init_launch: needs policy.init_checkpoint (the run dir that launch writes)"
        )


def _validate_devices(cfg: Config) -> None:
    """Every role's devices can be served by its nodes; a training group's ranks on one node
    have a GPU each unless ``run.nccl_shared_gpu``."""
    devices.check_node_devices(cfg.nodes)
    for role in cfg.roles:
        requested = getattr(cfg.role_settings(role), "device", None)
        if requested is None:
            continue
        placement = cfg.placement(role)
        plan = devices.device_plan(cfg.nodes, role, requested, placement)
        group = role in devices.TRAINING_GROUP_ROLES and cfg.num_processes(role) > 1
        if group and not cfg.run.nccl_shared_gpu:
            devices.check_group_devices(cfg.nodes, role, requested, placement, plan)


def _validate_weight_path(cfg: Config) -> None:
    trainers = cfg.num_processes("trainer") + cfg.num_processes("sft_trainer")
    if (
        trainers
        and cfg.num_processes("rollout_server")
        and not cfg.num_processes("weight_broadcaster")
    ):
        raise ConfigError(
            "roles.weight_broadcaster: a trainer's weights reach the rollout servers through "
            "a weight broadcaster (a run without trainers serves policy.init_checkpoint)"
        )


def _validate_env_groups(cfg: Config) -> None:
    env = cfg.env
    if env.num_envs_per_worker % env.envs_per_request:
        raise ConfigError(
            f"env.envs_per_request: {env.envs_per_request} does not divide "
            f"env.num_envs_per_worker ({env.num_envs_per_worker})"
        )
    if env.vectorized and (env.id.startswith(("rlvla3/", "maniskill/", "libero/"))):
        raise ConfigError(
            f"env.vectorized: {env.id} is not a gymnasium env; vector envs are made with "
            "gymnasium.make_vec"
        )
    if env.vectorized and cfg.algo.kind == "grpo":
        raise ConfigError(
            "env.vectorized: a vector env resets its envs itself, so GRPO cannot start a "
            "group's envs from one seed (algo.kind: grpo)"
        )
    if env.vectorized and env.straggler.distribution != "none":
        raise ConfigError("env.vectorized: the straggler wrapper steps single envs only")


def _validate_sync_round(cfg: Config) -> None:
    """In ``sync`` mode the envs pause after each round until the next version: a trainer
    that waited for more than a round, or updated in the middle of one (whose chunks then mix
    two versions and are dropped while the envs wait for a third), would never see another."""
    steps, round_steps = cfg.algo.batch_steps, cfg.round_steps()
    trains = cfg.num_processes("trainer") and cfg.num_processes("env_worker")
    if cfg.run.mode != "sync" or not trains or steps in (0, round_steps):
        return
    env = cfg.env
    raise ConfigError(
        f"algo.batch_steps: {steps} in run.mode sync, which updates once per round of "
        f"{round_steps} env steps ({cfg.num_processes('env_worker')} env workers x "
        f"env.num_envs_per_worker {env.num_envs_per_worker} x env.chunk_len {env.chunk_len}); "
        f"set 0 (one round) or {round_steps}"
    )


def _validate_eval(cfg: Config) -> None:
    counts = {role: cfg.num_processes(role) for role in EVAL_ROLES}
    if cfg.run.eval.protocol:
        _validate_protocol_eval(cfg, counts)
        return
    if cfg.run.eval.every_versions == 0:
        for role, count in counts.items():
            if count:
                raise ConfigError(
                    f"roles.{role}: periodic evaluation is off (run.eval.every_versions: 0)"
                )
        if cfg.run.stop.target_eval_success_rate is not None:
            raise ConfigError(
                "run.stop.target_eval_success_rate: needs periodic evaluation "
                "(run.eval.every_versions > 0)"
            )
        return
    for role, count in counts.items():
        if count != 1:
            raise ConfigError(
                f"roles.{role}.count: run.eval.every_versions > 0 needs exactly one {role} "
                f"(has {count})"
            )
    if cfg.num_processes("trainer") == 0:
        raise ConfigError("run.eval.every_versions: periodic evaluation needs a trainer")


def _validate_protocol_eval(cfg: Config, counts: dict[str, int]) -> None:
    """A protocol evaluation (``rlvla3 eval``) runs the eval roles alone, on fixed weights."""
    if cfg.run.eval.every_versions:
        raise ConfigError("run.eval.protocol: takes no periodic evaluation (every_versions: 0)")
    for role, count in counts.items():
        if count < 1:
            raise ConfigError(f"roles.{role}.count: run.eval.protocol needs at least one {role}")
    others = [r for r in cfg.roles if r not in counts and cfg.num_processes(r)]
    if others:
        raise ConfigError(f"run.eval.protocol: runs only the eval roles, not {others}")


def _validate_grpo(cfg: Config) -> None:
    a = cfg.algo
    if cfg.env.num_envs_per_worker % a.group_size:
        raise ConfigError(
            f"algo.group_size: {a.group_size} does not divide env.num_envs_per_worker "
            f"({cfg.env.num_envs_per_worker}); a group's envs run in one env worker"
        )
    if cfg.run.mode != "async":
        raise ConfigError(
            f"algo.kind: grpo runs in run.mode async (got {cfg.run.mode!r}): a group trains "
            "when its last episode ends, not per round"
        )
    if a.correction == "vtrace":
        raise ConfigError("algo.correction: vtrace needs a critic; grpo has none (truncated_is)")


def _validate_nodes(cfg: Config) -> None:
    groups = [n.name for n in cfg.nodes]
    if not groups:
        raise ConfigError("nodes: at least one node is required")
    if len(set(groups)) != len(groups):
        raise ConfigError(f"nodes: duplicate node names in {groups}")
    for i, group in enumerate(cfg.nodes):
        if group.host is not None and is_wildcard(group.host):
            raise ConfigError(
                f"nodes[{i}].host: {group.host!r} is a wildcard address (every interface, "
                "unauthenticated ones included); give the node's own address"
            )
        if group.count > 1 and group.host is not None:
            raise ConfigError(
                f"nodes[{i}].host: group {group.name!r} has {group.count} nodes, "
                "so one address cannot be theirs; leave host unset (each node "
                "finds its own) or list the nodes one by one"
            )
        if not group.name or any(c in ":/\\" or c.isspace() for c in group.name):
            raise ConfigError(
                f"nodes[{i}].name: {group.name!r} must be non-empty, without "
                "spaces, ':' or '/' (it names the node's Redis records)"
            )
    expanded = [n.name for n in cfg.all_nodes()]
    clash = sorted(
        {n for n in expanded if expanded.count(n) > 1}
        | (set(expanded) & (set(groups) - {g.name for g in cfg.nodes if g.count == 1}))
    )
    if clash:
        raise ConfigError(
            f"nodes: the name {clash[0]!r} is used twice (a group of N nodes "
            "names them NAME-0 .. NAME-(N-1))"
        )
    if cfg.run.head is not None:
        try:
            node_groups.members(cfg.all_nodes(), cfg.run.head)
        except KeyError:
            raise ConfigError(
                f"run.head: no node or group named {cfg.run.head!r} (nodes: {', '.join(expanded)})"
            ) from None
