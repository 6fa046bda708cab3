"""Refuse at setup a pretrained model that cannot fit on the role's device.

A role that would load a model too large for its device would otherwise fail minutes later, deep
inside ``from_pretrained`` or the first update, with an out-of-memory error that names neither
the model nor the setting. Before the policy is built, ``check_role_memory`` estimates the
bytes the role needs from the checkpoint's tensor shapes (``rlvla3/policy/checkpoint_shapes.py``:
safetensors headers, nothing loaded) and compares them with the device's free memory.

The estimate (docs/models.md, Memory), for ``policy.kind: token_vla``:

- one copy of the policy: the model's parameters times the size of ``policy.token_vla.dtype``,
  plus the float32 value head and, with ``policy.lora``, the float32 adapters;
- times the copies the role holds (a rollout server: two, the served and the standby copy; a
  trainer: one, two with a KL reference);
- a trainer adds a gradient and Adam's two moments for each *trainable* parameter, in its own
  dtype: every parameter without LoRA, the adapters and the value head with it; a rank of a
  sharded group (``settings.shard``) adds its share of them (1/N over N ranks), and still
  counts one whole copy of the policy (every rank builds it whole before sharding it);
- a rollout server of a bfloat16 model without LoRA adds the float32 buffer its versions arrive
  in (``transport/weights.py`` ``WeightTarget``: its copies cannot be views of float32 values).

Activations, the CUDA context and the allocator's slack come on top, so the check refuses only
what certainly cannot fit; passing it is necessary, not sufficient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlvla3.config.lora import LoraConfig
from rlvla3.config.run_config import Config
from rlvla3.config.token_vla import TokenVLAConfig
from rlvla3.config.typed_load import ConfigError
from rlvla3.policy.checkpoint_shapes import SavedModelShapes, saved_model_shapes

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_FLOAT32 = 4
_GRAD_AND_ADAM = 3  # a gradient and Adam's two moments per trainable value, in its dtype
_GIB = 2**30

FreeBytes = Callable[[torch.device], int | None]
"""Free bytes on a device, None where it cannot be read (the check is then skipped)."""


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """The bytes a role needs for its policy, and where they come from.

    Attributes:
        parameters: the model's parameters (output embedding untied), the value head's and the
            adapters'.
        dtype: the model's ``policy.token_vla.dtype``.
        copy_bytes: one copy of the policy.
        copies: copies the role holds.
        trainable: parameters that train (0 on a role that does not train).
        training_bytes: the gradients and Adam moments of the trainable parameters.
        shards: the ranks the training state is sharded over (this role holds 1/shards of
            ``training_bytes``).
        receive_bytes: a float32 buffer weight versions arrive in (0 where the copies
            themselves are float32 and receive in place).
    """

    parameters: int
    dtype: str
    copy_bytes: int
    copies: int
    trainable: int
    training_bytes: int
    receive_bytes: int = 0
    shards: int = 1

    @property
    def total_bytes(self) -> int:
        """Every copy, and this role's share of what training adds."""
        return self.copies * self.copy_bytes + self.training_share + self.receive_bytes

    @property
    def training_share(self) -> int:
        """The gradients and Adam moments this role holds: its shard's, sharded."""
        return -(-self.training_bytes // self.shards)

    def describe(self) -> str:
        """One line: the total and its parts, in GiB."""
        copies = "1 copy" if self.copies == 1 else f"{self.copies} copies"
        text = (
            f"{gib(self.total_bytes)}: {copies} of {self.parameters:,} parameters "
            f"({self.dtype} model, {gib(self.copy_bytes)} each)"
        )
        if self.trainable:
            text += (
                f" + gradients and Adam moments of {self.trainable:,} trainable parameters "
                f"({gib(self.training_bytes)}"
            )
            if self.shards > 1:
                text += f", 1/{self.shards} of it here: {gib(self.training_share)}"
            text += ")"
        if self.receive_bytes:
            text += f" + a float32 buffer versions arrive in ({gib(self.receive_bytes)})"
        return text + "; activations not counted"


def gib(n_bytes: int) -> str:
    """``n_bytes`` in GiB, three significant digits (tiny models stay readable)."""
    return f"{n_bytes / _GIB:.3g} GiB"


def estimate_token_vla_memory(
    config: TokenVLAConfig,
    lora: LoraConfig,
    *,
    copies: int,
    trains: bool,
    receives: bool = False,
    shards: int = 1,
) -> MemoryEstimate | None:
    """The estimate for a token VLA from its checkpoint (module docstring); None when the
    directory does not say (the load then reports what is wrong with it)."""
    saved = saved_model_shapes(Path(config.path).expanduser())
    if saved is None:
        return None
    model_values = saved.parameters
    head = _value_head_values(saved.hidden_size, config.value_hidden)
    adapters = _adapter_values(saved, lora)
    dtype_bytes = _DTYPE_BYTES[config.dtype]
    copy_bytes = model_values * dtype_bytes + (head + adapters) * _FLOAT32
    if not trains:
        trainable, trained_bytes = 0, 0
    elif lora.enabled:  # the base is frozen: only adapters and the value head train
        trainable, trained_bytes = head + adapters, (head + adapters) * _FLOAT32
    else:
        trainable, trained_bytes = model_values + head, copy_bytes
    # with LoRA only the float32 adapters and head travel, and they receive in place
    receive_bytes = (model_values + head) * _FLOAT32 if receives and dtype_bytes != _FLOAT32 else 0
    return MemoryEstimate(
        receive_bytes=0 if lora.enabled else receive_bytes,
        parameters=model_values + head + adapters,
        dtype=config.dtype,
        copy_bytes=copy_bytes,
        copies=copies,
        trainable=trainable,
        training_bytes=_GRAD_AND_ADAM * trained_bytes,
        shards=shards,
    )


def check_role_memory(
    cfg: Config,
    role: str,
    device: torch.device,
    *,
    copies: int,
    trains: bool,
    receives: bool = False,
    free_bytes: FreeBytes | None = None,
) -> MemoryEstimate | None:
    """Refuse a token VLA that cannot fit on ``device``, role ``role``'s device setting (a
    learner whose ``settings.shard`` is on counts its share of the training state).

    Returns the estimate (None for another policy family, or a directory that does not say).

    Raises:
        ConfigError: the estimate exceeds the device's free memory; names
            ``policy.token_vla.path`` and ``roles.<role>.settings.device``, both sizes in GiB.
    """
    if cfg.policy.kind != "token_vla":
        return None
    estimate = estimate_token_vla_memory(
        cfg.policy.token_vla,
        cfg.policy.lora,
        copies=copies,
        trains=trains,
        receives=receives,
        shards=training_shards(cfg, role) if trains else 1,
    )
    if estimate is None:
        return None
    free = (free_bytes or device_free_bytes)(device)
    if free is not None and estimate.total_bytes > free:
        raise ConfigError(
            f"policy.token_vla.path: the model in {cfg.policy.token_vla.path!r} does not fit on "
            f"{device} (roles.{role}.settings.device): the {role} needs {estimate.describe()}, "
            f"and {gib(free)} is free there. Use a smaller model, policy.token_vla.dtype: "
            "bfloat16, policy.lora, or another device"
        )
    return estimate


def training_shards(cfg: Config, role: str) -> int:
    """The ranks a learner role's training state is sharded over: its ``count`` with
    ``settings.shard``, else 1 (every rank holds all of it)."""
    sharded = getattr(cfg.role_settings(role), "shard", False)
    return cfg.num_processes(role) if sharded else 1


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device``: ``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` of
    /proc/meminfo on the CPU; None elsewhere (another device type, no /proc)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None  # moving the model there fails with torch's own clear error
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        return _mem_available(Path("/proc/meminfo"))
    return None


def _mem_available(meminfo: Path) -> int | None:
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the file counts kB
    return None


def _value_head_values(hidden: int, value_hidden: int) -> int:
    """Parameters of the value head (``TokenVLAPolicy``): an MLP, or a linear head at 0."""
    if value_hidden:
        return hidden * value_hidden + value_hidden + value_hidden + 1
    return hidden + 1


def _adapter_values(saved: SavedModelShapes, lora: LoraConfig) -> int:
    """Parameters of the LoRA adapters on the saved weights ``lora.target_modules`` names
    (matched by name ending, as ``rlvla3.policy.lora`` matches modules); with no targets,
    every matrix that is not an embedding (every Linear)."""
    if not lora.enabled:
        return 0
    total = 0
    for name, shape in saved.shapes.items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or len(shape) < 2:
            continue
        if lora.target_modules:
            chosen = any(module == t or module.endswith("." + t) for t in lora.target_modules)
        else:
            chosen = len(shape) == 2 and "embed" not in module.rpartition(".")[2]
        if chosen:  # A: rank x fan-in; B: fan-out x rank (a Conv's fan-in spans its kernel)
            fan_in = 1
            for d in shape[1:]:
                fan_in *= d
            total += lora.rank * (fan_in + shape[0])
    return total
