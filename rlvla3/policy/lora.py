"""LoRA on any ``ActorCritic``: low-rank adapters (peft) on chosen modules, the rest frozen.

``apply_lora`` injects peft's LoRA layers into the policy in place (``inject_adapter_in_model``:
it works on any ``nn.Module``, our own VLA's ``qkv`` as well as a ``transformers`` model's
``q_proj``), then freezes every parameter but the adapters and the policy's heads
(``ActorCritic.head_parameter_prefixes``), and records those names in
``ActorCritic.lora_trained``: the weight sync (``transport/weights.py``) and the checkpoints
(``rlvla3/runtime/checkpoints.py``) then carry only them.

Every role builds the policy through ``rlvla3.policy.factory.build_policy``, which loads the
base weights (``policy.init_checkpoint``) *before* the adapters go in (``load_init_weights``), so
the trainer and each rollout server hold the same frozen base and the same module structure.

``merge_lora`` folds the adapters into their base layers and removes them: ``rlvla3 export``
(``rlvla3/export.py``) writes the result as a plain checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rlvla3.config.lora import LoraConfig
from rlvla3.config.typed_load import ConfigError, from_dict
from rlvla3.policy.base import ActorCritic
from rlvla3.runtime.checkpoints import load_checkpoint, load_model_state

ADAPTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)
"""Module types that get adapters (peft's LoRA layers for torch's own modules)."""
_ADAPTER_NAME = "default"  # one adapter per layer, under peft's default name
_ADAPTER_MARK = "lora_"  # peft's adapter parameters: lora_A, lora_B, lora_embedding_A, ...
_MAX_INIT_DEPTH = 8  # LoRA checkpoints whose base is a LoRA checkpoint, and so on


def apply_lora(policy: ActorCritic, lora: LoraConfig) -> None:
    """Adapters on ``lora.target_modules`` of ``policy`` (in place); only they and the heads
    train from then on. Nothing happens when ``lora.rank`` is 0.

    Raises:
        ConfigError: a target names no adaptable module (the message lists candidates).
    """
    if not lora.enabled:
        return
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import inject_adapter_in_model
        from peft.tuners.tuners_utils import cast_adapter_dtype
    except ImportError:
        raise ConfigError(
            "policy.lora: needs peft, which is not installed (pip install 'rlvla3[models]')"
        ) from None

    heads = policy.head_parameter_prefixes()
    targets = adapted_module_names(policy, lora.target_modules, heads)
    peft_config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.scale_alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,  # full names: peft matches them exactly
    )
    inject_adapter_in_model(peft_config, policy, adapter_name=_ADAPTER_NAME)
    # peft gives the adapters their base layer's dtype; a bfloat16 model's would then train in
    # bfloat16 (small updates rounded away) and could not receive in place: float32, as
    # peft's own get_peft_model makes them (its layers cast their inputs to match)
    cast_adapter_dtype(policy, _ADAPTER_NAME, autocast_adapter_dtype=True)
    trained = []
    for name, param in policy.named_parameters():
        param.requires_grad_(_ADAPTER_MARK in name or _under(name, heads))
        if param.requires_grad:
            trained.append(name)
    policy.lora_trained = tuple(trained)


def adapted_module_names(
    policy: nn.Module, targets: list[str], heads: tuple[str, ...]
) -> list[str]:
    """Full names of the modules that ``targets`` choose (each target a name or the end of
    one, as peft matches them), or of every ``nn.Linear`` when ``targets`` is empty; heads
    excluded.

    Raises:
        ConfigError: a target matches no adaptable module outside the heads.
    """
    adaptable = [
        name
        for name, module in policy.named_modules()
        if name and isinstance(module, ADAPTABLE) and not _under(name, heads)
    ]
    if not targets:
        return [n for n in adaptable if isinstance(policy.get_submodule(n), nn.Linear)]
    chosen: list[str] = []
    for target in targets:
        hits = [n for n in adaptable if n == target or n.endswith("." + target)]
        if not hits:
            raise ConfigError(
                f"policy.lora.target_modules: {target!r} names no Linear, Conv or Embedding "
                f"module of the policy outside its heads {list(heads)}; candidates: "
                f"{', '.join(_candidates(adaptable))}"
            )
        chosen += [n for n in hits if n not in chosen]
    return chosen


def _candidates(names: list[str], limit: int = 12) -> list[str]:
    """Short names to suggest: each module's last name part (the last two where the last is an
    index, e.g. ``mlp.0``), distinct, in model order."""
    short: list[str] = []
    for name in names:
        parts = name.split(".")
        end = ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]
        if end not in short:
            short.append(end)
    return short[:limit] + (["..."] if len(short) > limit else [])


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def merge_lora(policy: ActorCritic) -> None:
    """Fold every adapter into its base layer and put the base layer back in its place: the
    policy then has the module structure (and state-dict keys) it had before ``apply_lora``,
    with the adapted weights, every parameter trainable again."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [(n, m) for n, m in policy.named_modules() if isinstance(m, BaseTunerLayer)]
    for name, layer in layers:
        layer.merge()
        parent_name, _, attr = name.rpartition(".")
        setattr(policy.get_submodule(parent_name), attr, layer.get_base_layer())
    policy.requires_grad_(True)
    policy.lora_trained = None


def load_init_weights(policy: ActorCritic, path: str | Path, depth: int = 0) -> None:
    """Load the checkpoint at ``path`` (a file, a checkpoints dir or a run dir) into ``policy``
    as whole weights. A checkpoint of a LoRA run (it records its ``lora`` section and base) is
    rebuilt first: its own base loaded, its adapters applied and merged.

    Raises:
        ConfigError: the checkpoint does not fit the policy (names ``policy.init_checkpoint``).
    """
    try:
        state = load_checkpoint(path, torch.device("cpu"))
    except FileNotFoundError:
        what = (
            "no checkpoint at" if depth == 0 else "a LoRA checkpoint's base is not there any more:"
        )
        raise ConfigError(f"policy.init_checkpoint: {what} {path}") from None
    record = state.get("lora")
    try:
        if record is None:
            policy.load_state_dict(state["model"])
            return
        if depth >= _MAX_INIT_DEPTH:
            raise ValueError(f"more than {_MAX_INIT_DEPTH} LoRA checkpoints stacked")
        if record.get("base"):
            load_init_weights(policy, record["base"], depth + 1)
        apply_lora(policy, from_dict(LoraConfig, record["config"], "policy.lora"))
        load_model_state(policy, state["model"])
        merge_lora(policy)
    except ConfigError:  # (a base's own, already saying what is wrong)
        raise
    except (RuntimeError, ValueError, KeyError) as err:
        raise ConfigError(
            f"policy.init_checkpoint: {path} does not load into this policy ({err})"
        ) from None
