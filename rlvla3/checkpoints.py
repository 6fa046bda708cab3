"""Trainer checkpoints: atomic writes, newest-first lookup, safe loading (``weights_only``).

torch is imported by the functions that save and load, so the launcher can look for a
checkpoint (``find_checkpoint``) without paying for a torch import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


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
