"""LeRobot's v3.0 on-disk layout, the one LeRobot 0.4+ loads without conversion.

::

    root/
      data/chunk-000/file-000.parquet       frames of many episodes, one row group per episode
      meta/info.json                        codebase_version "v3.0", fps, features, totals, paths
      meta/tasks.parquet                    task_index, task (pandas index: LeRobot looks tasks up
                                            by their text)
      meta/episodes/chunk-000/file-000.parquet
                                            one row per episode: episode_index, tasks, length,
                                            data/chunk_index, data/file_index, dataset_from_index,
                                            dataset_to_index (global frames [from, to)),
                                            meta/episodes/chunk_index, meta/episodes/file_index,
                                            stats/<feature>/<stat>
      meta/stats.json                       the episodes' stats aggregated

A data file takes episodes until the next one would take it past ``data_files_size_in_mb`` (an
episode is never split across files); ``chunks_size`` files fill a ``chunk-NNN`` directory. Both
are recorded in ``info.json`` as LeRobot records them. Episodes are written whole, in order, so
LeRobot's reading of ``data/`` file by file in sorted order meets the global frame order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sft.lerobot_meta import EpisodeInfo
from sft.lerobot_stats import Stats, aggregate_stats, stats_to_json

DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
CHUNKS_SIZE = 1000  # files per chunk directory
DATA_FILES_SIZE_IN_MB = 100
VIDEO_FILES_SIZE_IN_MB = 200  # recorded for LeRobot; this writer stores no videos


class V30Layout:
    """Stores episodes in LeRobot's v3.0 layout (see the module docstring).

    Args:
        root: dataset directory.
        chunks_size: data files per ``chunk-NNN`` directory.
        data_files_size_in_mb: a data file is closed before an episode would take it past this.
    """

    version = "v3.0"

    def __init__(self, root: Path, *, chunks_size: int, data_files_size_in_mb: float) -> None:
        if chunks_size < 1 or not data_files_size_in_mb > 0:
            raise ValueError(
                f"chunks_size ({chunks_size}) and data_files_size_in_mb "
                f"({data_files_size_in_mb}) must be positive"
            )
        self.root = root
        self.chunks_size, self.data_files_size_in_mb = chunks_size, data_files_size_in_mb
        self._chunk = self._file = 0
        self._writer: pq.ParquetWriter | None = None
        self._frames_in_file = 0
        self._num_frames = 0
        self._rows: list[dict[str, Any]] = []
        self._stats: list[Stats] = []

    def _path(self) -> Path:
        return self.root / DATA_PATH.format(chunk_index=self._chunk, file_index=self._file)

    def _file_is_full(self, length: int) -> bool:
        """Would ``length`` more frames take the open file past the size limit?"""
        size = self._path().stat().st_size / 2**20  # row groups are on disk once written
        per_frame = size / max(self._frames_in_file, 1)
        return size + per_frame * length >= self.data_files_size_in_mb

    def _next_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer, self._frames_in_file = None, 0
        self._file += 1
        if self._file == self.chunks_size:
            self._chunk, self._file = self._chunk + 1, 0

    def write_episode(self, table: pa.Table, episode: EpisodeInfo, stats: Stats) -> None:
        """Append one episode's frames (one row group) and keep its metadata row."""
        if self._writer is not None and self._file_is_full(table.num_rows):
            self._next_file()
        if self._writer is None:
            self._path().parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self._path(), table.schema, compression="zstd")
        self._writer.write_table(table)
        start = self._num_frames
        self._num_frames += table.num_rows
        self._frames_in_file += table.num_rows
        self._rows.append(
            {
                **episode.to_json(),
                "data/chunk_index": self._chunk,
                "data/file_index": self._file,
                "dataset_from_index": start,
                "dataset_to_index": self._num_frames,
                "meta/episodes/chunk_index": 0,
                "meta/episodes/file_index": 0,
                **{
                    f"stats/{key}/{name}": value
                    for key, entry in stats_to_json(stats).items()
                    for name, value in entry.items()
                },
            }
        )
        self._stats.append(stats)

    def finalize(self, tasks: list[str]) -> dict[str, Any]:
        """Close the data file, write the ``meta/`` parquet files and ``stats.json``; returns the
        layout's ``info.json`` entries."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        meta = self.root / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        pq.write_table(_tasks_table(tasks), meta / "tasks.parquet")
        if self._rows:  # LeRobot reads no episode files when total_episodes is 0
            path = self.root / EPISODES_PATH.format(chunk_index=0, file_index=0)
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(self._rows), path)
        stats = stats_to_json(aggregate_stats(self._stats))
        (meta / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        return {
            "chunks_size": self.chunks_size,
            "data_files_size_in_mb": self.data_files_size_in_mb,
            "video_files_size_in_mb": VIDEO_FILES_SIZE_IN_MB,
            "data_path": DATA_PATH,
        }


def _tasks_table(tasks: list[str]) -> pa.Table:
    """``task_index`` and ``task``, with the pandas metadata that makes ``task`` the index of
    the frame ``pandas.read_parquet`` returns: LeRobot reads a task's text as its row's index."""
    table = pa.table(
        {
            "task_index": pa.array(range(len(tasks)), pa.int64()),
            "task": pa.array(tasks, pa.string()),
        }
    )
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [
            {
                "name": None,
                "field_name": None,
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": {"encoding": "UTF-8"},
            }
        ],
        "columns": [
            {"name": n, "field_name": n, "pandas_type": p, "numpy_type": t, "metadata": None}
            for n, p, t in (("task_index", "int64", "int64"), ("task", "unicode", "object"))
        ],
        "attributes": {},
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.3",
    }
    return table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()})
