"""The sections of a run config (``run``, ``nodes``, ``roles``, ``env``, ``policy``, ``algo``,
``sft``): typed dataclasses with a docstring per field, which ``docs/config.md`` is generated
from. ``rlvla3.config.run_config.Config`` puts them together and checks them against each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rlvla3.config.lora import LoraConfig
from rlvla3.config.token_vla import TokenVLAConfig
from rlvla3.config.typed_load import bounded
from rlvla3.config.vla import VLAConfig

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
    """Stop when periodic evaluation (``run.eval``) measures at least this greedy success rate."""
    eval_window: int = bounded(1, ge=1)
    """Evaluations ``target_eval_success_rate`` averages over (the newest ones). One evaluation of 100 episodes at a true 0.85 has a standard error of about 0.035, and a run that checks dozens of them stops on its luckiest: a window of 2-3 guards against that."""


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
    protocol: bool = False
    """The eval roles play a benchmark protocol's episode list instead of periodic rounds, without training (what ``rlvla3 eval`` runs; docs/evaluation.md)."""
    sample: bool = False
    """Protocol evaluation acts by sampling the policy instead of taking its greedy action (``rlvla3 eval --sample``)."""
    videos: int = bounded(0, ge=0)
    """Protocol evaluation records the first this many episodes as GIFs in the run dir's ``videos/``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """Run identity, mode and bookkeeping. Multi-node runs: docs/multi-node.md."""

    name: str = "run"
    """Run id (Redis keys ``rlvla3:{name}:...`` and ``rlvla3-guarded:{name}:...``) and the run
    dir's name."""
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
    nccl_shared_gpu: bool = False
    """Give every role process its own ``NCCL_HOSTID``, so weight links between processes that share one GPU use NCCL (over its socket transport) instead of gloo; leave off when roles have GPUs of their own (NCCL would then take them for separate hosts and skip NVLink and shared memory)."""
    stop: StopConfig = field(default_factory=StopConfig)
    """When the run ends."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Periodic evaluation of the greedy policy on held-out episodes while training."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """A group of ``count`` hosts (``rlvla3/config/nodes.py``): one node called ``name`` when
    ``count`` is 1, else nodes ``name-0``, ``name-1``..."""

    name: str
    """The node's (or group's) name, used by ``roles.<role>.node`` and ``--node``."""
    count: int = bounded(1, ge=1, le=4096)
    """Nodes in the group; a Slurm allocation fills them in YAML order."""
    host: str | None = None
    """Address its roles bind and advertise (a group of one only); null: loopback on one host, the route to the head across hosts. Never a wildcard (``0.0.0.0``, ``::``); an address beyond loopback makes even a one-host run authenticate (CURVE)."""
    devices: list[str] | None = None
    """Devices each of its nodes has (``cpu``, ``cuda:0``...). A role whose ``settings.device`` is a type alone (``cuda``) takes them in turn: its ``i``-th instance on the node gets the ``i % n``-th of the ``n`` of that type; an explicit ``cuda:1`` must be listed; ``cpu`` stays cpu (docs/multi-node.md, Devices). null: every role's ``settings.device`` as written."""


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
    """Processes of this role (``trainer`` and ``sft_trainer``: ranks of one data-parallel training group, docs/data-parallel.md)."""
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

    kind: Literal["mlp", "vla", "token_vla"] = "mlp"
    """``mlp`` (state observations), ``vla`` (image + instruction + proprio) or ``token_vla`` (a pretrained vision-language model from a local directory, ``policy.token_vla``)."""
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    """The MLP's hidden layer widths."""
    vla: VLAConfig = field(default_factory=VLAConfig)
    """The VLA's architecture (``policy.vla`` below); the fields left null follow the env's spaces."""
    token_vla: TokenVLAConfig = field(default_factory=TokenVLAConfig)
    """The pretrained model, its action tokens and observation mapping (``policy.token_vla`` below)."""
    init_checkpoint: str | None = None
    """A run dir or checkpoint whose model weights a trainer starts from when it has none of its own. ``rlvla3 launch`` pins a run dir to its newest checkpoint file when the run starts (``--resume``: the file it started from), so that every role loads the same weights."""
    init_launch: str | None = None
    """The launch YAML that writes ``init_checkpoint``; run first when that holds no checkpoint."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (``policy.lora`` below): the trainers train only them and the heads."""

    @property
    def action_steps(self) -> int:
        """Env steps one policy call covers: ``policy.token_vla.action_steps`` for a token VLA
        (the only family with action chunks), else 1."""
        return self.token_vla.action_steps if self.kind == "token_vla" else 1


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
    bootstrap_truncated: bool = True
    """A truncated episode (its time limit, or a simulator fault that cut it) bootstraps from the value of its last observation, as an infinite-horizon task cut short for time. false: the time limit is part of the task and the return ends there (a task judged by success within its step limit, as the held-out evaluation is: with bootstrapping, the critic learns that the episode would go on, and running out of time costs nothing)."""
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
    target_kl: float | None = bounded(None, gt=0)
    """Stop an update's remaining minibatches once one's approx_kl (the k3 estimator, over the whole minibatch) exceeds this (null: run every epoch). A training group's ranks agree on it, so all stop at the same minibatch."""
    minibatch_size: int = bounded(256, ge=1)
    """Samples per gradient step."""
    batch_steps: int = bounded(0, ge=0)
    """Env steps per update (0: one round, every env's ``chunk_len`` steps). In ``sync`` mode
    0 or one round: its envs pause after each round until the next version."""
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
class SymmetryConfig:
    """Symmetry augmentation of SFT frames (``sft/symmetry.py``).

    ``dihedral`` trains on each frame under a random one of the 8 rotations (by multiples of 90
    degrees) and reflections of a square top-down scene: the image, and every ``(x, y)`` index
    pair named below in the observations and the action. Only for tasks that look and behave
    the same under them, like the built-in table-top task (square table centred at 0,
    symmetric spawns): there it makes 50 demos clone as well as about 300 do without it.
    """

    kind: Literal["none", "dihedral"] = "none"
    """``none`` or ``dihedral``."""
    image_key: str = "image"
    """Observation key of the top-down image (``[H, W, C]``, H = W, row 0 at y = +1)."""
    obs_pairs: dict[str, list[list[int]]] = field(
        default_factory=lambda: {"proprio": [[0, 1], [2, 3]]}
    )
    """Observation key -> ``[x, y]`` index pairs of its planar vectors (positions, velocities)."""
    action_pairs: list[list[int]] = field(default_factory=lambda: [[0, 1]])
    """``[x, y]`` index pairs of the action's planar vectors."""

    def __post_init__(self) -> None:
        groups = [(f"obs_pairs.{k}", pairs) for k, pairs in self.obs_pairs.items()]
        for where, pairs in [*groups, ("action_pairs", self.action_pairs)]:
            for pair in pairs:
                if len(pair) != 2 or min(pair) < 0:
                    raise ValueError(f"{where}: {pair!r} is not two indices >= 0")
            # An index in two pairs would be written twice, one of them from a stale value.
            indices = [i for pair in pairs for i in pair]
            if len(set(indices)) != len(indices):
                raise ValueError(f"{where}: {pairs!r} uses an index more than once")


@dataclass(frozen=True, slots=True, kw_only=True)
class SftConfig:
    """Packed-sequence supervised pretraining on demonstrations (LeRobot layout).

    DART demos: the expert executes its action plus noise of std ``expert_noise`` while the clean
    action is recorded (an existing dataset is reused as is, so give each noise level its own
    path). ``fp8_backend: torch_scaled_mm`` measured slower than bf16 below d_model≈4096 on an
    H200 (on par at 4096), so it is opt-in.
    """

    dataset: str = "data/demos"
    """The LeRobot dataset directory (LeRobot v2.0, v2.1 or v3.0)."""
    generate_demos: int = bounded(0, ge=0)
    """When ``dataset`` does not exist, write this many scripted-expert episodes there first
    (LeRobot v3.0)."""
    demo_seed: int = 12345
    """Seed of the first generated episode."""
    expert_noise: float = bounded(0.0, ge=0)
    """Std of the noise on the expert's executed actions (DART; 0: none)."""
    token_budget: int = bounded(2048, ge=1)
    """Tokens per packed training step (samples packed without padding)."""
    packing: bool = True
    """A token VLA's (``policy.kind: token_vla``) batches: its frames back to back in rows of ``token_budget`` tokens, position ids restarting per frame, nothing padded but a row's tail; false: right-padded to the longest frame, the padding on top of the budget (for comparison). A model family that cannot pack (multimodal rotary positions as Qwen2-VL's, ``token_type_ids`` as PaliGemma's) trains padded either way, and the SFT trainer logs why. Our VLA (``policy.kind: vla``) always packs."""
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
    symmetry: SymmetryConfig = field(default_factory=SymmetryConfig)
    """Symmetry augmentation of the frames (none by default)."""
