"""Trainer checkpoints: atomic writes, newest-first lookup, safe loading (``weights_only``).

Both trainers save and resume through ``save_training`` / ``resume_training``: model, optimizer,
version, update count and whatever else the trainer keeps. torch is imported by the functions
that save and load, so the launcher can look for a checkpoint (``find_checkpoint``) without
paying for a torch import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_TRAINING_KEYS = ("model", "optimizer", "version", "updates")


@dataclass(frozen=True, slots=True)
class Resumed:
    """What ``resume_training`` restored besides the model and optimizer.

    Attributes:
        path: the checkpoint file.
        version: the weight version it was saved at.
        updates: the trainer's update (or step) count then.
        extra: the trainer's own further entries.
    """

    path: Path
    version: int
    updates: int
    extra: dict[str, Any] = field(default_factory=dict)


def save_training(
    directory: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    version: int,
    updates: int,
    keep: int,
    **extra: Any,
) -> Path:
    """Checkpoint a trainer: ``model``, ``optimizer``, ``version``, ``updates`` and ``extra``."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "version": version,
        "updates": updates,
        **extra,
    }
    return save_checkpoint(directory, version, state, keep)


def resume_training(
    directory: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    log: logging.Logger,
) -> Resumed | None:
    """Load the newest checkpoint in ``directory`` into ``model`` and ``optimizer``; None when
    there is none. An optimizer state of other parameter groups (a changed config) is left out,
    with a warning: Adam starts afresh, the model does not."""
    path = latest_checkpoint(directory)
    if path is None:
        return None
    state = load_checkpoint(path, device)
    model.load_state_dict(state["model"])
    try:
        optimizer.load_state_dict(state["optimizer"])
    except ValueError as err:
        log.warning("%s: optimizer state not restored (%s); Adam starts afresh", path, err)
    extra = {k: v for k, v in state.items() if k not in _TRAINING_KEYS}
    return Resumed(path, int(state["version"]), int(state["updates"]), extra)


def save_checkpoint(directory: Path, version: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` as ``ckpt_<version>.pt`` atomically and keep only the newest ``keep``."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt_{version:08d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.rename(path)  # atomic: a crash never leaves a half-written checkpoint behind
    for old in sorted(directory.glob("ckpt_*.pt"))[:-keep]:
        old.unlink()
    return path


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest checkpoint in ``directory``, or None."""
    found = sorted(directory.glob("ckpt_*.pt")) if directory.is_dir() else []
    return found[-1] if found else None


def find_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint ``path`` names: a checkpoint file itself, or the newest one in a
    checkpoints directory or a run dir (its ``checkpoints/``); None when there is none."""
    path = Path(path)
    if path.is_dir():
        return latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
    return path if path.is_file() else None


def load_checkpoint(path: str | Path, device: torch.device) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` (tensors and plain data only).

    ``path`` may be a checkpoint file, a checkpoints directory or a run dir (newest one inside).
    """
    import torch

    path = Path(path)
    if path.is_dir():
        found = find_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no ckpt_*.pt in {path} or {path / 'checkpoints'}")
        path = found
    return torch.load(path, map_location=device, weights_only=True)
