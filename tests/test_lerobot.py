"""LeRobot dataset layout: write/read round trip, meta files, expert demo generation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sft.demos import generate_demos, rollout_episode
from sft.lerobot import Feature, LeRobotDataset, LeRobotWriter, to_policy_obs
from sim.adapter import make_env
from sim.experts import TableTopExpert, TableTopExpertConfig

FEATURES = {
    "observation.image": Feature(dtype="uint8", shape=(8, 6, 3)),
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


def test_round_trip_and_meta(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    episodes = [_episode(rng, n) for n in (4, 7, 3)]
    tasks = ["push red", "push blue", "push red"]
    with LeRobotWriter(tmp_path / "ds", FEATURES, fps=5) as writer:
        writer.add_episode(episodes[0], tasks[0])  # dict of [T, ...] arrays
        frames = [{k: v[t] for k, v in episodes[1].items()} for t in range(7)]
        writer.add_episode(frames, tasks[1])  # list of per-frame dicts
        writer.add_episode(episodes[2], tasks[2])
    root = tmp_path / "ds"
    assert (root / "data" / "chunk-000" / "episode_000002.parquet").is_file()
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v2.0" and info["fps"] == 5
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 14, 2)
    assert info["features"]["observation.image"] == {
        "dtype": "uint8",
        "shape": [8, 6, 3],
        "names": None,
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
    with pytest.raises(FileExistsError):
        LeRobotWriter(tmp_path / "ds", FEATURES)
    LeRobotWriter(tmp_path / "ds", FEATURES, overwrite=True).finalize()
    assert len(LeRobotDataset(tmp_path / "ds")) == 0


def test_chunking(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    eps = [_episode(rng, 2 + i) for i in range(3)]
    with LeRobotWriter(tmp_path, FEATURES, chunks_size=2) as writer:
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
