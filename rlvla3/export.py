"""``rlvla3 export``: a run's checkpoint as one plain checkpoint, LoRA adapters merged.

A LoRA run's checkpoints hold its adapters and heads and name their base
(``rlvla3/policy/lora.py``). Export builds the run's policy without adapters
(``rlvla3.policy.factory.base_policy``: the same base every role of the run built), loads the
checkpoint into it (its adapters applied, then merged into the base weights), and writes the
whole state dict as ``{"model", "version", "updates"}``: a file that loads as
``policy.init_checkpoint`` of a run without ``policy.lora``, or into ``build_policy`` of the
same config with ``policy.lora.rank: 0``, and acts as the LoRA policy did. A checkpoint of a run
without LoRA is written out unchanged in content.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from rlvla3.config.lora import LoraConfig
from rlvla3.config.run_config import Config, load_config
from rlvla3.config.typed_load import ConfigError
from rlvla3.launch.run_dir import config_path
from rlvla3.runtime.checkpoints import find_checkpoint


def export_checkpoint(
    source: str | Path, out: str | Path, config: str | Path | None = None
) -> Path:
    """Write ``source``'s (a run dir, its checkpoints dir or a checkpoint file) model, merged,
    to ``out``; ``config`` is the run's resolved config (default: the run dir's). Returns
    ``out``.

    Raises:
        ConfigError: no checkpoint or no config found, or the checkpoint does not fit.
    """
    import torch

    from rlvla3.policy.factory import base_policy
    from rlvla3.policy.lora import load_init_weights
    from rlvla3.runtime.checkpoints import load_checkpoint

    checkpoint = find_checkpoint(source)
    if checkpoint is None:
        raise ConfigError(f"export: no checkpoint at {source}")
    cfg = _run_config(checkpoint, config)
    policy = base_policy(cfg)
    load_init_weights(policy, checkpoint)
    meta = load_checkpoint(checkpoint, torch.device("cpu"))
    state = {
        "model": policy.state_dict(),
        "version": int(meta.get("version", 0)),
        "updates": int(meta.get("updates", 0)),
        "exported_from": str(checkpoint.resolve()),
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out)  # a reader never sees half a file under the final name
    return out


def _run_config(checkpoint: Path, config: str | Path | None) -> Config:
    """The run's config with ``policy.lora`` and ``policy.init_checkpoint`` off: the policy
    is built bare, and the checkpoint names its base and adapters itself."""
    if config is None:
        candidates = [config_path(d) for d in (checkpoint.parent.parent, checkpoint.parent)]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise ConfigError(
                f"export: no config.yaml beside {checkpoint} (a run dir's); give it with --config"
            )
        config = found[0]
    cfg = load_config(config)
    policy = dataclasses.replace(cfg.policy, lora=LoraConfig(), init_checkpoint=None)
    return dataclasses.replace(cfg, policy=policy)
