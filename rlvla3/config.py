"""The run configuration: typed dataclasses loaded from one YAML file.

Unknown or mistyped keys fail with one line naming the key path; ``--set a.b=c`` overrides are
applied to the raw YAML before validation, so they are checked exactly like file values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlvla3 import nodes as node_groups
from rlvla3.policy.vla_config import FIELDS_FROM_ENV_SPACES, VLAConfig
from rlvla3.role_settings import ROLE_SETTINGS
from rlvla3.typed_load import ConfigError, bounded, from_dict, to_dict
from rlvla3.yaml12 import YamlError, dump_yaml, parse_yaml

Fp8Backend = Literal["transformer_engine", "torch_scaled_mm"]
Mode = Literal["sync", "async_rollout", "async"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StopConfig:
    """When the launcher ends a run. Zero or null disables a condition.

    With ``eval_episodes`` > 0, a run that meets a stop condition first freezes training and
    measures the final weights on that many fresh episodes; their success rate and mean return
    go to ``summary.json``.
    """

    max_env_steps: int = bounded(0, ge=0)
    """Stop after this many env steps (0: no limit)."""
    max_wall_s: float = bounded(0.0, ge=0)
    """Stop after this many seconds of wall time (0: no limit)."""
    target_mean_return: float | None = None
    """Stop when the mean return of the last ``return_window`` episodes reaches this."""
    target_success_rate: float | None = bounded(None, ge=0, le=1)
    """Stop when the success rate of the last ``return_window`` episodes reaches this."""
    return_window: int = bounded(20, ge=1)
    """Episodes the targets average over."""
    eval_episodes: int = bounded(0, ge=0)
    """Fresh episodes of the final weights to measure once a stop condition is met (0: none)."""
    eval_timeout_s: float = bounded(300.0, gt=0)
    """The longest that evaluation may take."""
    target_eval_success_rate: float | None = bounded(None, ge=0, le=1)
    """Stop when a periodic evaluation (``run.eval``) measures at least this greedy success rate."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalConfig:
    """Periodic evaluation while training (what RLinf calls ``val_check_interval``).

    With ``every_versions`` > 0, the roles ``eval_rollout_server`` (greedy actions) and
    ``eval_env_worker`` measure the policy on the same held-out episodes every
    ``every_versions`` weight versions, beside training and without pausing it. Each result
    goes to ``metrics.jsonl`` (``"kind": "eval"``), TensorBoard (``eval/``), the monitor and
    ``learning_curve.png``.
    """

    every_versions: int = bounded(0, ge=0)
    """Evaluate the newest weights once this many versions have passed since the last evaluated one (0: no periodic evaluation)."""
    episodes: int = bounded(50, ge=1)
    """Episodes per evaluation: seeds ``seed`` to ``seed + episodes - 1``, the same every time."""
    seed: int = bounded(1_000_000_000, ge=0, le=2**63 - 1)
    """First reset seed of the held-out episodes (training envs draw theirs from ``run.seed``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """Run identity, mode and bookkeeping. Multi-node runs: docs/multi-node.md."""

    name: str = "run"
    """Run id (Redis keys ``rlvla3:{name}:...``) and the run dir's name."""
    mode: Mode = "async"
    """``sync``, ``async_rollout`` or ``async``: how much asynchrony (README, modes)."""
    seed: int = bounded(0, ge=0, le=2**63 - 1)
    """Base seed of envs, policies and sampling."""
    output_dir: str = "runs"
    """The run dir is ``output_dir/name`` unless ``--out`` gives one."""
    redis_url: str | None = None
    """A Redis every role reaches, e.g. ``redis://host:6379/0``; null: the launcher starts one."""
    transport: Literal["tcp", "ipc"] = "tcp"
    """``tcp``: free ports on each node's address; ``ipc``: unix sockets in the run dir (one host)."""
    heartbeat_ttl_s: float = bounded(5.0, gt=0)
    """A role (or node launcher) whose heartbeat is older than this shows as LOST."""
    stall_timeout_s: float = bounded(60.0, gt=0)
    """A running role whose work loop has not finished a step for this long (or one of whose env threads has been inside its simulator this long) is STALLED: its launcher logs every thread's stack to the role's log, kills it and restarts it."""
    busy_timeout_s: float = bounded(600.0, gt=0)
    """The longest a role may say it is legitimately busy (a PPO update, an SFT step) before it counts as stalled."""
    progress_interval_s: float = bounded(5.0, gt=0)
    """Seconds between the launcher's progress lines."""
    stop_timeout_s: float = bounded(20.0, gt=0)
    """How long each stop stage waits for its roles before killing them."""
    head: str | None = None
    """The node (or group) whose launcher starts the run's Redis and ends the run (null: the first)."""
    redis_appendfsync: Literal["always", "everysec", "no"] = "always"
    """The run's own Redis keeps an append-only file in ``RUN_DIR/redis`` and is restarted from it if it dies; this is its fsync policy (``always``: nothing acknowledged is lost even to a machine crash; see docs/reliability.md for the cost)."""
    redis_port: int = bounded(0, ge=0, le=65535)
    """The head's Redis port in a multi-node run (0: from the Slurm job id, else a free port)."""
    join_timeout_s: float = bounded(120.0, gt=0)
    """How long another node waits for the head to start the run."""
    head_timeout_s: float = bounded(60.0, gt=0)
    """A node, and its roles, ride out losing the head (or Redis) this long, then stop (exit 1)."""
    stop: StopConfig = field(default_factory=StopConfig)
    """When the run ends."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Periodic evaluation of the greedy policy on held-out episodes while training."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """A group of ``count`` hosts (``rlvla3/nodes.py``): one node called ``name`` when
    ``count`` is 1, else nodes ``name-0``, ``name-1``..."""

    name: str
    """The node's (or group's) name, used by ``roles.<role>.node`` and ``--node``."""
    count: int = bounded(1, ge=1, le=4096)
    """Nodes in the group; a Slurm allocation fills them in YAML order."""
    host: str | None = None
    """Address its roles bind and advertise (a group of one only); null: loopback on one host, the route to the head across hosts."""
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    """Devices each of its nodes has (``cpu``, ``cuda:0``...)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartPolicy:
    """How the launcher treats a role process that exits with an error."""

    max_restarts: int = bounded(3, ge=0)
    """Restarts before the role fails the run."""
    backoff_s: float = bounded(1.0, ge=0)
    """Delay before the first restart; it doubles with each further one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleConfig:
    """How many processes of a role, where, and the role's own settings.

    Pinning latency-bound roles (env workers, rollout servers) apart with ``cpus`` keeps their
    threads' wake-ups on one core each.
    """

    count: int = bounded(1, ge=0, le=4096)
    """Processes of this role."""
    node: str | list[str] | None = None
    """A node or group name, or a list of them, the instances spread over round-robin (null: the first node)."""
    cpus: list[int] | None = None
    """Pin every instance to these CPU ids of its node (Linux affinity); null: anywhere."""
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    """What happens when an instance exits with an error."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The role's own settings (``roles.<role>.settings`` below)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerSettings:
    """Added per-step simulator latency, for measuring asynchrony."""

    distribution: Literal["none", "lognormal", "constant"] = "none"
    """``none`` (off), ``lognormal`` (heavy-tailed) or ``constant``."""
    mean_ms: float = bounded(20.0, ge=0)
    """Mean added latency per step."""
    sigma: float = bounded(1.0, ge=0)
    """Log-space standard deviation (lognormal only)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvConfig:
    """The simulator every env worker runs."""

    id: str = "CartPole-v1"
    """A gymnasium id, ``rlvla3/TableTop-v0``, ``maniskill/<Task>`` or ``libero/<suite>/<task>``."""
    num_envs_per_worker: int = bounded(4, ge=1)
    """Simulators per env worker."""
    envs_per_request: int = bounded(1, ge=1)
    """Env group size: a worker steps its envs in groups of this many, one thread, one action request and one reply per group and step; groups never wait for each other (1: every env on its own; must divide ``num_envs_per_worker``). Not GRPO's ``algo.group_size``."""
    vectorized: bool = False
    """Run each env group as one gymnasium vector env (``gymnasium.make_vec``, natively vectorized where the env has it, e.g. CartPole) instead of one env object per env (gymnasium ids only)."""
    chunk_len: int = bounded(32, ge=1)
    """Steps per trajectory chunk sent to the trainer (shorter at an episode's end)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Options of the env (e.g. ``image_size`` of the table-top task; ``gymnasium.make`` kwargs)."""
    straggler: StragglerSettings = field(default_factory=StragglerSettings)
    """Extra step latency for asynchrony experiments."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    """Which policy network, and where its weights start."""

    kind: Literal["mlp", "vla"] = "mlp"
    """``mlp`` (state observations) or ``vla`` (image + instruction + proprio)."""
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    """The MLP's hidden layer widths."""
    vla: dict[str, Any] = field(default_factory=dict)
    """Fields of ``VLAConfig`` (``policy.vla`` below); those left out follow the env's spaces."""
    init_checkpoint: str | None = None
    """A run dir or checkpoint whose model weights a trainer starts from when it has none of its own."""
    init_launch: str | None = None
    """The launch YAML that writes ``init_checkpoint``; run first when that holds no checkpoint."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AlgoConfig:
    """PPO with off-policy correction for lagging rollouts, or GRPO (``kind: grpo``).

    After an SFT warm start the value head is untrained: ``value_warmup_updates`` train the critic
    alone first, ``value_lr`` lets it learn faster than a small ``lr``, and ``ref_kl_coef`` keeps
    the policy near its warm start while the critic's advantages are still noise.
    """

    kind: Literal["ppo", "grpo"] = "ppo"
    """``ppo``: advantages from GAE on a learned critic. ``grpo``: each episode's return relative to its group's (``group_size`` episodes from the same start state), no critic (rlvla3/algo/grpo.py)."""
    group_size: int = bounded(4, ge=2)
    """GRPO: episodes per group, started from the same seed by a pool of this many envs of an env worker (``env.num_envs_per_worker`` must be a multiple)."""
    lr: float = bounded(2.5e-4, gt=0)
    """Adam learning rate."""
    value_lr: float | None = bounded(None, gt=0)
    """Learning rate of the value-only parameters (null: ``lr``)."""
    lr_anneal_samples: int = bounded(0, ge=0)
    """Decay ``lr`` linearly to 0 over this many trained samples (0: constant)."""
    gamma: float = bounded(0.99, ge=0, le=1)
    """Discount factor."""
    lam: float = bounded(0.95, ge=0, le=1)
    """GAE lambda."""
    clip_coef: float = bounded(0.2, gt=0)
    """PPO ratio clipping."""
    vf_coef: float = bounded(0.5, ge=0)
    """Weight of the value loss."""
    ent_coef: float = 0.01
    """Weight of the entropy bonus."""
    max_grad_norm: float = bounded(0.5, gt=0)
    """Gradient norm clipping."""
    epochs: int = bounded(4, ge=1)
    """Passes over each batch."""
    minibatch_size: int = bounded(256, ge=1)
    """Samples per gradient step."""
    batch_steps: int = bounded(0, ge=0)
    """Env steps per update (0: one round, every env's ``chunk_len`` steps)."""
    max_staleness: int = bounded(2, ge=0)
    """Samples more than this many versions behind the trainer are dropped and counted."""
    correction: Literal["none", "truncated_is", "vtrace"] = "truncated_is"
    """How lagging samples are reweighted."""
    publish_every: int = bounded(1, ge=1)
    """Publish weights after this many updates."""
    checkpoint_every: int = bounded(50, ge=1)
    """Checkpoint after this many updates (and at exit)."""
    value_warmup_updates: int = bounded(0, ge=0)
    """First updates that train the critic only (after a warm start)."""
    init_log_std: float | None = bounded(None, ge=-10, le=2)
    """A Gaussian policy starts RL with this log-std instead of its warm start's (behaviour cloning fits the std to the demos' spread, too wide to exploit; null: as loaded)."""
    ref_kl_coef: float = bounded(0.0, ge=0)
    """Weight of KL(policy || the ``init_checkpoint`` policy) in the loss (0: off)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SftConfig:
    """Packed-sequence supervised pretraining on demonstrations (LeRobot layout).

    DART demos: the expert executes its action plus noise of std ``expert_noise`` while the clean
    action is recorded (an existing dataset is reused as is, so give each noise level its own
    path). ``fp8_backend: torch_scaled_mm`` measured slower than bf16 below d_model≈4096 on an
    H100, so it is opt-in.
    """

    dataset: str = "data/demos"
    """The LeRobot dataset directory."""
    generate_demos: int = bounded(0, ge=0)
    """When ``dataset`` does not exist, write this many scripted-expert episodes there first."""
    demo_seed: int = 12345
    """Seed of the first generated episode."""
    expert_noise: float = bounded(0.0, ge=0)
    """Std of the noise on the expert's executed actions (DART; 0: none)."""
    token_budget: int = bounded(2048, ge=1)
    """Tokens per packed training step (samples packed without padding)."""
    stream_buffer_frames: int = bounded(0, ge=0)
    """0: load every frame; N: stream the dataset through a shuffled buffer of N frames."""
    lr: float = bounded(3e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = bounded(0.01, ge=0)
    """AdamW weight decay."""
    max_steps: int = bounded(1000, ge=1)
    """Training steps."""
    publish_every: int = bounded(50, ge=1)
    """Publish weights after this many steps."""
    checkpoint_every: int = bounded(200, ge=1)
    """Checkpoint after this many steps (and at the end)."""
    fp8: bool = True
    """FP8 linears on a GPU that has FP8 tensor cores."""
    fp8_backend: Fp8Backend = "transformer_engine"
    """``transformer_engine`` (when installed) or ``torch_scaled_mm`` (no install)."""


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
    return dump_yaml(to_dict(cfg))  # read back by the roles: the same YAML 1.2 rules both ways


def dump_config_with_defaults(cfg: Config) -> str:
    """``dump_config`` plus every default the roles will apply: each role's ``settings`` in
    full and, for a VLA policy, every ``policy.vla`` field but those the env's spaces decide
    (``FIELDS_FROM_ENV_SPACES``). What ``rlvla3 config`` prints; loads back to the same run."""
    raw = to_dict(cfg)
    for role in cfg.roles:
        raw["roles"][role]["settings"] = to_dict(cfg.role_settings(role))
    if cfg.policy.kind == "vla":
        defaults = {
            k: v for k, v in to_dict(VLAConfig()).items() if k not in FIELDS_FROM_ENV_SPACES
        }
        raw["policy"]["vla"] = {**defaults, **cfg.policy.vla}
    return dump_yaml(raw)


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
        if role not in ROLE_SETTINGS:
            known = ", ".join(sorted(ROLE_SETTINGS))
            raise ConfigError(f"roles.{role}: unknown role (known roles: {known})")
        placed = [rc.node] if isinstance(rc.node, str) else (rc.node or [])
        for node in placed:
            if node not in names:
                raise ConfigError(
                    f"roles.{role}.node: no node or group named {node!r} (nodes: {names})"
                )
        if rc.cpus is not None and (not rc.cpus or any(c < 0 for c in rc.cpus)):
            raise ConfigError(f"roles.{role}.cpus: a non-empty list of CPU ids >= 0, got {rc.cpus}")
        cfg.role_settings(role)
    _validate_vla(cfg.policy.vla)
    if cfg.algo.ref_kl_coef > 0 and not cfg.policy.init_checkpoint:
        raise ConfigError(
            "algo.ref_kl_coef: needs policy.init_checkpoint (the reference policy's weights)"
        )
    if cfg.algo.kind == "grpo":
        _validate_grpo(cfg)
    _validate_eval(cfg)
    _validate_env_groups(cfg)
    _validate_weight_path(cfg)
    if cfg.policy.init_launch and not cfg.policy.init_checkpoint:
        raise ConfigError(
            "policy.init_launch: needs policy.init_checkpoint (the run dir that launch writes)"
        )


def _validate_weight_path(cfg: Config) -> None:
    def count(role: str) -> int:
        return cfg.roles[role].count if role in cfg.roles else 0

    trainers = count("trainer") + count("sft_trainer")
    if trainers and count("rollout_server") and not count("weight_broadcaster"):
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


EVAL_ROLES = ("eval_env_worker", "eval_rollout_server")
"""The roles of periodic evaluation (``run.eval``): one of each."""


def _validate_eval(cfg: Config) -> None:
    counts = {role: cfg.roles[role].count if role in cfg.roles else 0 for role in EVAL_ROLES}
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
    if "trainer" not in cfg.roles or cfg.roles["trainer"].count == 0:
        raise ConfigError("run.eval.every_versions: periodic evaluation needs a trainer")


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
