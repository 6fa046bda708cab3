"""The LeRobot dataset writer's refusals and what an interrupted write leaves (``sft/lerobot_writer.py``:
a dataset is written aside and moved in whole)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sft.lerobot import Feature, LeRobotDataset, LeRobotWriter
from tests.test_lerobot import FEATURES, _episode


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    writer = LeRobotWriter(tmp_path / "ds", FEATURES)
    bad = _episode(rng, 3)
    del bad["action"]
    with pytest.raises(KeyError, match="action"):
        writer.add_episode(bad, "t")
    bad = _episode(rng, 3)
    bad["action"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError):
        writer.add_episode(bad, "t")
    bad["action"] = np.zeros((3, 2), np.float32)
    bad["observation.image"] = np.zeros((3, 6, 8, 3), np.uint8)  # same size, wrong shape
    with pytest.raises(ValueError, match="observation.image"):
        writer.add_episode(bad, "t")
    with pytest.raises(ValueError, match="episode_index"):
        LeRobotWriter(tmp_path / "other", {"episode_index": Feature(dtype="int64", shape=(1,))})
    writer.add_episode(_episode(rng, 2), "t")
    writer.finalize()
    with pytest.raises(RuntimeError):
        writer.add_episode(_episode(rng, 2), "t")
    with pytest.raises(FileExistsError, match="overwrite"):
        LeRobotWriter(tmp_path / "ds", FEATURES)
    LeRobotWriter(tmp_path / "ds", FEATURES, overwrite=True).finalize()
    assert len(LeRobotDataset(tmp_path / "ds")) == 0
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a LeRobot dataset"):
        LeRobotWriter(notes, FEATURES, overwrite=True)  # overwrite deletes datasets only
    assert (notes / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("version", ["v3.0", "v2.1"])
def test_an_interrupted_write_leaves_the_earlier_dataset_and_a_retry_works(
    tmp_path: Path, version: str
) -> None:
    """A dataset is written aside and moved in whole: an interrupted writer (SFT's demo
    generation killed, Ctrl-C in `rlvla3 demos --overwrite`) leaves the dataset that was there,
    and the next writer goes ahead (it was refused both ways before)."""
    import socket

    rng = np.random.default_rng(2)
    ds = tmp_path / "ds"
    with LeRobotWriter(ds, FEATURES, codebase_version=version) as writer:
        writer.add_episode(_episode(rng, 2), "t")
    with pytest.raises(KeyboardInterrupt):
        with LeRobotWriter(ds, FEATURES, codebase_version=version, overwrite=True) as writer:
            writer.add_episode(_episode(rng, 3), "t")
            assert not (ds / "meta" / "info.json").read_text().count('"total_frames": 3')
            raise KeyboardInterrupt
    assert len(LeRobotDataset(ds)) == 2  # the earlier one, whole
    killed = tmp_path / f".ds.writing-{socket.gethostname()}-999999999"  # a writer killed -9
    (killed / "data").mkdir(parents=True)
    with LeRobotWriter(ds, FEATURES, codebase_version=version, overwrite=True) as writer:
        writer.add_episode(_episode(rng, 3), "t")
    assert len(LeRobotDataset(ds)) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no side folder left


def test_a_dataset_goes_into_an_empty_folder_a_symlink_and_survives_a_kill_between_renames(
    tmp_path: Path,
) -> None:
    import socket

    rng = np.random.default_rng(3)
    empty = tmp_path / "empty"
    empty.mkdir()  # (a mount point, say: it stays, the entries move in)
    with LeRobotWriter(empty, FEATURES) as writer:
        writer.add_episode(_episode(rng, 2), "t")
    assert len(LeRobotDataset(empty)) == 2
    real = tmp_path / "disk"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with LeRobotWriter(link, FEATURES) as writer:
        writer.add_episode(_episode(rng, 3), "t")
    assert link.is_symlink() and len(LeRobotDataset(link)) == 3
    # killed after moving the earlier dataset aside, before moving the new one in
    ds = tmp_path / "ds"
    host = socket.gethostname()
    for kind, frames in (("replaced", 2), ("writing", 4)):
        with LeRobotWriter(tmp_path / kind, FEATURES) as writer:
            writer.add_episode(_episode(rng, frames), "t")
        (tmp_path / kind).rename(tmp_path / f".ds.{kind}-{host}-999999999")
    LeRobotWriter(ds, FEATURES, overwrite=True)  # the next writer finishes the dead one's move
    assert len(LeRobotDataset(ds)) == 4
    assert not list(tmp_path.glob(".ds.replaced-*"))
