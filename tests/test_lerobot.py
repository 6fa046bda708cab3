"""LeRobot dataset layout: write/read round trip, meta files, expert demo generation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sft.demos import generate_demos, rollout_episode
from sft.lerobot import (
    DatasetError,
    Feature,
    LeRobotDataset,
    LeRobotWriter,
    image_feature,
    to_policy_obs,
)
from sft.lerobot_format import IMAGE_STRUCT
from sim.envs import make_env
from sim.experts import TableTopExpert, TableTopExpertConfig

V21 = "v2.1"  # the layout older LeRobot reads; the writer's default is v3.0
FEATURES = {
    "observation.image": image_feature((8, 6, 3)),
    "observation.state": Feature(dtype="float32", shape=(5,), names=("a", "b", "c", "d", "e")),
    "observation.instruction": Feature(dtype="int32", shape=(12,)),
    "action": Feature(dtype="float32", shape=(2,)),
    "next.reward": Feature(dtype="float32", shape=(1,)),
    "next.done": Feature(dtype="bool", shape=(1,)),
}


def _episode(rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
    done = np.zeros((length, 1), bool)
    done[-1] = True
    return {
        "observation.image": rng.integers(0, 256, (length, 8, 6, 3), dtype=np.uint8),
        "observation.state": rng.normal(size=(length, 5)).astype(np.float32),
        "observation.instruction": rng.integers(0, 257, (length, 12), dtype=np.int32),
        "action": rng.uniform(-1, 1, (length, 2)).astype(np.float32),
        "next.reward": rng.normal(size=(length, 1)).astype(np.float32),
        "next.done": done,
    }


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_v21_round_trip_and_meta(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    episodes = [_episode(rng, n) for n in (4, 7, 3)]
    tasks = ["push red", "push blue", "push red"]
    with LeRobotWriter(tmp_path / "ds", FEATURES, fps=5, codebase_version=V21) as writer:
        writer.add_episode(episodes[0], tasks[0])  # dict of [T, ...] arrays
        frames = [{k: v[t] for k, v in episodes[1].items()} for t in range(7)]
        writer.add_episode(frames, tasks[1])  # list of per-frame dicts
        writer.add_episode(episodes[2], tasks[2])
    root = tmp_path / "ds"
    assert (root / "data" / "chunk-000" / "episode_000002.parquet").is_file()
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v2.1" and info["fps"] == 5
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 14, 2)
    assert info["features"]["observation.image"] == {
        "dtype": "image",
        "shape": [8, 6, 3],
        "names": ["height", "width", "channel"],
    }
    assert info["features"]["observation.state"]["names"] == ["a", "b", "c", "d", "e"]
    assert info["features"]["episode_index"]["dtype"] == "int64"
    assert _read_jsonl(root / "meta" / "episodes.jsonl") == [
        {"episode_index": i, "tasks": [t], "length": len(e["action"])}
        for i, (t, e) in enumerate(zip(tasks, episodes, strict=True))
    ]
    assert _read_jsonl(root / "meta" / "tasks.jsonl") == [
        {"task_index": 0, "task": "push red"},
        {"task_index": 1, "task": "push blue"},
    ]
    columns = pq.read_table(root / "data" / "chunk-000" / "episode_000001.parquet").column_names
    assert {"timestamp", "frame_index", "episode_index", "index", "task_index"} <= set(columns)

    ds = LeRobotDataset(root)
    assert len(ds) == 14 and ds.tasks == ["push red", "push blue"]
    assert [e.length for e in ds.episodes] == [4, 7, 3]
    assert ds.features == FEATURES
    index = 0
    for ep, (task, data) in enumerate(zip(tasks, episodes, strict=True)):
        whole = ds.episode(ep)
        for key in FEATURES:
            np.testing.assert_array_equal(whole[key], data[key])
            assert whole[key].dtype == data[key].dtype
        for t in range(len(data["action"])):
            item = ds[index]
            for key in FEATURES:
                np.testing.assert_array_equal(item[key], data[key][t])
            assert item["task"] == task and item["index"] == index
            assert (item["episode_index"], item["frame_index"]) == (ep, t)
            assert item["timestamp"] == pytest.approx(t / 5)
            index += 1
    np.testing.assert_array_equal(ds[-1]["action"], episodes[2]["action"][-1])
    with pytest.raises(IndexError):
        ds[14]
    obs = to_policy_obs(ds[0])
    assert set(obs) == {"image", "state", "instruction"}


def test_v21_chunks_hold_chunks_size_episodes(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    eps = [_episode(rng, 2 + i) for i in range(3)]
    with LeRobotWriter(tmp_path, FEATURES, chunks_size=2, codebase_version=V21) as writer:
        for i, ep in enumerate(eps):
            writer.add_episode(ep, f"task {i}")
    assert (tmp_path / "data" / "chunk-001" / "episode_000002.parquet").is_file()
    ds = LeRobotDataset(tmp_path, cache_episodes=1)
    for i, ep in enumerate(eps):
        np.testing.assert_array_equal(ds.episode(i)["observation.image"], ep["observation.image"])
    assert ds[len(ds) - 1]["task"] == "task 2"


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from(["float32", "float64", "int32", "int64", "uint8", "bool"]),
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple),
    length=st.integers(1, 5),
)
def test_round_trip_any_dtype_and_shape(
    tmp_path_factory: pytest.TempPathFactory, dtype: str, shape: tuple[int, ...], length: int
) -> None:
    root = tmp_path_factory.mktemp("prop")
    data = np.random.default_rng(length).integers(0, 2, (length, *shape)).astype(dtype)
    with LeRobotWriter(root, {"x": Feature(dtype=dtype, shape=shape)}) as writer:
        writer.add_episode({"x": data}, "task")
    out = LeRobotDataset(root).episode(0)["x"]
    assert out.dtype == data.dtype and out.shape == data.shape
    np.testing.assert_array_equal(out, data)


def test_generate_demos_replays_exactly(tmp_path: Path) -> None:
    stats = generate_demos("rlvla3/TableTop-v0", 3, tmp_path / "demos", seed=10)
    assert stats.num_episodes == 3 and stats.success_rate == 1.0
    ds = LeRobotDataset(tmp_path / "demos")
    assert len(ds) == stats.num_frames == sum(e.length for e in ds.episodes)
    assert ds.fps == 10
    env = make_env("rlvla3/TableTop-v0", seed=0)
    assert set(to_policy_obs(ds[0])) == set(env.observation_space.spaces)
    for ep in range(3):  # replaying the recorded actions reproduces the recorded episode
        data = ds.episode(ep)
        obs, _ = env.reset(seed=10 + ep)
        assert env.instruction == ds.tasks[data["task_index"][0]]
        for t in range(ds.episodes[ep].length):
            for key, value in obs.items():
                np.testing.assert_array_equal(data[f"observation.{key}"][t], value)
            assert np.all(np.abs(data["action"][t]) <= 1.0)
            obs, reward, term, trunc, _ = env.step(data["action"][t])
            assert data["next.reward"][t, 0] == np.float32(reward)
            assert data["next.done"][t, 0] == (term or trunc)
        assert term


def test_generate_demos_state_mode(tmp_path: Path) -> None:
    stats = generate_demos(
        "rlvla3/TableTopEasy-v0", 4, tmp_path, seed=0, expert_noise=0.3, obs_mode="state"
    )
    ds = LeRobotDataset(tmp_path)
    assert set(ds.features) == {"observation.state", "action", "next.reward", "next.done"}
    assert ds.features["observation.state"].shape == (22,)
    assert stats.num_episodes == 4 and len(ds.episodes) == 4
    with pytest.raises(ValueError, match="expert"):
        generate_demos("CartPole-v1", 1, tmp_path / "x", seed=0)


def test_noisy_demos_record_the_clean_expert_action() -> None:
    """DART: the env executes expert + noise, the frame's label is the clean expert action."""
    noisy = TableTopExpertConfig(noise=0.3)
    env = make_env("rlvla3/TableTopEasy-v0", seed=0, obs_mode="state")
    frames, _ = rollout_episode(env, TableTopExpert(noisy, seed=7), seed=3)
    replay, twin = make_env("rlvla3/TableTopEasy-v0", seed=0, obs_mode="state"), TableTopExpert()
    executor = TableTopExpert(noisy, seed=7)  # same seed: the same noise draws
    obs, _ = replay.reset(seed=3)
    differs = False
    for frame in frames:
        np.testing.assert_array_equal(frame["observation.state"], obs["state"])
        state = replay.privileged_state()
        executed, clean = executor.act_with_label(state)
        np.testing.assert_array_equal(frame["action"], clean)
        np.testing.assert_array_equal(twin.act(state), clean)  # the noise-free expert's action
        differs |= not np.array_equal(executed, clean)
        obs, *_ = replay.step(executed)
    assert differs


def test_v21_stats_and_datasets_metadata(tmp_path: Path) -> None:
    """What LeRobot reads besides the frames: per-episode stats (images per channel in [0, 1]),
    and the ``datasets`` feature types in the parquet schema (images as PNG ``Image`` structs)."""
    ep = _episode(np.random.default_rng(3), 5)
    with LeRobotWriter(tmp_path, FEATURES, codebase_version=V21) as writer:
        writer.add_episode(ep, "t")
    (line,) = _read_jsonl(tmp_path / "meta" / "episodes_stats.jsonl")
    assert line["episode_index"] == 0
    image = line["stats"]["observation.image"]
    assert np.array(image["mean"]).shape == (3, 1, 1) and image["count"] == [5]
    np.testing.assert_allclose(
        np.array(image["max"]).ravel(), ep["observation.image"].max(axis=(0, 1, 2)) / 255.0
    )
    action = line["stats"]["action"]
    np.testing.assert_allclose(action["min"], ep["action"].min(axis=0), rtol=1e-6)
    np.testing.assert_allclose(action["std"], ep["action"].std(axis=0), rtol=1e-5)
    assert line["stats"]["frame_index"]["max"] == [4.0]
    table = pq.read_table(tmp_path / "data" / "chunk-000" / "episode_000000.parquet")
    hf = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    assert hf["observation.image"] == {"_type": "Image"}
    assert hf["action"] == {
        "feature": {"dtype": "float32", "_type": "Value"},
        "length": 2,
        "_type": "Sequence",
    }
    assert hf["next.reward"] == {"dtype": "float32", "_type": "Value"}
    png = table.column("observation.image")[0].as_py()
    assert png["bytes"].startswith(b"\x89PNG") and png["path"] is None


def _v3_dataset(root: Path, rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    """A LeRobot v3.0 dataset as LeRobot lays it out: episodes 0 and 1 share data file 0,
    episode 2 is in file 1; a 2-d feature is stored as nested lists (``datasets.Array2D``)."""
    lengths, episodes, meta_rows, start = [3, 4, 2], [], [], 0
    for index, n in enumerate(lengths):
        episodes.append(
            {
                "observation.image": rng.integers(0, 256, (n, 8, 6, 3), dtype=np.uint8),
                "observation.grid": rng.normal(size=(n, 2, 3)).astype(np.float32),
                "action": rng.normal(size=(n, 2)).astype(np.float32),
            }
        )
        meta_rows.append(
            {
                "episode_index": index,
                "tasks": [f"task {index % 2}"],
                "length": n,
                "data/chunk_index": 0,
                "data/file_index": 0 if index < 2 else 1,
                "dataset_from_index": start,
                "dataset_to_index": start + n,
            }
        )
        start += n
    features = {
        "observation.image": image_feature((8, 6, 3)),
        "observation.grid": Feature(dtype="float32", shape=(2, 3)),
        "action": Feature(dtype="float32", shape=(2,)),
    }
    from sft.lerobot import INDEX_FEATURES
    from sft.lerobot_format import to_column

    for file_index, members in [(0, [0, 1]), (1, [2])]:
        cols: dict[str, list] = {}
        for index in members:
            n = lengths[index]
            frame = np.arange(n)
            data = {
                **episodes[index],
                "timestamp": (frame / 10).astype(np.float32),
                "frame_index": frame,
                "episode_index": np.full(n, index),
                "index": frame + sum(lengths[:index]),
                "task_index": np.full(n, index % 2),
            }
            for key, feature in {**features, **INDEX_FEATURES}.items():
                column = to_column(data[key].astype(feature.numpy_dtype), feature)
                cols.setdefault(key, []).extend(column.to_pylist())
        path = root / "data" / "chunk-000" / f"file-{file_index:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(cols), path)
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    pq.write_table(
        pa.Table.from_pylist(meta_rows),
        root / "meta" / "episodes" / "chunk-000" / "file-000.parquet",
    )
    # pandas writes the task strings as the frame's index, a column named after it
    pq.write_table(
        pa.table({"task_index": [1, 0], "task": ["task 1", "task 0"]}),
        root / "meta" / "tasks.parquet",
    )
    info = {
        "codebase_version": "v3.0",
        "fps": 10,
        "chunks_size": 1000,
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "features": {k: f.to_json() for k, f in {**features, **INDEX_FEATURES}.items()},
    }
    (root / "meta" / "info.json").write_text(json.dumps(info))
    return episodes


def test_reads_lerobot_v3_layout(tmp_path: Path) -> None:
    episodes = _v3_dataset(tmp_path, np.random.default_rng(4))
    ds = LeRobotDataset(tmp_path)
    assert ds.version == "v3.0" and ds.tasks == ["task 0", "task 1"] and len(ds) == 9
    for index, data in enumerate(episodes):
        whole = ds.episode(index)
        for key, value in data.items():
            np.testing.assert_array_equal(whole[key], value)
    assert ds[7]["task"] == "task 0" and ds[7]["episode_index"] == 2


def test_reader_errors_name_the_file_and_field(tmp_path: Path) -> None:
    with LeRobotWriter(tmp_path / "ds", FEATURES, codebase_version=V21) as writer:
        writer.add_episode(_episode(np.random.default_rng(5), 3), "t")
    meta = tmp_path / "ds" / "meta"
    info = json.loads((meta / "info.json").read_text())
    episodes = (meta / "episodes.jsonl").read_text()

    def expect(match: str) -> None:
        with pytest.raises(DatasetError, match=match):
            LeRobotDataset(tmp_path / "ds").episode(0)

    (meta / "episodes.jsonl").write_text(episodes.replace('"length": 3', '"length": 99'))
    expect(r"episode_000000.parquet: episode 0 has 3 frames, the metadata says length 99")
    (meta / "episodes.jsonl").write_text(episodes.replace('"length": 3', '"size": 3'))
    expect(r"episodes.jsonl:1: missing field 'length'")
    (meta / "episodes.jsonl").write_text(episodes)
    for change, match in [
        ({"codebase_version": "v4.0"}, r"info.json: codebase_version 'v4.0' is not supported"),
        (
            {"features": {**info["features"], "action": {"dtype": "float32", "shape": [5]}}},
            r"action: rows of shape \[2\], declared \[5\]",
        ),
        (
            {"features": {**info["features"], "action": {"dtype": "video", "shape": [2]}}},
            r"action: video features .* are not supported",
        ),
        (
            {"features": {**info["features"], "action": {"dtype": "complex7", "shape": [2]}}},
            r"features.action: unknown dtype 'complex7'",
        ),
    ]:
        (meta / "info.json").write_text(json.dumps({**info, **change}))
        expect(match)
    del info["features"]
    (meta / "info.json").write_text(json.dumps(info))
    expect(r"info.json: missing field 'features'")


def test_demo_set_names_what_it_cannot_train_on(tmp_path: Path) -> None:
    from sft.data import DemoSet

    LeRobotWriter(tmp_path / "empty", FEATURES).finalize()
    with pytest.raises(DatasetError, match="no episodes"):
        DemoSet(tmp_path / "empty", fixed_tokens=4)
    no_action = {k: f for k, f in FEATURES.items() if k != "action"}
    with LeRobotWriter(tmp_path / "no_action", no_action) as writer:
        ep = _episode(np.random.default_rng(6), 2)
        del ep["action"]
        writer.add_episode(ep, "t")
    with pytest.raises(DatasetError, match="no 'action' feature"):
        DemoSet(tmp_path / "no_action", fixed_tokens=4)
    with LeRobotWriter(tmp_path / "ok", FEATURES) as writer:
        writer.add_episode(_episode(np.random.default_rng(7), 3), "t")
    demos = DemoSet(tmp_path / "ok", fixed_tokens=4)
    longest = int(demos.lengths.max())
    demos.check_budget(longest)
    with pytest.raises(ValueError, match=rf"sft.token_budget: {longest - 1} tokens, but frame"):
        demos.check_budget(longest - 1)


def test_demo_stream_packs_whole_frames_from_a_bounded_buffer(tmp_path: Path) -> None:
    """Streaming: every batch fits the budget and holds real (obs, action) pairs of the dataset;
    the buffer never holds more than asked; every frame comes out; a frame too long for the
    budget stops the stream, named."""
    from sft.data import DemoStream

    rng = np.random.default_rng(9)
    episodes = [_episode(rng, n) for n in (5, 9, 3, 7, 6)]
    with LeRobotWriter(tmp_path / "ds", FEATURES) as writer:
        for ep in episodes:
            writer.add_episode(ep, "t")
    by_action = {
        ep["action"][t].tobytes(): (ep, t) for ep in episodes for t in range(len(ep["action"]))
    }
    stream = DemoStream(tmp_path / "ds", fixed_tokens=10, buffer_frames=12, seed=1)
    try:
        assert len(stream) == 30 and stream.capacity == 12
        seen: set[bytes] = set()
        draws = np.random.default_rng(0)
        for _ in range(300):
            batch = stream.packed_batch(100, draws)
            assert 1 <= batch.num_samples and batch.num_tokens <= 100
            assert batch.obs["state"].shape == (batch.num_samples, 5)
            for row, action in enumerate(batch.actions):
                ep, t = by_action[action.tobytes()]  # a real frame, its obs alongside
                np.testing.assert_array_equal(batch.obs["image"][row], ep["observation.image"][t])
                seen.add(action.tobytes())
            assert len(stream._frames) <= stream.capacity
            if len(seen) == 30:
                break
        assert len(seen) == 30
    finally:
        stream.close()
    stream = DemoStream(tmp_path / "ds", fixed_tokens=10, buffer_frames=12)
    try:
        with pytest.raises(ValueError, match="sft.token_budget: 9 tokens, but"):
            stream.check_budget(9)  # every frame needs 10 + its instruction's tokens
            stream.packed_batch(40, np.random.default_rng(0), timeout_s=30)
    finally:
        stream.close()


@pytest.mark.parametrize("name", ["v21_by_lerobot_0.3.3", "v30_by_lerobot_0.4.4"])
def test_reads_datasets_written_by_lerobot(name: str) -> None:
    """Datasets the real LeRobot library wrote (tests/data/lerobot/README.md) read back frame for
    frame: images, actions, tasks, episode boundaries."""
    root = Path(__file__).parent / "data" / "lerobot" / name
    expected = np.load(root / "expected.npz")
    ds = LeRobotDataset(root)
    assert len(ds) == len(expected["action"])
    assert ds.features["observation.image"].dtype == "image"
    for i in range(len(ds)):
        item = ds[i]
        np.testing.assert_array_equal(item["observation.image"], expected["image"][i])
        np.testing.assert_array_equal(item["action"], expected["action"][i])
        assert item["index"] == i and item["task"] == f"task {item['task_index']}"
    starts = np.cumsum([0] + [e.length for e in ds.episodes])[:-1]
    assert [int(ds[int(s)]["frame_index"]) for s in starts] == [0] * len(ds.episodes)


def _rewrite_column(path: Path, name: str, column: pa.Array) -> None:
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.column_names.index(name), name, column), path)


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (
            lambda root, ep: (root / "meta" / "episodes.jsonl").write_text(
                (root / "meta" / "episodes.jsonl")
                .read_text()
                .replace('"episode_index": 1', '"episode_index": 0')
            ),
            r"episodes.jsonl:2: episode_index 0 appears twice",
        ),
        (
            lambda root, ep: (root / "meta" / "episodes.jsonl").write_text(
                (root / "meta" / "episodes.jsonl")
                .read_text()
                .replace('"length": 3', '"length": -2')
            ),
            r"episodes.jsonl:1: length must be an integer from 1",
        ),
        (
            lambda root, ep: (root / "meta" / "tasks.jsonl").write_text(
                '{"task_index": 5, "task": "x"}\n'
            ),
            r"episode 0: task_index \[0\] not in the tasks metadata",
        ),
        (
            lambda root, ep: _rewrite_column(
                ep, "action", pa.array([[0.5, 1.0, 2.0], [1.0], [0.0, 0.0]])
            ),
            r"action: rows of different lengths",
        ),
        (
            lambda root, ep: _rewrite_column(ep, "action", pa.array([["a", "b"]] * 3)),
            r"action: values of type string, expected numbers",
        ),
        (
            lambda root, ep: _rewrite_column(
                ep, "next.reward", pa.array([1.0, None, 2.0], pa.float32())
            ),
            r"next.reward: 1 null values",
        ),
        (
            lambda root, ep: _rewrite_column(
                ep, "observation.instruction", pa.array([[0.5] * 12] * 3)
            ),
            r"observation.instruction: values do not fit dtype int32",
        ),
        (
            lambda root, ep: _rewrite_column(
                ep,
                "observation.image",
                pa.array([{"bytes": _png_of((6, 8, 3)), "path": None}] * 3, IMAGE_STRUCT),
            ),
            r"observation.image: an image of uint8\[6, 8, 3\], declared uint8\[8, 6, 3\]",
        ),
    ],
)
def test_inconsistent_data_is_refused_not_coerced(tmp_path: Path, corrupt, match: str) -> None:
    """Data that does not match its metadata fails, naming file and field, instead of being
    coerced into plausible-looking wrong frames."""
    with LeRobotWriter(tmp_path / "ds", FEATURES, codebase_version=V21) as writer:
        writer.add_episode(_episode(np.random.default_rng(10), 3), "t")
        writer.add_episode(_episode(np.random.default_rng(11), 2), "t")
    corrupt(tmp_path / "ds", tmp_path / "ds" / "data" / "chunk-000" / "episode_000000.parquet")
    with pytest.raises(DatasetError, match=match):
        LeRobotDataset(tmp_path / "ds").episode(0)


def _png_of(shape: tuple[int, int, int]) -> bytes:
    from sft.lerobot_format import _png

    return _png(np.zeros(shape, np.uint8))
