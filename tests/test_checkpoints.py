"""Durable checkpoints: what a crash or a full disk leaves behind, and what resume loads."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys

import pytest
import torch

from rlvla3.runtime import checkpoints
from rlvla3.runtime.checkpoints import checkpoints as listed
from rlvla3.runtime.checkpoints import resume_training, save_training
from tests.launching import REPO


def _model(value: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model, torch.optim.Adam(model.parameters())


def _save(directory, version: int, keep: int = 5):
    model, optim = _model(float(version))
    return save_training(
        directory, model=model, optimizer=optim, version=version, updates=version * 10, keep=keep
    )


def _resume(directory, caplog):
    model, optim = _model(0.0)
    with caplog.at_level(logging.WARNING):
        resumed = resume_training(
            directory,
            model=model,
            optimizer=optim,
            device=torch.device("cpu"),
            log=logging.getLogger("t"),
        )
    return resumed, model


def test_a_checkpoint_has_its_digest_and_no_temporary_files(tmp_path) -> None:
    path = _save(tmp_path, 3)
    assert path.name == "ckpt_00000003.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt_00000003.pt",
        "ckpt_00000003.sha256",
    ]
    assert checkpoints.check(path) is None


@pytest.mark.parametrize("damage", ["truncate", "empty", "flip"])
def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, caplog, damage: str) -> None:
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        newest.write_bytes(b"")
    else:  # one flipped byte in the tensor data: still a loadable zip, a wrong digest
        i = len(data) // 2
        newest.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])
    resumed, model = _resume(tmp_path, caplog)
    assert resumed is not None and resumed.version == 1 and resumed.updates == 10
    assert torch.all(model.weight == 1.0)
    assert f"skipped checkpoint {newest}" in caplog.text


def test_a_checkpoint_without_digest_loads_if_whole_and_is_skipped_if_not(tmp_path, caplog):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    newest.with_suffix(".sha256").unlink()  # e.g. copied in by hand
    resumed, _ = _resume(tmp_path, caplog)
    assert resumed is not None and resumed.version == 2
    newest.write_bytes(newest.read_bytes()[:100])
    resumed, _ = _resume(tmp_path, caplog)
    assert resumed is not None and resumed.version == 1
    assert "does not load" in caplog.text


def test_nothing_loadable_means_no_resume(tmp_path, caplog) -> None:
    (tmp_path / "ckpt_00000001.pt").write_bytes(b"not a checkpoint")
    resumed, _ = _resume(tmp_path, caplog)
    assert resumed is None and "skipped checkpoint" in caplog.text


def test_a_full_disk_leaves_the_older_checkpoints_and_no_partial_file(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    def full_disk(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt_00000001.pt",
        "ckpt_00000001.sha256",
    ]


class _DiskFullAfter:
    """A file that takes ``room`` bytes, then fails every write with ENOSPC (a full disk as
    torch.save meets it: its zip writer then fails again, with a RuntimeError, closing)."""

    def __init__(self, path, mode: str, room: int) -> None:
        self.file, self.room = open(path, mode), room  # noqa: SIM115 (closed by __exit__)

    def write(self, data) -> int:
        size = len(data.encode() if isinstance(data, str) else memoryview(data).cast("B"))
        if size > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= size
        return self.file.write(data)

    def __getattr__(self, name: str):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def test_a_disk_that_fills_inside_torch_save_fails_the_save_with_an_oserror(tmp_path, monkeypatch):
    """torch's zip writer turns the ENOSPC into a RuntimeError: the save still fails as the
    OSError it is (which the trainers count and ride out), leaving no partial file."""
    _save(tmp_path, 1)
    monkeypatch.setattr(
        checkpoints, "open", lambda path, mode: _DiskFullAfter(path, mode, 300), raising=False
    )
    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt_00000001.pt",
        "ckpt_00000001.sha256",
    ]


def test_keep_prunes_old_checkpoints_with_their_digests(tmp_path) -> None:
    for version in range(1, 5):
        _save(tmp_path, version, keep=2)
    assert [p.name for p in listed(tmp_path)] == ["ckpt_00000003.pt", "ckpt_00000004.pt"]
    assert sorted(p.name for p in tmp_path.glob("*.sha256")) == [
        "ckpt_00000003.sha256",
        "ckpt_00000004.sha256",
    ]


@pytest.mark.parametrize("keep", [1, 2])
def test_rotation_after_resuming_from_an_older_checkpoint_keeps_the_new_ones(
    tmp_path, caplog, keep: int
) -> None:
    """The newest checkpoint is damaged, so the trainer resumes from the one before and saves
    lower-numbered ones after it: rotation counts back from what it just wrote (it deleted
    the new checkpoint itself with keep 1, leaving only the damaged one)."""
    for version in (100, 200):
        _save(tmp_path, version, keep=keep + 1)
    damaged = tmp_path / "ckpt_00000200.pt"
    damaged.write_bytes(damaged.read_bytes()[:100])
    assert checkpoints.find_checkpoint(tmp_path).name == "ckpt_00000100.pt"  # skipped, as resume
    resumed, _ = _resume(tmp_path, caplog)
    assert resumed is not None and resumed.version == 100
    for version in (101, 102, 103):
        written = _save(tmp_path, version, keep=keep)
        assert written.exists()
    (tmp_path / "ckpt_00000104.pt.tmp").write_bytes(b"partial")  # a save killed mid-write
    _save(tmp_path, 103, keep=keep)
    assert not list(tmp_path.glob("*.pt.tmp"))  # its partial file is gone with the next save
    names = [p.name for p in listed(tmp_path)]
    kept = [f"ckpt_{v:08d}.pt" for v in (101, 102, 103)][-keep:]
    assert names == [*kept, "ckpt_00000200.pt"]  # the skipped one left for a look
    resumed, model = _resume(tmp_path, caplog)
    assert resumed is not None and resumed.version == 103 and torch.all(model.weight == 103.0)


def test_saving_fsyncs_the_file_and_the_directory(tmp_path, monkeypatch) -> None:
    synced: list[str] = []
    real_fsync = checkpoints.os.fsync

    def fsync(fd: int) -> None:
        synced.append(checkpoints.os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(checkpoints.os, "fsync", fsync)
    _save(tmp_path, 7)
    # the data (under its temporary name), its digest, then the directory after the renames
    assert synced == [
        str(tmp_path / "ckpt_00000007.pt.tmp"),
        str(tmp_path / "ckpt_00000007.sha256.tmp"),
        str(tmp_path),
    ]


_SAVE_THEN_CRASH = """
import os, sys, torch
from pathlib import Path
from rlvla3.runtime.checkpoints import save_training

real_rename, renames = os.rename, []

def rename(src, dst, *args, **kwargs):
    renames.append(dst)
    if len(renames) == 2:  # the machine stops between the two renames: nothing else runs
        os._exit(17)
    return real_rename(src, dst, *args, **kwargs)

os.rename = rename
model = torch.nn.Linear(3, 2)
torch.nn.init.constant_(model.weight, float(sys.argv[3]))
save_training(Path(sys.argv[1]), model=model, optimizer=torch.optim.Adam(model.parameters()),
              version=int(sys.argv[2]), updates=0, keep=5)
"""


@pytest.mark.parametrize("same_version_there", [False, True])
def test_a_crash_between_the_two_renames_leaves_a_verified_newest_checkpoint(
    tmp_path, caplog, same_version_there: bool
) -> None:
    """The checkpoint is renamed into place before its digest: a crash between the two leaves
    the new checkpoint, verified against its digest's temporary file, and no digest without
    its checkpoint. (In the other order a crash leaves a digest naming a missing checkpoint,
    or one that condemns the checkpoint of that version already there.)"""
    _save(tmp_path, 1)
    if same_version_there:
        _save(tmp_path, 2)  # (a value of 2.0; the crashed save writes 7.0 as v2)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    crashed = subprocess.run(
        [sys.executable, "-c", _SAVE_THEN_CRASH, str(tmp_path), "2", "7.0"], env=env, timeout=120
    )
    assert crashed.returncode == 17
    for digest in tmp_path.glob("*.sha256"):
        assert digest.with_suffix(".pt").exists(), f"{digest.name} without its checkpoint"
    resumed, model = _resume(tmp_path, caplog)
    assert resumed is not None and resumed.version == 2
    assert torch.all(model.weight == 7.0)
    assert "skipped" not in caplog.text
