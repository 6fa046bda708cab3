"""Demonstration datasets in the LeRobot on-disk layout: the reader, and the names to import.

:class:`LeRobotDataset` reads LeRobot's v2.0, v2.1 and v3.0 datasets: those LeRobot writes
and those :class:`LeRobotWriter` (:mod:`sft.lerobot_writer`) writes, v3.0 by default. v2.x holds
one ``data/chunk-NNN/episode_NNNNNN.parquet`` per episode with ``meta/episodes.jsonl`` and
``meta/tasks.jsonl``; v3.0 holds several episodes per ``data/chunk-NNN/file-NNN.parquet``,
episodes in ``meta/episodes/`` (which file, which global frames) and tasks in
``meta/tasks.parquet``. Camera images are ``dtype: image`` features, PNG bytes in the parquet
files; video features are not supported. Any dataset that cannot be read as declared raises
:class:`DatasetError` naming the file and the field.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sft.lerobot_format import IMAGE, IMAGE_NAMES, DatasetError, Feature, from_column
from sft.lerobot_meta import INDEX_COLUMNS, EpisodeInfo, read_metadata, read_table
from sft.lerobot_writer import DEFAULT_FORMAT, FORMATS, INDEX_FEATURES, LeRobotWriter

__all__ = [
    "DEFAULT_FORMAT",
    "FORMATS",
    "DatasetError",
    "EpisodeInfo",
    "Feature",
    "LeRobotDataset",
    "LeRobotWriter",
    "image_feature",
    "to_policy_obs",
]


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
