"""The checks a whole config passes at load, across its sections: names, placement, devices,
roles against modes and algorithms, the env's groups and sync rounds, the weight path. Each
failure is one ``ConfigError`` that names the field."""

from __future__ import annotations

from rlvla3.config import devices
from rlvla3.config import nodes as node_groups
from rlvla3.config.role_table import EVAL_ROLES, ROLE_TABLE, known_roles
from rlvla3.config.typed_load import ConfigError
from rlvla3.config.whole_config import Config
from transport.bind_policy import is_wildcard


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


def validate(cfg: Config) -> None:
    """Raise ``ConfigError`` naming the field where the sections disagree with each other."""
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
