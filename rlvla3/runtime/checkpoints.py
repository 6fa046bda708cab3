"""Trainer checkpoints: durable writes, verified newest-first resume, safe loading.

Both trainers save and resume through ``save_training`` / ``resume_training``: model, optimizer,
version, update count and whatever else the trainer keeps. torch is imported by the functions
that save and load, so the launcher can look for a checkpoint (``find_checkpoint``) without
paying for a torch import.

Durability: a checkpoint is written to a temporary file, fsynced, its SHA-256 written to a
temporary file beside it, fsynced; then the checkpoint is renamed into place, then its digest
(``ckpt_<version>.sha256``), and the directory fsynced. The checkpoint goes first so that a
digest under a final name always describes a checkpoint that is there: a crash between the two
renames leaves the new checkpoint with its digest still in the temporary file, and ``check``
accepts a checkpoint that matches either. A machine crash at any point leaves either the
previous checkpoints or the new one complete and verifiable under its final name, never an
empty or half-written file there. Resume tries the newest
checkpoint first and skips, with a warning, any whose digest does not match or that does not
load (truncated, corrupt, written by hand), so a bad file can cost one checkpoint's progress
but never the run. A full disk fails the save (``OSError``), removes the partial files and
leaves the older checkpoints in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_TRAINING_KEYS = ("model", "optimizer", "version", "updates")
_log = logging.getLogger(__name__)


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
        "model": model_state(model),
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
    """Load the newest complete checkpoint in ``directory`` into ``model`` and ``optimizer``;
    None when there is none. Checkpoints that fail their digest or do not load are skipped
    with a warning naming them. An optimizer state of other parameter groups (a changed
    config) is left out, with a warning: Adam starts afresh, the model does not."""
    loaded = load_newest_complete(directory, device, log)
    if loaded is None:
        return None
    path, state = loaded
    load_model_state(model, state["model"])
    try:
        optimizer.load_state_dict(state["optimizer"])
    except ValueError as err:
        log.warning("%s: optimizer state not restored (%s); Adam starts afresh", path, err)
    extra = {k: v for k, v in state.items() if k not in _TRAINING_KEYS}
    return Resumed(path, int(state["version"]), int(state["updates"]), extra)


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint keeps of ``model``: its state dict, or, where it trains only part of
    it (a policy with LoRA: adapters and heads), that part alone."""
    from transport.weights import trained_state_names

    state = model.state_dict()
    trained = trained_state_names(model)
    return state if trained is None else {k: state[k] for k in trained}


def load_model_state(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load what ``model_state`` kept into ``model`` (the frozen rest stays as it is).

    Raises:
        ValueError: ``state`` does not hold exactly the tensors ``model`` trains (a checkpoint
            of a run with another ``policy.lora``, or a whole model for a LoRA policy).
    """
    from transport.weights import trained_state_names

    trained = trained_state_names(model)
    if trained is None:
        model.load_state_dict(state)
        return
    missing, unexpected = sorted(set(trained) - set(state)), sorted(set(state) - set(trained))
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint does not hold this LoRA policy's trained tensors: missing "
            f"{missing[:3]} ({len(missing)}), unexpected {unexpected[:3]} ({len(unexpected)})"
        )
    model.load_state_dict(state, strict=False)


def load_newest_complete(
    directory: Path, device: torch.device, log: logging.Logger
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``directory`` that passes ``check`` and loads, with its state;
    None when none does. Each one skipped is logged with why."""
    for path in reversed(checkpoints(directory)):
        problem = check(path)
        if problem is None:
            try:
                state = load_checkpoint(path, device)
                if not all(key in state for key in _TRAINING_KEYS):
                    raise ValueError(f"missing {sorted(set(_TRAINING_KEYS) - set(state))}")
                return path, state
            except Exception as err:  # torch raises RuntimeError, pickle errors, EOFError...
                problem = f"does not load ({type(err).__name__}: {err})"
        log.warning("skipped checkpoint %s: %s", path, problem)
    return None


def check(path: Path) -> str | None:
    """Why the checkpoint at ``path`` must not be loaded (None: its digest matches, or it has
    no digest file, as checkpoints written by hand do; loading then decides)."""
    digest_path = _digest_path(path)
    expected = [_read_digest(p) for p in (digest_path, _tmp(digest_path))]
    if expected == [None, None]:
        return None if path.stat().st_size > 0 else "empty file"
    actual = _sha256(path)
    if actual not in expected:  # (the temporary one: a save stopped between its renames)
        shown = expected[0] or expected[1] or ""
        return f"SHA-256 {actual[:12]}... does not match {digest_path.name} ({shown[:12]}...)"
    return None


def _read_digest(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None


def _tmp(path: Path) -> Path:
    """Where ``save_checkpoint`` writes ``path`` before renaming it into place."""
    return path.with_name(path.name + ".tmp")


def save_checkpoint(directory: Path, version: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` durably as ``ckpt_<version>.pt`` (see the module doc) and keep only the
    newest ``keep``.

    Raises:
        OSError: the write failed (a full disk); nothing of it is left behind.
    """

    directory.mkdir(parents=True, exist_ok=True)
    # a save killed mid-write leaves its partial file: on a nearly full disk those would fail
    # every save after it (a temporary digest is kept: it may verify a renamed checkpoint)
    for partial in directory.glob("ckpt_*.pt.tmp"):
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    path = directory / f"ckpt_{version:08d}.pt"
    tmp = _tmp(path)
    digest_path = _digest_path(path)
    digest_tmp = _tmp(digest_path)
    renamed = False
    try:
        with open(tmp, "wb") as f:
            _torch_save(state, f)
            f.flush()
            os.fsync(f.fileno())
        _write_durably(digest_tmp, _sha256(tmp) + "\n")
        tmp.rename(path)  # the checkpoint first: a digest's final name always has its file
        renamed = True
        digest_tmp.rename(digest_path)
        _fsync_dir(directory)
    except BaseException:
        # Once the checkpoint is in place, its temporary digest is what verifies it: kept.
        for leftover in (tmp,) if renamed else (tmp, digest_tmp):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
        raise
    # Rotation counts back from the one just written: a file named after it is one a resume
    # skipped (it failed its check), and counting it would delete this one (keep 1)
    before = [old for old in checkpoints(directory) if old.name < path.name]
    for old in before[: max(len(before) - (keep - 1), 0)]:
        old.unlink()
        for digest in (_digest_path(old), _tmp(_digest_path(old))):
            with contextlib.suppress(FileNotFoundError):
                digest.unlink()
    return path


def _torch_save(state: dict[str, Any], file: Any) -> None:
    """``torch.save``, failing with the OSError a failed write raised: torch's zip writer
    reports it as a RuntimeError ("unexpected pos ...") while closing, and a full disk must
    read as the OSError it is."""
    import torch

    try:
        torch.save(state, file)
    except RuntimeError as err:
        cause = err.__context__
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        raise cause from err


def checkpoints(directory: Path) -> list[Path]:
    """The checkpoint files in ``directory``, oldest first (none: an empty list)."""
    return sorted(directory.glob("ckpt_*.pt")) if directory.is_dir() else []


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest checkpoint file in ``directory``, or None (not checked: see ``check``)."""
    found = checkpoints(directory)
    return found[-1] if found else None


def find_checkpoint(path: str | Path, verify: bool = True) -> Path | None:
    """The checkpoint ``path`` names: a checkpoint file itself, or the newest one in a
    checkpoints directory or a run dir (its ``checkpoints/``) that passes ``check`` (a save
    cut short is passed over, as a resuming trainer passes it over; ``verify`` False: the
    newest, unread, to ask only whether one is there); None when there is none."""
    path = Path(path)
    if path.is_dir():
        for directory in (path / "checkpoints", path):
            for candidate in reversed(checkpoints(directory)):
                try:
                    if not verify or check(candidate) is None:
                        return candidate
                except OSError:  # rotated away by a live run meanwhile
                    continue
        return None
    return path if path.is_file() else None


def load_checkpoint(path: str | Path, device: torch.device) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` (tensors and plain data only).

    ``path`` may be a checkpoint file, a checkpoints directory or a run dir (the newest
    complete one inside, see ``load_newest_complete``).
    """
    import torch

    path = Path(path)
    if path.is_dir():
        for directory in (path / "checkpoints", path):
            loaded = load_newest_complete(directory, device, _log)
            if loaded is not None:
                return loaded[1]
        raise FileNotFoundError(f"no complete ckpt_*.pt in {path} or {path / 'checkpoints'}")
    return torch.load(path, map_location=device, weights_only=True)


def _digest_path(path: Path) -> Path:
    return path.with_suffix(".sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable (a rename lives in the directory's data)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
