"""Demonstration datasets in the LeRobot (v2.0) on-disk layout.

::

    root/
      data/chunk-000/episode_000000.parquet   one row per frame
      meta/info.json                          fps, features (dtype, shape), totals, paths
      meta/episodes.jsonl                     {"episode_index", "tasks", "length"} per line
      meta/tasks.jsonl                        {"task_index", "task"} per line

Every feature, images included, is stored as an array column in the parquet files (images are
``uint8[H, W, 3]`` flattened into a fixed-size list column and reshaped on read from the shape in
``info.json``), not as PNG/MP4 files under ``images/``/``videos/``: simpler, no codec, and the
small images of our tasks compress well with zstd. Per frame, the writer adds the LeRobot
bookkeeping columns ``episode_index``, ``frame_index``, ``index`` (global frame), ``timestamp``
(``frame_index / fps``, seconds) and ``task_index``.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CODEBASE_VERSION = "v2.0"
DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
INDEX_COLUMNS = {
    "timestamp": "float32",
    "frame_index": "int64",
    "episode_index": "int64",
    "index": "int64",
    "task_index": "int64",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Feature:
    """One per-frame column.

    Attributes:
        dtype: numpy dtype name (``"float32"``, ``"uint8"``, ``"int32"``, ``"int64"``, ``"bool"``).
        shape: per-frame shape, e.g. ``(64, 64, 3)`` for an image, ``(1,)`` for a reward.
        names: optional names of the last axis' entries (LeRobot's ``names``).
    """

    dtype: str
    shape: tuple[int, ...]
    names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        np.dtype(self.dtype)  # raises TypeError on unknown dtypes
        if any(int(d) < 1 for d in self.shape):
            raise ValueError(f"feature shape must be positive, got {self.shape}")

    def to_json(self) -> dict[str, Any]:
        names = list(self.names) if self.names is not None else None
        return {"dtype": self.dtype, "shape": list(self.shape), "names": names}

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> Feature:
        names = obj.get("names")
        names = tuple(names) if isinstance(names, list) else None
        return Feature(dtype=obj["dtype"], shape=tuple(obj["shape"]), names=names)


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeInfo:
    """One line of ``meta/episodes.jsonl``: index, task strings, length in frames."""

    episode_index: int
    tasks: tuple[str, ...]
    length: int

    def to_json(self) -> dict[str, Any]:
        return {
            "episode_index": self.episode_index,
            "tasks": list(self.tasks),
            "length": self.length,
        }

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> EpisodeInfo:
        return EpisodeInfo(
            episode_index=int(obj["episode_index"]),
            tasks=tuple(obj["tasks"]),
            length=int(obj["length"]),
        )


def _is_scalar(feature: Feature) -> bool:
    return math.prod(feature.shape) == 1 and len(feature.shape) <= 1


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
        if arr.shape[1:] != feature.shape and not (_is_scalar(feature) and arr.size == length):
            raise ValueError(f"{key}: frames of shape {arr.shape[1:]}, declared {feature.shape}")
        out[key] = arr.reshape(length, *feature.shape).astype(feature.dtype, copy=False)
    return out


def _to_column(arr: np.ndarray, feature: Feature) -> pa.Array:
    if _is_scalar(feature):
        return pa.array(arr.reshape(len(arr)))
    flat = pa.array(np.ascontiguousarray(arr).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, math.prod(feature.shape))


def _from_column(column: pa.ChunkedArray, feature: Feature) -> np.ndarray:
    arr = column.combine_chunks()
    if isinstance(arr, pa.FixedSizeListArray):
        arr = arr.flatten()
    values = arr.to_numpy(zero_copy_only=False)
    return values.astype(feature.dtype, copy=False).reshape(len(column), *feature.shape)


class LeRobotWriter:
    """Writes episodes one parquet file at a time; ``finalize()`` writes the meta files.

    Args:
        root: dataset directory (created).
        features: per-frame features, e.g. ``{"observation.image": Feature(dtype="uint8",
            shape=(64, 64, 3)), "action": Feature(dtype="float32", shape=(2,))}``. Names must not
            clash with the bookkeeping columns (``INDEX_COLUMNS``).
        fps: frames per second of the recording (``timestamp = frame_index / fps``).
        robot_type: stored in ``info.json``.
        chunks_size: episodes per ``data/chunk-NNN`` directory.
        overwrite: delete an existing ``root`` instead of raising FileExistsError.
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
        if self.root.exists() and any(self.root.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{self.root} exists and is not empty")
            shutil.rmtree(self.root)
        self.features = dict(features)
        self.fps, self.robot_type, self.chunks_size = fps, robot_type, chunks_size
        self.episodes: list[EpisodeInfo] = []
        self._task_index: dict[str, int] = {}
        self._num_frames = 0
        self._finalized = False

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
        table = {key: _to_column(cols[key], f) for key, f in self.features.items()}
        table["timestamp"] = pa.array((frame_index / self.fps).astype(np.float32))
        table["frame_index"] = pa.array(frame_index)
        table["episode_index"] = pa.array(np.full(length, index, np.int64))
        table["index"] = pa.array(frame_index + self._num_frames)
        table["task_index"] = pa.array(np.full(length, task_index, np.int64))
        path = self.root / DATA_PATH.format(
            episode_chunk=index // self.chunks_size, episode_index=index
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(table), path, compression="zstd")
        self.episodes.append(EpisodeInfo(episode_index=index, tasks=(task,), length=length))
        self._num_frames += length
        return index

    def finalize(self) -> None:
        """Write ``meta/info.json``, ``meta/episodes.jsonl`` and ``meta/tasks.jsonl``."""
        meta = self.root / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        features = {k: f.to_json() for k, f in self.features.items()}
        for name, dtype in INDEX_COLUMNS.items():
            features[name] = {"dtype": dtype, "shape": [1], "names": None}
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
        lines = [
            json.dumps(
                {"episode_index": e.episode_index, "tasks": list(e.tasks), "length": e.length}
            )
            for e in self.episodes
        ]
        _write_lines(meta / "episodes.jsonl", lines)
        tasks = [json.dumps({"task_index": i, "task": t}) for t, i in self._task_index.items()]
        _write_lines(meta / "tasks.jsonl", tasks)
        self._finalized = True

    def __enter__(self) -> LeRobotWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None and not self._finalized:
            self.finalize()


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class LeRobotDataset:
    """Reads a dataset written by :class:`LeRobotWriter` (or any array-only LeRobot v2 dataset).

    ``dataset[i]`` is global frame ``i``: ``{feature: np.ndarray of feature.shape}`` for the
    declared features, the bookkeeping columns as numpy scalars, and ``"task"`` (the instruction
    string). Episodes are read whole and the last ``cache_episodes`` are kept in memory.

    Args:
        root: dataset directory.
        cache_episodes: how many decoded episodes to keep.
    """

    def __init__(self, root: str | Path, *, cache_episodes: int = 8) -> None:
        self.root = Path(root)
        self.info: dict[str, Any] = json.loads((self.root / "meta" / "info.json").read_text())
        all_features = {k: Feature.from_json(v) for k, v in self.info["features"].items()}
        self.features = {k: f for k, f in all_features.items() if k not in INDEX_COLUMNS}
        self.fps: int = self.info["fps"]
        tasks = _read_jsonl(self.root / "meta" / "tasks.jsonl")
        self.tasks = [t["task"] for t in sorted(tasks, key=lambda t: t["task_index"])]
        self.episodes = [
            EpisodeInfo(
                episode_index=e["episode_index"], tasks=tuple(e["tasks"]), length=e["length"]
            )
            for e in _read_jsonl(self.root / "meta" / "episodes.jsonl")
        ]
        lengths = np.array([e.length for e in self.episodes], np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)])
        self._cache: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._cache_size = max(cache_episodes, 1)

    def __len__(self) -> int:
        """Total number of frames."""
        return int(self._starts[-1])

    def episode_path(self, episode_index: int) -> Path:
        chunk = episode_index // self.info["chunks_size"]
        return self.root / self.info["data_path"].format(
            episode_chunk=chunk, episode_index=episode_index
        )

    def episode(self, episode_index: int) -> dict[str, np.ndarray]:
        """All frames of one episode: ``{feature: array[T, *shape]}``, bookkeeping as ``[T]``."""
        cached = self._cache.get(episode_index)
        if cached is not None:
            self._cache.move_to_end(episode_index)
            return cached
        table = pq.read_table(self.episode_path(episode_index))
        missing = set(self.features) - set(table.column_names)
        if missing:
            raise KeyError(f"episode {episode_index} lacks columns {sorted(missing)}")
        out = {k: _from_column(table.column(k), f) for k, f in self.features.items()}
        for name, dtype in INDEX_COLUMNS.items():
            out[name] = table.column(name).to_numpy().astype(dtype, copy=False)
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
        item["task"] = self.tasks[int(item["task_index"])]
        return item


def to_policy_obs(sample: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The wire observation of a sample: ``observation.<key>`` entries renamed to ``<key>``."""
    prefix = "observation."
    return {k[len(prefix) :]: np.asarray(v) for k, v in sample.items() if k.startswith(prefix)}
