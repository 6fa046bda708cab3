"""Writes episodes as a LeRobot dataset: v3.0 by default, v2.1 on request.

:class:`LeRobotWriter` checks and stacks the frames, adds LeRobot's bookkeeping columns
(``timestamp = frame_index / fps`` in seconds, ``frame_index``, ``episode_index``, ``index`` the
global frame, ``task_index``), computes each episode's stats and hands the parquet table to a
layout that stores it:

- ``"v3.0"`` (:class:`sft.lerobot_v30.V30Layout`): many episodes per data file, metadata in
  parquet; what current LeRobot (0.4+) loads as is.
- ``"v2.1"`` (:class:`V21Layout`): one file per episode, metadata in JSON lines; what LeRobot up to
  0.3 loads (later versions convert it with their ``convert_dataset_v21_to_v30`` script)::

      root/
        data/chunk-000/episode_000000.parquet   one row per frame, one file per episode
        meta/info.json                          codebase_version "v2.1", fps, features, totals
        meta/episodes.jsonl                     {"episode_index", "tasks", "length"} per line
        meta/tasks.jsonl                        {"task_index", "task"} per line
        meta/episodes_stats.jsonl               per episode, per feature: min/max/mean/std/count

Both store camera images as ``dtype: image`` features, PNG bytes inside the parquet files, as
LeRobot does for datasets recorded without videos (see :mod:`sft.lerobot_format`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sft.lerobot_format import Feature, hf_features, to_column
from sft.lerobot_meta import INDEX_COLUMNS, EpisodeInfo
from sft.lerobot_stats import Stats, episode_stats, stats_to_json
from sft.lerobot_v30 import CHUNKS_SIZE, DATA_FILES_SIZE_IN_MB, V30Layout

FORMATS = ("v3.0", "v2.1")
DEFAULT_FORMAT = "v3.0"
V21_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
INDEX_FEATURES = {name: Feature(dtype=dtype, shape=(1,)) for name, dtype in INDEX_COLUMNS.items()}


class Layout(Protocol):
    """Where and how a format stores the episodes and the metadata besides ``info.json``."""

    version: str

    def write_episode(self, table: pa.Table, episode: EpisodeInfo, stats: Stats) -> None: ...

    def finalize(self, tasks: list[str]) -> dict[str, Any]:
        """Write the metadata files; return the format's own ``info.json`` entries."""
        ...


class V21Layout:
    """LeRobot's v2.1 layout (see the module docstring); ``chunks_size`` episodes a chunk."""

    version = "v2.1"

    def __init__(self, root: Path, *, chunks_size: int) -> None:
        self.root, self.chunks_size = root, chunks_size
        self._episodes: list[dict[str, Any]] = []
        self._stats: list[dict[str, Any]] = []

    def write_episode(self, table: pa.Table, episode: EpisodeInfo, stats: Stats) -> None:
        index = episode.episode_index
        path = self.root / V21_DATA_PATH.format(
            episode_chunk=index // self.chunks_size, episode_index=index
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, compression="zstd")
        self._episodes.append(episode.to_json())
        self._stats.append({"episode_index": index, "stats": stats_to_json(stats)})

    def finalize(self, tasks: list[str]) -> dict[str, Any]:
        meta = self.root / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        _write_jsonl(meta / "episodes.jsonl", self._episodes)
        _write_jsonl(
            meta / "tasks.jsonl", [{"task_index": i, "task": t} for i, t in enumerate(tasks)]
        )
        _write_jsonl(meta / "episodes_stats.jsonl", self._stats)
        return {
            "total_videos": 0,
            "total_chunks": -(-len(self._episodes) // self.chunks_size),
            "chunks_size": self.chunks_size,
            "data_path": V21_DATA_PATH,
        }


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _stack_frames(
    frames: Sequence[Mapping[str, Any]] | Mapping[str, Any], features: Mapping[str, Feature]
) -> dict[str, np.ndarray]:
    """Frames (list of per-frame dicts, or a dict of ``[T, ...]`` arrays) -> checked arrays."""
    if isinstance(frames, Mapping):
        cols = {k: np.asarray(v) for k, v in frames.items()}
    else:
        if not frames:
            raise ValueError("an episode needs at least one frame")
        cols = {k: np.stack([np.asarray(f[k]) for f in frames]) for k in frames[0]}
    if set(cols) != set(features):
        raise KeyError(f"frame keys {sorted(cols)} != declared features {sorted(features)}")
    lengths = {len(v) for v in cols.values()}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"features have different or zero lengths: {lengths}")
    (length,) = lengths
    out = {}
    for key, feature in features.items():
        arr = cols[key]
        if arr.shape[1:] != feature.shape and not (feature.is_scalar and arr.size == length):
            raise ValueError(f"{key}: frames of shape {arr.shape[1:]}, declared {feature.shape}")
        out[key] = arr.reshape(length, *feature.shape).astype(feature.numpy_dtype, copy=False)
    return out


def _check_root(root: Path, overwrite: bool) -> bool:
    """Whether a dataset can go to ``root``; True when an earlier LeRobot dataset is there to
    replace (``overwrite``), which is the only thing ever deleted.

    Raises:
        FileExistsError: something else is there.
    """
    if not root.exists() or (root.is_dir() and not any(root.iterdir())):
        return False
    if not overwrite:
        raise FileExistsError(
            f"{root} exists and is not empty (overwrite replaces an earlier dataset)"
        )
    if not (root / "meta" / "info.json").is_file():
        raise FileExistsError(
            f"{root} is not a LeRobot dataset (no meta/info.json): not deleting it"
        )
    return True


def _aside(root: Path, kind: str) -> Path:
    """A folder beside ``root`` of this host's and process's: ``writing`` (the dataset until it
    is whole) or ``replaced`` (the earlier dataset, until the new one is in)."""
    return root.with_name(f".{root.name}.{kind}-{socket.gethostname()}-{os.getpid()}")


def _recover_dead_writers(root: Path) -> None:
    """Finish or clear what writers of this host that are gone left beside ``root``, never a
    live writer's: a whole dataset (killed between moving the earlier one aside and this one
    in) goes in where none is; anything else is removed."""
    host = socket.gethostname()
    for kind in ("writing", "replaced"):  # (a whole new dataset wins over the one it replaced)
        for left in root.parent.glob(f".{root.name}.{kind}-{host}-*"):
            pid = left.name.rpartition("-")[2]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            if (left / "meta" / "info.json").is_file() and not root.exists():
                left.rename(root)
            else:
                shutil.rmtree(left, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return True


def _move_into_place(side: Path, root: Path, overwrite: bool) -> None:
    """Make the whole dataset in ``side`` the one at ``root``: an earlier one there (with
    ``overwrite``) is moved aside first and deleted only once the new one is in place. A
    ``root`` that stays (an empty folder, or a mount point, which cannot be renamed) takes the
    dataset's entries, ``meta`` last."""
    earlier: Path | None = None
    if _check_root(root, overwrite):
        earlier = _aside(root, "replaced")
        try:
            root.rename(earlier)
        except OSError:  # a mount point: emptied in place
            earlier = None
            for entry in list(root.iterdir()):
                _remove(entry)
    if root.exists():
        for entry in sorted(side.iterdir(), key=lambda e: e.name == "meta"):
            _move(entry, root / entry.name)
        side.rmdir()
    else:
        side.rename(root)
    if earlier is not None:
        shutil.rmtree(earlier, ignore_errors=True)


def _move(src: Path, dst: Path) -> None:
    """Rename, or copy across file systems (a ``root`` that is a mount point)."""
    try:
        os.replace(src, dst)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        shutil.move(src, dst)


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()


class LeRobotWriter:
    """Writes episodes as they come; ``finalize()`` (or leaving the ``with`` block) writes the
    metadata.

    Args:
        root: dataset directory (created).
        features: per-frame features, e.g. ``{"observation.image": Feature(dtype="image",
            shape=(64, 64, 3), names=IMAGE_NAMES), "action": Feature(dtype="float32",
            shape=(2,))}``. Names must not clash with the bookkeeping columns (``INDEX_COLUMNS``).
        fps: frames per second of the recording (``timestamp = frame_index / fps``).
        robot_type: stored in ``info.json``.
        codebase_version: ``"v3.0"`` (LeRobot 0.4+) or ``"v2.1"`` (LeRobot up to 0.3).
        chunks_size: v3.0: data files per ``data/chunk-NNN`` directory; v2.1: episodes per one.
        data_files_size_in_mb: v3.0 only: a data file takes episodes up to about this size.
        overwrite: replace an existing dataset at ``root``. Only a LeRobot dataset (a directory
            with ``meta/info.json``) is ever deleted; any other non-empty directory raises.
    """

    def __init__(
        self,
        root: str | Path,
        features: Mapping[str, Feature],
        *,
        fps: int = 10,
        robot_type: str = "rlvla3",
        codebase_version: str = DEFAULT_FORMAT,
        chunks_size: int = CHUNKS_SIZE,
        data_files_size_in_mb: float = DATA_FILES_SIZE_IN_MB,
        overwrite: bool = False,
    ) -> None:
        self.root = Path(root)
        clash = set(features) & set(INDEX_COLUMNS)
        if clash:
            raise ValueError(f"feature names clash with bookkeeping columns: {sorted(clash)}")
        if codebase_version not in FORMATS:
            raise ValueError(f"codebase_version {codebase_version!r}: write one of {FORMATS}")
        # written aside and moved in whole by finalize(): an interrupted writer leaves the
        # dataset that was there (or none), never half of one that a reader or a retry trips on
        self.root, self.overwrite = Path(root), overwrite
        # (a symlink's target: the dataset is written beside where it will be, on its disk)
        self._target = self.root.expanduser().resolve()
        _recover_dead_writers(self._target)
        _check_root(self._target, overwrite)
        self.writing = _aside(self._target, "writing")
        shutil.rmtree(self.writing, ignore_errors=True)
        self.writing.mkdir(parents=True)
        self.features = dict(features)
        self.fps, self.robot_type = fps, robot_type
        self.layout: Layout = (
            V30Layout(
                self.writing, chunks_size=chunks_size, data_files_size_in_mb=data_files_size_in_mb
            )
            if codebase_version == "v3.0"
            else V21Layout(self.writing, chunks_size=chunks_size)
        )
        self.episodes: list[EpisodeInfo] = []
        self._task_index: dict[str, int] = {}
        self._num_frames = 0
        self._finalized = False
        self._all_features = {**self.features, **INDEX_FEATURES}
        self._schema_metadata = {b"huggingface": hf_features(self._all_features)}

    def add_episode(
        self, frames: Sequence[Mapping[str, Any]] | Mapping[str, Any], task: str
    ) -> int:
        """Write one episode; returns its episode index.

        Args:
            frames: either a list of per-frame dicts ``{feature: array of feature.shape}``, or a
                dict ``{feature: array[T, *feature.shape]}``; exactly the declared features.
            task: the episode's language instruction.
        """
        if self._finalized:
            raise RuntimeError("add_episode() after finalize()")
        cols = _stack_frames(frames, self.features)
        length = len(next(iter(cols.values())))
        index = len(self.episodes)
        task_index = self._task_index.setdefault(task, len(self._task_index))
        frame_index = np.arange(length, dtype=np.int64)
        cols["timestamp"] = (frame_index / self.fps).astype(np.float32)
        cols["frame_index"] = frame_index
        cols["episode_index"] = np.full(length, index, np.int64)
        cols["index"] = frame_index + self._num_frames
        cols["task_index"] = np.full(length, task_index, np.int64)
        table = pa.table({key: to_column(cols[key], f) for key, f in self._all_features.items()})
        episode = EpisodeInfo(episode_index=index, tasks=(task,), length=length)
        stats = episode_stats(cols, self._all_features, quantiles=self.layout.version == "v3.0")
        self.layout.write_episode(
            table.replace_schema_metadata(self._schema_metadata), episode, stats
        )
        self.episodes.append(episode)
        self._num_frames += length
        return index

    def finalize(self) -> None:
        """Write ``meta/info.json`` and the format's other metadata files, and move the whole
        dataset to ``root``."""
        storage = self.layout.finalize(list(self._task_index))  # tasks in task-index order
        num_episodes = len(self.episodes)
        info = {
            "codebase_version": self.layout.version,
            "robot_type": self.robot_type,
            "total_episodes": num_episodes,
            "total_frames": self._num_frames,
            "total_tasks": len(self._task_index),
            **storage,
            "fps": self.fps,
            "splits": {"train": f"0:{num_episodes}"},
            "video_path": None,
            "features": {k: f.to_json() for k, f in self._all_features.items()},
        }
        (self.writing / "meta" / "info.json").write_text(json.dumps(info, indent=2) + "\n")
        _move_into_place(self.writing, self._target, self.overwrite)
        self._finalized = True

    def __enter__(self) -> LeRobotWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None and not self._finalized:
            self.finalize()
        elif exc_type is not None:  # nothing of a dataset that was not finished
            shutil.rmtree(self.writing, ignore_errors=True)
