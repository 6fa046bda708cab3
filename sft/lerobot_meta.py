"""A LeRobot dataset's metadata (``meta/``), read and checked before any frame is.

Every field the reader relies on is checked for type and range, and every problem raises
:class:`DatasetError` naming the file (and line or episode) and the field: a dataset that does
not say what it holds must fail here, not as a KeyError deep in training or, worse, as frames of
the wrong episode.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sft.lerobot_format import DatasetError, Feature

VERSIONS = ("v2.0", "v2.1", "v3.0")
INDEX_COLUMNS = {
    "timestamp": "float32",
    "frame_index": "int64",
    "episode_index": "int64",
    "index": "int64",
    "task_index": "int64",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeInfo:
    """One episode: index, task strings, length in frames."""

    episode_index: int
    tasks: tuple[str, ...]
    length: int

    def to_json(self) -> dict[str, Any]:
        return {
            "episode_index": self.episode_index,
            "tasks": list(self.tasks),
            "length": self.length,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Metadata:
    """What ``meta/`` says: ``episodes`` sorted by index, ``tasks`` by task index, and (v3.0)
    the data file of each episode."""

    info: dict[str, Any]
    version: str
    features: dict[str, Feature]  # the declared features, bookkeeping columns left out
    fps: float
    tasks: dict[int, str]
    episodes: list[EpisodeInfo]
    episode_files: dict[int, Path]  # v3.0 only: episode index -> its data file

    def data_file(self, root: Path, episode_index: int) -> Path:
        """The parquet file holding ``episode_index``'s frames."""
        if self.version == "v3.0":
            try:
                return self.episode_files[episode_index]
            except KeyError:
                raise DatasetError(f"{root}: no episode {episode_index} in meta/episodes") from None
        chunk = episode_index // int(self.info.get("chunks_size", 1000))
        return root / self.info["data_path"].format(
            episode_chunk=chunk, episode_index=episode_index
        )


def read_metadata(root: Path) -> Metadata:
    """Read and check ``root/meta``."""
    info_path = root / "meta" / "info.json"
    info = _as_mapping(_read_json(info_path), str(info_path))
    version = str(info.get("codebase_version", "v2.0"))
    if version not in VERSIONS:
        raise DatasetError(
            f"{info_path}: codebase_version {version!r} is not supported ({', '.join(VERSIONS)})"
        )
    features = {}
    for key, spec in _as_mapping(
        _field(info, "features", str(info_path)), f"{info_path}: features"
    ).items():
        try:
            features[key] = Feature.from_json(spec)
        except DatasetError as e:
            raise DatasetError(f"{info_path}: features.{key}: {e}") from None
    fps = _field(info, "fps", str(info_path))
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise DatasetError(f"{info_path}: fps must be a positive number, got {fps!r}")
    _check_data_path(info, version, info_path)
    declared = {k: f for k, f in features.items() if k not in INDEX_COLUMNS}
    if version == "v3.0":
        tasks = _v3_tasks(root / "meta" / "tasks.parquet")
        episodes, files = (
            _v3_episodes(root, info["data_path"]) if info.get("total_episodes") != 0 else ([], {})
        )
    else:
        tasks = _v2_tasks(root / "meta" / "tasks.jsonl")
        episodes, files = _v2_episodes(root / "meta" / "episodes.jsonl"), {}
    return Metadata(
        info=info,
        version=version,
        features=declared,
        fps=float(fps),
        tasks=tasks,
        episodes=episodes,
        episode_files=files,
    )


def _check_data_path(info: Mapping[str, Any], version: str, where: Path) -> None:
    template = _field(info, "data_path", str(where))
    chunks = info.get("chunks_size", 1000)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise DatasetError(f"{where}: chunks_size must be a positive integer, got {chunks!r}")
    sample = (
        {"chunk_index": 0, "file_index": 0}
        if version == "v3.0"
        else {"episode_chunk": 0, "episode_index": 0}
    )
    try:
        if not isinstance(template, str):
            raise TypeError("not a string")
        template.format(**sample)
    except (KeyError, IndexError, ValueError, TypeError) as e:
        raise DatasetError(
            f"{where}: data_path {template!r} is not a {version} path template "
            f"with {', '.join('{' + k + '}' for k in sample)} ({e})"
        ) from None


def _v2_tasks(path: Path) -> dict[int, str]:
    tasks: dict[int, str] = {}
    for number, row in enumerate(_read_jsonl(path), 1):
        where = f"{path}:{number}"
        index = _int(row, "task_index", where, minimum=0)
        text = _field(row, "task", where)
        if not isinstance(text, str):
            raise DatasetError(f"{where}: task must be a string, got {text!r}")
        if index in tasks:
            raise DatasetError(f"{where}: task_index {index} appears twice")
        tasks[index] = text
    return tasks


def _v2_episodes(path: Path) -> list[EpisodeInfo]:
    rows = [(f"{path}:{number}", row) for number, row in enumerate(_read_jsonl(path), 1)]
    return _episodes(rows)


def _v3_tasks(path: Path) -> dict[int, str]:
    table = read_table(path)
    # written from a pandas frame indexed by the task string: the index is a column too
    text_columns = [n for n in table.column_names if n != "task_index"]
    if "task_index" not in table.column_names or not text_columns:
        raise DatasetError(f"{path}: expected a task string column and 'task_index'")
    tasks: dict[int, str] = {}
    for row in pa.table(
        {"task_index": table.column("task_index"), "task": table.column(text_columns[0])}
    ).to_pylist():
        index = _int(row, "task_index", str(path), minimum=0)
        if not isinstance(row["task"], str) or index in tasks:
            raise DatasetError(f"{path}: task_index {index}: a missing or repeated task")
        tasks[index] = row["task"]
    return tasks


def _v3_episodes(root: Path, template: str) -> tuple[list[EpisodeInfo], dict[int, Path]]:
    paths = sorted((root / "meta" / "episodes").glob("*/*.parquet"))
    if not paths:
        raise DatasetError(f"{root / 'meta' / 'episodes'}: no episode parquet files")
    rows, files = [], {}
    for path in paths:
        for row in read_table(path).to_pylist():
            where = f"{path}: episode {row.get('episode_index')}"
            rows.append((where, row))
            _check_frame_range(row, where)
            chunk = _int(row, "data/chunk_index", where, minimum=0)
            file = _int(row, "data/file_index", where, minimum=0)
            files[_int(row, "episode_index", where, minimum=0)] = root / template.format(
                chunk_index=chunk, file_index=file
            )
    return _episodes(rows), files


def _check_frame_range(row: Mapping[str, Any], where: str) -> None:
    """``dataset_from_index``/``dataset_to_index`` (global frames [from, to)), when present,
    span ``length`` frames."""
    if "dataset_from_index" not in row or "dataset_to_index" not in row:
        return
    start = _int(row, "dataset_from_index", where, minimum=0)
    stop = _int(row, "dataset_to_index", where, minimum=0)
    if stop - start != _int(row, "length", where, minimum=1):
        raise DatasetError(
            f"{where}: dataset_from_index {start} to dataset_to_index {stop} "
            f"is not its length {row['length']}"
        )


def _episodes(rows: list[tuple[str, Any]]) -> list[EpisodeInfo]:
    """Checked episodes, sorted by index (so global frame 0 is episode 0's first frame)."""
    episodes: dict[int, EpisodeInfo] = {}
    for where, row in rows:
        index = _int(row, "episode_index", where, minimum=0)
        tasks = _field(row, "tasks", where)
        if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
            raise DatasetError(f"{where}: tasks must be a list of strings, got {tasks!r}")
        episode = EpisodeInfo(
            episode_index=index, tasks=tuple(tasks), length=_int(row, "length", where, minimum=1)
        )
        if index in episodes:
            raise DatasetError(f"{where}: episode_index {index} appears twice")
        episodes[index] = episode
    return [episodes[i] for i in sorted(episodes)]


def _int(row: Any, key: str, where: str, *, minimum: int) -> int:
    value = _field(row, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2**53:
        raise DatasetError(
            f"{where}: {key} must be an integer from {minimum} to 2**53, got {value!r}"
        )
    return value


def _field(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, Mapping):
        raise DatasetError(f"{where}: expected a JSON object, got {obj!r}")
    try:
        return obj[key]
    except KeyError:
        raise DatasetError(f"{where}: missing field {key!r}") from None


def _as_mapping(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, Mapping):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return dict(obj)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not JSON ({e})") from None


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{number}: not JSON ({e})") from None
    return rows


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_table(path: Path) -> pa.Table:
    """A parquet file; DatasetError naming it if it cannot be read."""
    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"{path}: cannot read parquet ({e})") from None
