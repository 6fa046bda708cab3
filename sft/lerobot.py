"""Demonstration datasets in the LeRobot on-disk layout: a writer (v2.1) and a reader (v2.x, v3.0).

What :class:`LeRobotWriter` writes (LeRobot's v2.1 layout, which LeRobot loads as is and converts
to v3.0 with its own converter)::

    root/
      data/chunk-000/episode_000000.parquet   one row per frame, one file per episode
      meta/info.json                          codebase_version, fps, features, totals, paths
      meta/episodes.jsonl                     {"episode_index", "tasks", "length"} per line
      meta/tasks.jsonl                        {"task_index", "task"} per line
      meta/episodes_stats.jsonl               per episode, per feature: min/max/mean/std/count

Camera images are ``dtype: image`` features, PNG bytes inside the parquet files, as LeRobot
stores them (so LeRobot sees them as visual features); other features are numeric columns (see
:mod:`sft.lerobot_format`). Per frame the writer adds LeRobot's bookkeeping columns
``episode_index``, ``frame_index``, ``index`` (global frame), ``timestamp`` (``frame_index / fps``,
seconds) and ``task_index``.

:class:`LeRobotDataset` reads that, LeRobot's own v2.0/v2.1 datasets, and v3.0 ones (several
episodes per ``data/chunk-NNN/file-NNN.parquet``, episodes in ``meta/episodes/``, tasks in
``meta/tasks.parquet``). Video features are not supported; any dataset that cannot be read as
declared raises :class:`DatasetError` naming the file and the field.
"""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sft.lerobot_format import (
    IMAGE,
    IMAGE_NAMES,
    DatasetError,
    Feature,
    episode_stats,
    from_column,
    hf_features,
    to_column,
)
from sft.lerobot_meta import INDEX_COLUMNS, EpisodeInfo, read_metadata, read_table

__all__ = [
    "DatasetError",
    "EpisodeInfo",
    "Feature",
    "LeRobotDataset",
    "LeRobotWriter",
    "image_feature",
    "to_policy_obs",
]

CODEBASE_VERSION = "v2.1"
DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
INDEX_FEATURES = {name: Feature(dtype=dtype, shape=(1,)) for name, dtype in INDEX_COLUMNS.items()}


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


class LeRobotWriter:
    """Writes episodes one parquet file at a time; ``finalize()`` writes the meta files.

    Args:
        root: dataset directory (created).
        features: per-frame features, e.g. ``{"observation.image": Feature(dtype="image",
            shape=(64, 64, 3), names=IMAGE_NAMES), "action": Feature(dtype="float32",
            shape=(2,))}``. Names must not clash with the bookkeeping columns (``INDEX_COLUMNS``).
        fps: frames per second of the recording (``timestamp = frame_index / fps``).
        robot_type: stored in ``info.json``.
        chunks_size: episodes per ``data/chunk-NNN`` directory.
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
        chunks_size: int = 1000,
        overwrite: bool = False,
    ) -> None:
        self.root = Path(root)
        clash = set(features) & set(INDEX_COLUMNS)
        if clash:
            raise ValueError(f"feature names clash with bookkeeping columns: {sorted(clash)}")
        if self.root.exists() and (not self.root.is_dir() or any(self.root.iterdir())):
            if not overwrite:
                raise FileExistsError(
                    f"{self.root} exists and is not empty (overwrite replaces an earlier dataset)"
                )
            if not (self.root / "meta" / "info.json").is_file():
                raise FileExistsError(
                    f"{self.root} is not a LeRobot dataset (no meta/info.json): not deleting it"
                )
            shutil.rmtree(self.root)
        self.features = dict(features)
        self.fps, self.robot_type, self.chunks_size = fps, robot_type, chunks_size
        self.episodes: list[EpisodeInfo] = []
        self._stats: list[dict[str, Any]] = []
        self._task_index: dict[str, int] = {}
        self._num_frames = 0
        self._finalized = False
        all_features = {**self.features, **INDEX_FEATURES}
        self._schema_metadata = {b"huggingface": hf_features(all_features)}

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
        all_features = {**self.features, **INDEX_FEATURES}
        table = pa.table({key: to_column(cols[key], f) for key, f in all_features.items()})
        path = self.root / DATA_PATH.format(
            episode_chunk=index // self.chunks_size, episode_index=index
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(
            table.replace_schema_metadata(self._schema_metadata), path, compression="zstd"
        )
        self.episodes.append(EpisodeInfo(episode_index=index, tasks=(task,), length=length))
        self._stats.append({"episode_index": index, "stats": episode_stats(cols, all_features)})
        self._num_frames += length
        return index

    def finalize(self) -> None:
        """Write ``meta/info.json``, ``episodes.jsonl``, ``tasks.jsonl``, ``episodes_stats.jsonl``."""
        meta = self.root / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        features = {k: f.to_json() for k, f in {**self.features, **INDEX_FEATURES}.items()}
        num_episodes = len(self.episodes)
        info = {
            "codebase_version": CODEBASE_VERSION,
            "robot_type": self.robot_type,
            "total_episodes": num_episodes,
            "total_frames": self._num_frames,
            "total_tasks": len(self._task_index),
            "total_videos": 0,
            "total_chunks": -(-num_episodes // self.chunks_size),
            "chunks_size": self.chunks_size,
            "fps": self.fps,
            "splits": {"train": f"0:{num_episodes}"},
            "data_path": DATA_PATH,
            "video_path": None,
            "features": features,
        }
        (meta / "info.json").write_text(json.dumps(info, indent=2) + "\n")
        _write_jsonl(meta / "episodes.jsonl", [e.to_json() for e in self.episodes])
        tasks = [{"task_index": i, "task": t} for t, i in self._task_index.items()]
        _write_jsonl(meta / "tasks.jsonl", tasks)
        _write_jsonl(meta / "episodes_stats.jsonl", self._stats)
        self._finalized = True

    def __enter__(self) -> LeRobotWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None and not self._finalized:
            self.finalize()


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


class LeRobotDataset:
    """Reads a LeRobot dataset (v2.0, v2.1 or v3.0; numeric and image features).

    ``dataset[i]`` is global frame ``i``: ``{feature: np.ndarray of feature.shape}`` for the
    declared features, the bookkeeping columns as numpy scalars, and ``"task"`` (the instruction
    string). Episodes are read whole and the last ``cache_episodes`` are kept in memory. Every
    episode read is checked against the metadata (its length, its ``episode_index``).

    Args:
        root: dataset directory.
        cache_episodes: how many decoded episodes to keep.

    Raises:
        DatasetError: naming the file and field that does not match the LeRobot layout.
    """

    def __init__(self, root: str | Path, *, cache_episodes: int = 8) -> None:
        self.root = Path(root)
        meta = read_metadata(self.root)
        self.info, self.version, self.fps = meta.info, meta.version, meta.fps
        self.features = meta.features
        self.episodes = meta.episodes
        self.tasks = [meta.tasks[i] for i in sorted(meta.tasks)]  # by task index
        self._meta = meta
        lengths = np.array([e.length for e in self.episodes], np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)])
        self._position = {e.episode_index: i for i, e in enumerate(self.episodes)}
        self._cache: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._cache_size = max(cache_episodes, 1)
        self._file_cache: tuple[Path, pa.Table] | None = None

    def __len__(self) -> int:
        """Total number of frames."""
        return int(self._starts[-1])

    def episode_path(self, episode_index: int) -> Path:
        """The parquet file that holds the episode's frames."""
        return self._meta.data_file(self.root, episode_index)

    def _episode_table(self, episode_index: int, path: Path) -> pa.Table:
        if self.version != "v3.0":
            return read_table(path)
        if self._file_cache is None or self._file_cache[0] != path:  # episodes share a file
            self._file_cache = (path, read_table(path))
        table = self._file_cache[1]
        column = table.column("episode_index") if "episode_index" in table.column_names else None
        if column is None or not pa.types.is_integer(column.type):
            raise DatasetError(f"{path}: no integer column 'episode_index'")
        return table.filter(pc.equal(column, episode_index))

    def episode(self, episode_index: int) -> dict[str, np.ndarray]:
        """All frames of one episode: ``{feature: array[T, *shape]}``, bookkeeping as ``[T]``."""
        cached = self._cache.get(episode_index)
        if cached is not None:
            self._cache.move_to_end(episode_index)
            return cached
        if episode_index not in self._position:
            raise DatasetError(f"{self.root}: no episode {episode_index} in the metadata")
        path = self.episode_path(episode_index)
        table = self._episode_table(episode_index, path)
        missing = (set(self.features) | set(INDEX_COLUMNS)) - set(table.column_names)
        if missing:
            raise DatasetError(f"{path}: episode {episode_index} lacks columns {sorted(missing)}")
        expected = self.episodes[self._position[episode_index]].length
        if table.num_rows != expected:
            raise DatasetError(
                f"{path}: episode {episode_index} has {table.num_rows} frames, "
                f"the metadata says length {expected}"
            )
        out = {
            k: from_column(table.column(k), f, f"{path}: {k}")
            for k, f in {**self.features, **INDEX_FEATURES}.items()
        }
        for name in INDEX_COLUMNS:  # one value per frame: [T]
            out[name] = out[name].reshape(-1)
        if np.any(out["episode_index"] != episode_index):
            raise DatasetError(
                f"{path}: rows of another episode than {episode_index} (column episode_index)"
            )
        unknown = set(np.unique(out["task_index"]).tolist()) - set(self._meta.tasks)
        if unknown:
            raise DatasetError(
                f"{path}: episode {episode_index}: task_index {sorted(unknown)} "
                "not in the tasks metadata"
            )
        self._cache[episode_index] = out
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"frame {index} out of range for {len(self)} frames")
        index %= len(self)
        ep = int(np.searchsorted(self._starts, index, side="right")) - 1
        data = self.episode(self.episodes[ep].episode_index)
        offset = index - int(self._starts[ep])
        item: dict[str, Any] = {k: v[offset] for k, v in data.items()}
        item["task"] = self._meta.tasks[int(item["task_index"])]
        return item


def image_feature(shape: Sequence[int]) -> Feature:
    """A LeRobot camera-image feature of ``[height, width, channels]``."""
    return Feature(dtype=IMAGE, shape=tuple(shape), names=IMAGE_NAMES)


def to_policy_obs(sample: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The wire observation of a sample: ``observation.<key>`` entries renamed to ``<key>``."""
    prefix = "observation."
    return {k[len(prefix) :]: np.asarray(v) for k, v in sample.items() if k.startswith(prefix)}
