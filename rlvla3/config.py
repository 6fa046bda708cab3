"""The run configuration: typed dataclasses loaded from one YAML file.

Unknown or mistyped keys fail with one line naming the key path; ``--set a.b=c`` overrides are
applied to the raw YAML before validation, so they are checked exactly like file values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlvla3 import nodes as node_groups
from rlvla3.policy.vla_config import VLAConfig
from rlvla3.role_settings import ROLE_SETTINGS
from rlvla3.typed_load import ConfigError, bounded, from_dict, to_dict
from rlvla3.yaml12 import YamlError, dump_yaml, parse_yaml

Fp8Backend = Literal["transformer_engine", "torch_scaled_mm"]
Mode = Literal["sync", "async_rollout", "async"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StopConfig:
    """When the launcher ends a run. Zero or null disables a condition.

    With ``eval_episodes`` > 0, a run that meets a stop condition first freezes training and
    measures the final weights on that many fresh episodes (at most ``eval_timeout_s``); their
    success rate and mean return go to ``summary.json``.
    """

    max_env_steps: int = bounded(0, ge=0)
    max_wall_s: float = bounded(0.0, ge=0)
    target_mean_return: float | None = None
    target_success_rate: float | None = bounded(None, ge=0, le=1)
    return_window: int = bounded(20, ge=1)
    eval_episodes: int = bounded(0, ge=0)
    eval_timeout_s: float = bounded(300.0, gt=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """Run identity, mode and bookkeeping. The run id in Redis keys is ``name``.

    ``transport``: ``tcp`` binds free ports on each node's host; ``ipc`` uses unix socket paths in
    the run dir (one host only).

    Multi-node runs (see docs/multi-node.md): ``head`` is the node whose launcher starts the
    run's private Redis (default: the first node). ``redis_port`` is the port it listens on
    (0: under Slurm a port derived from the job id, so every node knows it; elsewhere a free
    port, published in the shared run dir). Other nodes wait up to ``join_timeout_s`` for it.
    A node that cannot reach the head for ``head_timeout_s`` stops its roles and its launcher
    exits non-zero; a shorter outage is ridden out and its roles rejoin.
    """

    name: str = "run"
    mode: Mode = "async"
    seed: int = bounded(0, ge=0, le=2**63 - 1)
    output_dir: str = "runs"
    redis_url: str | None = None
    transport: Literal["tcp", "ipc"] = "tcp"
    heartbeat_ttl_s: float = bounded(5.0, gt=0)
    progress_interval_s: float = bounded(5.0, gt=0)
    stop_timeout_s: float = bounded(20.0, gt=0)
    head: str | None = None
    redis_port: int = bounded(0, ge=0, le=65535)
    join_timeout_s: float = bounded(120.0, gt=0)
    head_timeout_s: float = bounded(60.0, gt=0)
    stop: StopConfig = field(default_factory=StopConfig)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """A group of ``count`` hosts (``rlvla3/nodes.py``): one node called ``name`` when
    ``count`` is 1, else nodes ``name-0``, ``name-1``...

    ``host`` is the address a node's roles bind and advertise. Unset, a run on one host uses
    loopback, and a multi-node run the address of the interface that routes to the head node.
    Only a group of one may set it. ``devices`` lists the devices each of its nodes has.
    """

    name: str
    count: int = bounded(1, ge=1, le=4096)
    host: str | None = None
    devices: list[str] = field(default_factory=lambda: ["cpu"])


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartPolicy:
    """How the launcher treats a role process that exits with an error."""

    max_restarts: int = bounded(3, ge=0)
    backoff_s: float = bounded(1.0, ge=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleConfig:
    """How many processes of a role, where, and the role's own settings.

    ``node`` is a node or group name, or a list of them; the instances are spread over their
    nodes round-robin. Null places every instance on the first node. ``cpus`` pins every instance to those CPU
    ids of its node (Linux affinity, set before the role starts its threads); null lets the
    kernel schedule it anywhere. Pinning latency-bound roles (env workers, rollout servers)
    apart keeps their threads' wake-ups on one core each.
    """

    count: int = bounded(1, ge=0, le=4096)
    node: str | list[str] | None = None
    cpus: list[int] | None = None
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerSettings:
    """Added per-step simulator latency, for measuring asynchrony (``none`` disables it)."""

    distribution: Literal["none", "lognormal", "constant"] = "none"
    mean_ms: float = bounded(20.0, ge=0)
    sigma: float = bounded(1.0, ge=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvConfig:
    """The simulator every env worker runs: any gymnasium id or a built-in ``rlvla3/...`` task."""

    id: str = "CartPole-v1"
    num_envs_per_worker: int = bounded(4, ge=1)
    chunk_len: int = bounded(32, ge=1)
    kwargs: dict[str, Any] = field(default_factory=dict)
    straggler: StragglerSettings = field(default_factory=StragglerSettings)


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    """Which policy network. ``vla`` holds the VLA model's fields (``VLAConfig`` in
    rlvla3/policy/vla_config.py; those it leaves out follow the env's spaces), checked at load.

    ``init_checkpoint``: a trainer checkpoint (e.g. from an SFT run) whose model weights a trainer
    starts from when it has no checkpoint of its own.
    ``init_launch``: the launch YAML whose run produces ``init_checkpoint`` (e.g. an SFT run).
    When ``init_checkpoint`` holds no checkpoint yet, ``rlvla3 launch`` runs it first, into that
    directory, so one command does both stages.
    """

    kind: Literal["mlp", "vla"] = "mlp"
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    vla: dict[str, Any] = field(default_factory=dict)
    init_checkpoint: str | None = None
    init_launch: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AlgoConfig:
    """PPO with off-policy correction for lagging rollouts.

    ``lr`` decays linearly to zero over ``lr_anneal_samples`` trained samples (0: constant).
    One update uses ``batch_steps`` env steps (0: one round, i.e. every env's ``chunk_len``
    steps). Samples more than ``max_staleness`` versions behind the trainer are dropped and
    counted; ``correction`` reweights the rest. The first ``value_warmup_updates`` updates
    train the critic only: after an SFT warm start the value head is untrained, and advantages
    from it would first undo the pretrained policy. ``ref_kl_coef`` > 0 adds
    ``ref_kl_coef * KL(policy || reference)`` to the loss, the reference being the weights of
    ``policy.init_checkpoint`` (frozen): it keeps RL fine-tuning near the warm start while the
    critic is still too poor for its advantages to beat noise. ``value_lr`` is the learning
    rate of the parameters only the value estimate uses (the VLA's value head, the MLP's
    critic; None: ``lr``): fine-tuning keeps ``lr`` small to stay near the warm start, and at
    that rate a freshly initialised value head barely moves.
    """

    lr: float = bounded(2.5e-4, gt=0)
    value_lr: float | None = bounded(None, gt=0)
    lr_anneal_samples: int = bounded(0, ge=0)
    gamma: float = bounded(0.99, ge=0, le=1)
    lam: float = bounded(0.95, ge=0, le=1)
    clip_coef: float = bounded(0.2, gt=0)
    vf_coef: float = bounded(0.5, ge=0)
    ent_coef: float = 0.01
    max_grad_norm: float = bounded(0.5, gt=0)
    epochs: int = bounded(4, ge=1)
    minibatch_size: int = bounded(256, ge=1)
    batch_steps: int = bounded(0, ge=0)
    max_staleness: int = bounded(2, ge=0)
    correction: Literal["none", "truncated_is", "vtrace"] = "truncated_is"
    publish_every: int = bounded(1, ge=1)
    checkpoint_every: int = bounded(50, ge=1)
    value_warmup_updates: int = bounded(0, ge=0)
    ref_kl_coef: float = bounded(0.0, ge=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class SftConfig:
    """Packed-sequence supervised pretraining on demonstrations (LeRobot layout).

    When ``dataset`` does not exist yet, ``generate_demos`` episodes of the env's scripted expert
    are written there first (``rlvla3 demos`` does the same by hand); the expert executes its
    action plus Gaussian noise of std ``expert_noise`` while the clean action is recorded as the
    label (DART; an existing dataset is reused as is, so give each noise level its own path).
    Each step trains on as many samples as fit ``token_budget`` tokens, packed without padding.
    ``stream_buffer_frames`` > 0 streams the dataset through a buffer of that many frames
    (``sft.data.DemoStream``: for datasets larger than memory); 0 loads every frame.

    ``fp8`` trains the linears in FP8 on a GPU that has it, through ``fp8_backend``:
    ``transformer_engine`` (when installed) or ``torch_scaled_mm`` (no install; measured slower
    than bf16 below d_model≈4096 on an H100, so it is opt-in).
    """

    dataset: str = "data/demos"
    generate_demos: int = bounded(0, ge=0)
    demo_seed: int = 12345
    expert_noise: float = bounded(0.0, ge=0)
    token_budget: int = bounded(2048, ge=1)
    stream_buffer_frames: int = bounded(0, ge=0)
    lr: float = bounded(3e-4, gt=0)
    weight_decay: float = bounded(0.01, ge=0)
    max_steps: int = bounded(1000, ge=1)
    publish_every: int = bounded(50, ge=1)
    checkpoint_every: int = bounded(200, ge=1)
    fp8: bool = True
    fp8_backend: Fp8Backend = "transformer_engine"


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The whole run, as one YAML file describes it."""

    run: RunConfig = field(default_factory=RunConfig)
    nodes: list[NodeConfig] = field(default_factory=lambda: [NodeConfig(name="local")])
    roles: dict[str, RoleConfig] = field(default_factory=dict)
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    sft: SftConfig = field(default_factory=SftConfig)

    def role_settings(self, role: str) -> Any:
        """The typed settings dataclass of ``role``, validated against its schema."""
        raw = self.roles[role].settings if role in self.roles else {}
        return from_dict(ROLE_SETTINGS[role], raw, f"roles.{role}.settings")

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
            raise ConfigError(f"{path}: the top level must be a mapping (run:, roles:, ...), "
                              f"got a {type(raw).__name__}")  # fmt: skip
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
    return dump_yaml(to_dict(cfg))  # read back by the roles: the same YAML 1.2 rules both ways


def _validate(cfg: Config) -> None:
    name = cfg.run.name
    bad_char = any(c in ":/\\" or c.isspace() or not c.isprintable() for c in name)
    if not name or name.startswith(".") or bad_char:
        raise ConfigError(f"run.name: {name!r} must be non-empty, not start with '.', without spaces, ':' or '/' "
                          "(it names the run dir and the run's Redis keys)")  # fmt: skip
    _validate_nodes(cfg)
    names = sorted({n.name for n in cfg.nodes} | {n.name for n in cfg.all_nodes()})
    for role, rc in cfg.roles.items():
        if role not in ROLE_SETTINGS:
            known = ", ".join(sorted(ROLE_SETTINGS))
            raise ConfigError(f"roles.{role}: unknown role (known roles: {known})")
        placed = [rc.node] if isinstance(rc.node, str) else (rc.node or [])
        for node in placed:
            if node not in names:
                raise ConfigError(f"roles.{role}.node: no node or group named {node!r} "
                                  f"(nodes: {names})")  # fmt: skip
        if rc.cpus is not None and (not rc.cpus or any(c < 0 for c in rc.cpus)):
            raise ConfigError(f"roles.{role}.cpus: a non-empty list of CPU ids >= 0, got {rc.cpus}")
        cfg.role_settings(role)
    _validate_vla(cfg.policy.vla)
    if cfg.algo.ref_kl_coef > 0 and not cfg.policy.init_checkpoint:
        raise ConfigError(
            "algo.ref_kl_coef: needs policy.init_checkpoint (the reference policy's weights)"
        )
    if cfg.policy.init_launch and not cfg.policy.init_checkpoint:
        raise ConfigError(
            "policy.init_launch: needs policy.init_checkpoint (the run dir that launch writes)"
        )


def _validate_vla(raw: dict[str, Any]) -> None:
    """``policy.vla`` at load time: keys, types, ranges (a typo is a config error, not a role
    that keeps restarting). The image size usually comes from the env's spaces when the policy
    is built, so here it only has to fit the patch size."""
    probe = dict(raw)
    patch = probe.get("patch_size", 8)
    if "image_size" not in probe and isinstance(patch, int) and patch > 0:
        probe["image_size"] = 8 * patch
    from_dict(VLAConfig, probe, "policy.vla")


def _validate_nodes(cfg: Config) -> None:
    groups = [n.name for n in cfg.nodes]
    if not groups:
        raise ConfigError("nodes: at least one node is required")
    if len(set(groups)) != len(groups):
        raise ConfigError(f"nodes: duplicate node names in {groups}")
    for i, group in enumerate(cfg.nodes):
        if group.count > 1 and group.host is not None:
            raise ConfigError(f"nodes[{i}].host: group {group.name!r} has {group.count} nodes, "
                              "so one address cannot be theirs; leave host unset (each node "
                              "finds its own) or list the nodes one by one")  # fmt: skip
        if not group.name or any(c in ":/\\" or c.isspace() for c in group.name):
            raise ConfigError(f"nodes[{i}].name: {group.name!r} must be non-empty, without "
                              "spaces, ':' or '/' (it names the node's Redis records)")  # fmt: skip
    expanded = [n.name for n in cfg.all_nodes()]
    clash = sorted({n for n in expanded if expanded.count(n) > 1} | (set(expanded) & (
        set(groups) - {g.name for g in cfg.nodes if g.count == 1})))
    if clash:
        raise ConfigError(f"nodes: the name {clash[0]!r} is used twice (a group of N nodes "
                          "names them NAME-0 .. NAME-(N-1))")  # fmt: skip
    if cfg.run.head is not None:
        try:
            node_groups.members(cfg.all_nodes(), cfg.run.head)
        except KeyError:
            raise ConfigError(f"run.head: no node or group named {cfg.run.head!r} "
                              f"(nodes: {', '.join(expanded)})") from None
