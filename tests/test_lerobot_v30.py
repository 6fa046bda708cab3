"""The LeRobot v3.0 writer: LeRobot's layout and metadata, and frames that read back unchanged
(next to the v2.1 writer, which tests/test_lerobot.py covers)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sft.lerobot import DEFAULT_FORMAT, FORMATS, DatasetError, LeRobotDataset, LeRobotWriter
from sft.lerobot_stats import QUANTILES
from tests.test_lerobot import FEATURES, _episode

# the fields of LeRobot 0.6's DatasetInfo (meta/info.json) for a dataset without videos
INFO_KEYS = {
    "codebase_version",
    "robot_type",
    "total_episodes",
    "total_frames",
    "total_tasks",
    "chunks_size",
    "data_files_size_in_mb",
    "video_files_size_in_mb",
    "fps",
    "splits",
    "data_path",
    "video_path",
    "features",
}
EPISODE_COLUMNS = {
    "episode_index",
    "tasks",
    "length",
    "data/chunk_index",
    "data/file_index",
    "dataset_from_index",
    "dataset_to_index",
    "meta/episodes/chunk_index",
    "meta/episodes/file_index",
}
STATS = ("min", "max", "mean", "std", "count", *QUANTILES)
TASKS = ["push red", "push blue", "push red", "push red"]


def _write(root: Path, episodes: list[dict[str, np.ndarray]], **kwargs) -> None:
    with LeRobotWriter(root, FEATURES, fps=5, **kwargs) as writer:
        for episode, task in zip(episodes, TASKS, strict=False):
            writer.add_episode(episode, task)


def test_v30_layout_and_metadata(tmp_path: Path) -> None:
    rng = np.random.default_rng(20)
    episodes = [_episode(rng, n) for n in (4, 7, 3, 5)]
    _write(tmp_path, episodes)
    assert DEFAULT_FORMAT == "v3.0"
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == [
        "data/chunk-000/file-000.parquet",  # all four episodes in one data file
        "meta/episodes/chunk-000/file-000.parquet",
        "meta/info.json",
        "meta/stats.json",
        "meta/tasks.parquet",
    ]
    info = json.loads((tmp_path / "meta" / "info.json").read_text())
    assert set(info) == INFO_KEYS
    assert info["codebase_version"] == "v3.0" and info["fps"] == 5 and info["video_path"] is None
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert (info["chunks_size"], info["data_files_size_in_mb"]) == (1000, 100)
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (4, 19, 2)
    assert info["splits"] == {"train": "0:4"}
    assert {"timestamp", "frame_index", "episode_index", "index", "task_index"} <= set(
        info["features"]
    )

    rows = pq.read_table(tmp_path / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    stats_columns = {f"stats/{k}/{s}" for k in info["features"] for s in STATS}
    assert set(rows.column_names) == EPISODE_COLUMNS | stats_columns
    rows = rows.to_pylist()
    assert [r["tasks"] for r in rows] == [[t] for t in TASKS]
    assert [r["length"] for r in rows] == [4, 7, 3, 5]
    ends = np.cumsum([0, 4, 7, 3, 5]).tolist()
    assert [(r["dataset_from_index"], r["dataset_to_index"]) for r in rows] == list(
        zip(ends[:-1], ends[1:], strict=True)
    )
    image_q50 = np.array(rows[1]["stats/observation.image/q50"])
    assert image_q50.shape == (3, 1, 1)  # per channel, in [0, 1]
    np.testing.assert_allclose(
        image_q50.ravel(),
        np.quantile(episodes[1]["observation.image"].reshape(-1, 3) / 255.0, 0.5, axis=0),
    )
    np.testing.assert_allclose(
        rows[2]["stats/action/q99"], np.quantile(episodes[2]["action"], 0.99, axis=0), rtol=1e-6
    )

    stats = json.loads((tmp_path / "meta" / "stats.json").read_text())
    actions = np.concatenate([e["action"] for e in episodes]).astype(np.float64)
    assert stats["action"]["count"] == [19]
    np.testing.assert_allclose(stats["action"]["mean"], actions.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(stats["action"]["std"], actions.std(axis=0), rtol=1e-6)
    np.testing.assert_allclose(stats["action"]["max"], actions.max(axis=0), rtol=1e-6)
    assert set(stats["observation.image"]) == set(STATS)

    tasks = pq.read_table(tmp_path / "meta" / "tasks.parquet")
    assert tasks.to_pylist() == [
        {"task_index": 0, "task": "push red"},
        {"task_index": 1, "task": "push blue"},
    ]
    pandas_meta = json.loads(tasks.schema.metadata[b"pandas"])
    assert pandas_meta["index_columns"] == ["task"]  # LeRobot looks a task up by its text

    data = pq.ParquetFile(tmp_path / "data" / "chunk-000" / "file-000.parquet")
    assert data.metadata.num_row_groups == 4  # one per episode, as LeRobot writes them
    hf = json.loads(data.schema_arrow.metadata[b"huggingface"])["info"]["features"]
    assert hf["observation.image"] == {"_type": "Image"}
    index = data.read(columns=["index", "episode_index"]).to_pydict()
    assert index["index"] == list(range(19))
    assert index["episode_index"] == [e for e, n in enumerate((4, 7, 3, 5)) for _ in range(n)]


@pytest.mark.parametrize("version", FORMATS)
def test_round_trip_gives_identical_frames(tmp_path: Path, version: str) -> None:
    rng = np.random.default_rng(21)
    episodes = [_episode(rng, n) for n in (4, 7, 3)]
    _write(tmp_path, episodes, codebase_version=version)
    ds = LeRobotDataset(tmp_path)
    assert ds.version == version and ds.features == FEATURES and len(ds) == 14
    assert ds.tasks == ["push red", "push blue"]
    index = 0
    for ep, (task, data) in enumerate(zip(TASKS, episodes, strict=False)):
        whole = ds.episode(ep)
        for key, value in data.items():
            np.testing.assert_array_equal(whole[key], value)
            assert whole[key].dtype == value.dtype
        for t in range(len(data["action"])):
            item = ds[index]
            assert item["task"] == task and item["index"] == index
            assert (item["episode_index"], item["frame_index"]) == (ep, t)
            assert item["timestamp"] == pytest.approx(t / 5)
            index += 1


def test_several_episodes_per_file_read_back_each_episode(tmp_path: Path) -> None:
    """A size limit of 10 kB closes files every few episodes, two files fill a chunk: each
    episode row points at the file that holds its frames, and each reads back whole."""
    rng = np.random.default_rng(22)
    episodes = [_episode(rng, 3 + i % 4) for i in range(14)]
    with LeRobotWriter(tmp_path, FEATURES, chunks_size=2, data_files_size_in_mb=0.01) as writer:
        for i, episode in enumerate(episodes):
            writer.add_episode(episode, f"task {i % 3}")
    info = json.loads((tmp_path / "meta" / "info.json").read_text())
    assert (info["chunks_size"], info["data_files_size_in_mb"]) == (2, 0.01)
    rows = pq.read_table(tmp_path / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    holders: dict[tuple[int, int], list[int]] = {}
    for row in rows.to_pylist():
        key = (row["data/chunk_index"], row["data/file_index"])
        holders.setdefault(key, []).append(row["episode_index"])
    assert len(holders) >= 3 and (1, 0) in holders  # the third file opens chunk-001
    assert all(file_index < 2 for _, file_index in holders)
    assert max(len(members) for members in holders.values()) >= 2
    for (chunk, file), members in holders.items():
        path = tmp_path / info["data_path"].format(chunk_index=chunk, file_index=file)
        in_file = pq.read_table(path, columns=["episode_index"]).column(0).to_pylist()
        assert sorted(set(in_file)) == members
    ds = LeRobotDataset(tmp_path, cache_episodes=1)
    assert len(ds) == sum(len(e["action"]) for e in episodes)
    for i in [13, 0, 7, 8, 2]:  # out of order, across files and chunks
        whole = ds.episode(i)
        for key, value in episodes[i].items():
            np.testing.assert_array_equal(whole[key], value)
        assert ds.tasks[int(whole["task_index"][0])] == f"task {i % 3}"


def test_v30_frame_range_must_match_length(tmp_path: Path) -> None:
    _write(tmp_path, [_episode(np.random.default_rng(23), n) for n in (3, 2)])
    path = tmp_path / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(path)
    column = table.column_names.index("dataset_to_index")
    pq.write_table(table.set_column(column, "dataset_to_index", pa.array([3, 9])), path)
    with pytest.raises(
        DatasetError, match=r"episode 1: dataset_from_index 3 to dataset_to_index 9"
    ):
        LeRobotDataset(tmp_path)


def test_writer_and_command_offer_the_same_formats(tmp_path: Path) -> None:
    from rlvla3.cli import build_parser

    args = build_parser().parse_args(["demos", "--out", str(tmp_path)])
    assert args.format == DEFAULT_FORMAT
    (action,) = [a for a in build_parser()._subparsers._group_actions]  # noqa: SLF001
    demos = action.choices["demos"]
    (fmt,) = [a for a in demos._actions if a.dest == "format"]  # noqa: SLF001
    assert tuple(fmt.choices) == FORMATS
    with pytest.raises(ValueError, match="codebase_version 'v2.0'"):
        LeRobotWriter(tmp_path / "x", FEATURES, codebase_version="v2.0")


def test_demos_command_writes_the_format_asked_for(tmp_path: Path) -> None:
    from rlvla3.cli import main

    for version in FORMATS:
        root = tmp_path / version
        argv = ["demos", "--env", "rlvla3/TableTopEasy-v0", "--episodes", "2", "--out", str(root)]
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--obs-mode", "state", "--format", version])
        assert exit_.value.code == 0
        ds = LeRobotDataset(root)
        assert ds.version == version and len(ds.episodes) == 2
