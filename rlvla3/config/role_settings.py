"""Typed per-role settings (``roles.<name>.settings`` in the YAML), one dataclass per role.

They live here, not in the role modules, so the launcher can validate a whole YAML without
importing torch or any role code.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlvla3.config.typed_load import bounded


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvWorkerSettings:
    """Env worker: owns ``env.num_envs_per_worker`` simulators, one thread each.

    ``max_chunks_queued`` bounds how stale queued data gets when the trainer is slower than the
    envs (a compute-bound VLA on few cores): ZeroMQ's per-socket queues and the kernel's socket
    buffers alone let thousands of steps pile up, to be dropped as stale.
    """

    request_timeout_s: float = bounded(10.0, gt=0)
    """An action request unanswered this long is re-sent (to any live server)."""
    chunk_queue_hwm: int = bounded(64, ge=1)
    """Chunks one env may queue towards the trainer before its push blocks."""
    max_chunks_queued: int = bounded(0, ge=0)
    """Back-pressure (async modes): envs pause while more chunks than this wait for a trainer (0: off)."""
    resend_buffer_chunks: int = bounded(256, ge=0)
    """Chunks each env keeps after pushing them until a trainer has trained on them or dropped them, to push them again to a restarted trainer (at-least-once delivery, docs/reliability.md); beyond this the oldest are let go (``chunks_resend_overflow``). 0: none kept, a killed trainer's chunks are lost."""
    episodes_per_version: int = bounded(0, ge=0)
    """``env_worker`` only, in a run without an RL trainer (an SFT run's live evaluation): episodes the worker plays on each published weight version before it waits for the next one (the end-of-run evaluation plays until it is done), so that on a small machine live evaluation does not take the SFT trainer's cores. 0: play non-stop."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutServerSettings:
    """Rollout server: dynamic batching of action requests across all env workers.

    A batch is every request already waiting (up to ``max_batch``), plus those arriving within
    ``max_wait_ms`` (0: never wait; requests that arrive during a batch form the next one). In
    ``sync`` mode a batch waits for every env (or ``sync_max_wait_ms``).
    """

    max_batch: int = bounded(64, ge=1)
    """Most requests in one batch."""
    max_wait_ms: float = bounded(0.0, ge=0)
    """How long a batch waits for more requests (async modes)."""
    sync_max_wait_ms: float = bounded(500.0, ge=0)
    """How long a batch waits for every env (sync mode)."""
    device: str = "cpu"
    """Where the policy runs (``cpu``, ``cuda:0``...)."""
    num_threads: int = bounded(1, ge=1)
    """torch CPU threads."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerSettings:
    """Trainer: consumes trajectory chunks, runs PPO, publishes weights, checkpoints."""

    device: str = "cpu"
    """Where training runs."""
    num_threads: int = bounded(1, ge=1)
    """torch CPU threads."""
    chunk_queue_hwm: int = bounded(256, ge=1)
    """Chunks the trainer's socket queues before senders block."""
    keep_checkpoints: int = bounded(2, ge=1)
    """Newest checkpoints kept."""
    shard: bool = False
    """With ``count`` > 1: shard the policy's parameters, gradients and optimizer state over the ranks (FSDP2's ``fully_shard``), each holding 1/N, for a model whose training state does not fit one device (docs/data-parallel.md); false: every rank holds all of it. No effect with one rank."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightBroadcasterSettings:
    """Weight broadcaster: trainer → every rollout server over torch.distributed."""

    device: str = "cpu"
    """Where the broadcast copy lives (``cuda`` for NCCL links)."""
    link_timeout_s: float = bounded(60.0, gt=0)
    """A link that takes longer to form or to send one version counts as broken."""
    send_deadline_s: float = bounded(2.0, gt=0)
    """The longest a broadcast waits for one rollout server (seconds; at least the version's size at 100 MB/s, so a large model's sends are not all late): a server frozen or slow past it gets no other version until that send ends (then it is sent the current one), and the broadcaster goes on serving the others."""
    max_weights_mb: int = bounded(1024, ge=1)
    """Largest weights update taken (MiB; libzmq drops a larger frame unread): at least 4 bytes per trainable floating-point parameter that travels (all of them, or LoRA's adapters and heads); a trainer whose weights exceed it refuses to start, naming this key."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SftTrainerSettings:
    """SFT trainer: packed-sequence supervised training (the run's ``sft`` section)."""

    device: str = "cpu"
    """Where training runs."""
    num_threads: int = bounded(1, ge=1)
    """torch CPU threads."""
    keep_checkpoints: int = bounded(2, ge=1)
    """Newest checkpoints kept."""
    shard: bool = False
    """With ``count`` > 1: shard the policy's parameters, gradients and optimizer state over the ranks (FSDP2's ``fully_shard``), each holding 1/N, for a model whose training state does not fit one device (docs/data-parallel.md); false: every rank holds all of it. No effect with one rank."""


RoleSettings = (
    EnvWorkerSettings
    | RolloutServerSettings
    | TrainerSettings
    | WeightBroadcasterSettings
    | SftTrainerSettings
)
"""The settings of any role (``rlvla3.config.role_table`` says which role has which)."""
