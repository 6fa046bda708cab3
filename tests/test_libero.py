"""LIBERO adapter: id parsing and config writing (always), and the SimAdapter contract on a real
LIBERO task (``@pytest.mark.libero``: skipped, with the reason, unless libero, its assets and a
headless MuJoCo GL backend work here; ``python -m sim.libero_setup`` installs them)."""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sim import libero_setup
from sim.adapter import SimAdapter, SimulatorNotInstalledError
from sim.envs import make_env
from sim.libero import LiberoConfig, parse_env_id, quat_to_axis_angle
from tests.instructions import decode_instruction

ENV_ID = "libero/libero_spatial/0"
MAX_STEPS = 3  # the shared env truncates early so one env serves the truncation test too
OBS_KEYS = {"image", "wrist_image", "instruction", "proprio"}


# ------------------------------------------------------------------- without libero installed
@pytest.mark.parametrize(
    ("env_id", "expected"),
    [
        ("libero/libero_spatial/0", ("libero_spatial", 0)),
        ("libero/libero_90/89", ("libero_90", 89)),
    ],
)
def test_parse_env_id(env_id: str, expected: tuple[str, int]) -> None:
    assert parse_env_id(env_id) == expected


@pytest.mark.parametrize(
    "env_id",
    ["libero/libero_spatial", "libero/libero_100/0", "libero/libero_goal/10", "libero/x/-1"],
)
def test_parse_env_id_rejects_bad_ids(env_id: str) -> None:
    with pytest.raises(ValueError):
        parse_env_id(env_id)


def test_config_validation() -> None:
    assert LiberoConfig(suite="libero_10").episode_steps == 520
    assert LiberoConfig(max_episode_steps=7).episode_steps == 7
    with pytest.raises(ValueError, match="render_quality"):
        LiberoConfig(render_quality="pretty")


def test_quat_to_axis_angle() -> None:
    half = np.pi / 4  # 90 degrees about z, (x, y, z, w) order
    axis_angle = quat_to_axis_angle(np.array([0.0, 0.0, np.sin(half), np.cos(half)]))
    np.testing.assert_allclose(axis_angle, [0.0, 0.0, np.pi / 2], atol=1e-9)
    np.testing.assert_allclose(quat_to_axis_angle(np.array([0.0, 0.0, 0.0, 1.0])), 0.0)


def test_make_env_without_libero_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "libero" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(SimulatorNotInstalledError, match="libero"):
        make_env(ENV_ID, seed=0)


def _fake_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "site" / "libero" / "libero"
    for sub in ("bddl_files", "init_files"):
        (root / sub).mkdir(parents=True)
    assets = tmp_path / "assets"
    for sub in libero_setup.ASSET_SUBDIRS:
        (assets / sub).mkdir(parents=True)
    monkeypatch.setattr(libero_setup, "find_benchmark_root", lambda: root)
    monkeypatch.setenv("RLVLA3_LIBERO_ASSETS", str(assets))
    monkeypatch.setenv("LIBERO_CONFIG_PATH", str(tmp_path / "cfg"))
    return assets


def test_ensure_config_writes_once_and_keeps_a_usable_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assets = _fake_install(tmp_path, monkeypatch)
    config = libero_setup.ensure_config()
    path = tmp_path / "cfg" / "config.yaml"
    assert libero_setup.read_config(path) == config
    assert config["assets"] == str(assets)
    assert set(config) == set(libero_setup.CONFIG_KEYS)
    path.write_text(path.read_text() + "# edited by hand\n")
    libero_setup.ensure_config()  # usable: left alone
    assert path.read_text().endswith("# edited by hand\n")
    path.write_text("assets: /nonexistent\n")  # unusable: rewritten
    assert libero_setup.ensure_config() == config


def test_ensure_config_without_assets_says_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_install(tmp_path, monkeypatch)
    monkeypatch.setenv("RLVLA3_LIBERO_ASSETS", str(tmp_path / "nowhere"))
    with pytest.raises(libero_setup.LiberoSetupError, match="assets not found"):
        libero_setup.ensure_config()


# --------------------------------------------------------------------------- with libero
@pytest.fixture(scope="session")
def libero_unavailable() -> str | None:
    """Why LIBERO cannot run here (probed once per session in a subprocess), or None."""
    return libero_setup.probe(timeout_s=120.0)


@pytest.fixture(scope="module")
def env(libero_unavailable: str | None) -> Iterator[SimAdapter]:
    if libero_unavailable is not None:
        pytest.skip(libero_unavailable)
    adapter = make_env(ENV_ID, seed=0, image_size=64, max_episode_steps=MAX_STEPS)
    yield adapter
    adapter.close()


def _assert_obs(env: SimAdapter, obs: dict[str, np.ndarray]) -> None:
    assert set(obs) == OBS_KEYS
    assert obs["image"].dtype == np.uint8 and obs["image"].shape == (64, 64, 3)
    assert obs["wrist_image"].dtype == np.uint8 and obs["wrist_image"].shape == (64, 64, 3)
    assert obs["instruction"].dtype == np.int32 and obs["instruction"].shape == (128,)
    assert obs["proprio"].dtype == np.float32 and obs["proprio"].shape == (8,)
    assert env.observation_space.contains(obs)


@pytest.mark.libero
def test_reset_contract(env: SimAdapter) -> None:
    obs, info = env.reset(seed=0)
    _assert_obs(env, obs)
    assert info["success"] is False
    assert info["init_state_index"] == 0
    assert obs["image"].std() > 5 and obs["wrist_image"].std() > 5  # a scene, not a blank
    assert np.all(np.isfinite(obs["proprio"]))
    space = env.action_space
    assert space.shape == (7,) and space.dtype == np.float32
    assert np.all(space.low == -1.0) and np.all(space.high == 1.0)
    assert env.max_episode_steps == MAX_STEPS


@pytest.mark.libero
def test_instruction_is_the_task_language(env: SimAdapter) -> None:
    from libero.libero import benchmark  # importable: the env fixture configured libero

    language = benchmark.get_benchmark_dict()["libero_spatial"]().get_task(0).language
    obs, info = env.reset(seed=1)
    assert env.instruction == language == info["instruction"]
    assert decode_instruction(obs["instruction"]) == language


@pytest.mark.libero
def test_reset_is_deterministic_under_seed(env: SimAdapter) -> None:
    actions = np.random.default_rng(0).uniform(-1, 1, size=(1, 7)).astype(np.float32)

    def rollout(seed: int) -> list[dict[str, np.ndarray]]:
        obs, _ = env.reset(seed=seed)
        return [obs] + [env.step(a)[0] for a in actions]

    first, second = rollout(7), rollout(7)
    for a, b in zip(first, second, strict=True):
        for key in OBS_KEYS:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    other, info = env.reset(seed=8)  # another fixed initial state
    assert info["init_state_index"] == 8
    assert not np.array_equal(other["image"], first[0]["image"])


@pytest.mark.libero
def test_random_steps_and_truncation(env: SimAdapter) -> None:
    env.reset(seed=2)
    rng = np.random.default_rng(1)
    for t in range(1, MAX_STEPS + 1):
        action = rng.uniform(-2, 2, 7)  # out-of-range components are clipped
        obs, reward, terminated, truncated, info = env.step(action)
        _assert_obs(env, obs)
        assert isinstance(info["success"], bool) and type(reward) is float
        assert type(terminated) is bool and type(truncated) is bool
        assert reward == float(info["success"]) and terminated == info["success"]
        if terminated:
            return  # a random policy succeeding is fine, if unlikely
        assert truncated == (t == MAX_STEPS)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(np.zeros(7, np.float32))


def test_a_torchvision_that_does_not_load_is_uninstalled(monkeypatch) -> None:
    """The index's torchvision is a CUDA build that fails to import beside a CPU torch (and
    takes `import transformers` down with it): the setup removes it, and leaves one that loads."""
    calls: list[list[str]] = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        loads = "uninstall" in cmd or not broken
        return subprocess.CompletedProcess(cmd, 0 if loads else 1, "", "RuntimeError: no nms")

    monkeypatch.setattr(libero_setup, "_installed", lambda name: "0.28.0")
    monkeypatch.setattr(libero_setup.subprocess, "run", run)
    broken = False
    assert not libero_setup.drop_unloadable_torchvision()
    assert not any("uninstall" in cmd for cmd in calls)
    broken = True
    assert libero_setup.drop_unloadable_torchvision()
    assert calls[-1][-3:] == ["uninstall", "-y", "torchvision"]


# ------------------------------------------------------------- rlvla3 eval's LIBERO protocol
OPENPI_MAX_STEPS = {  # openpi examples/libero/main.py
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}


@pytest.mark.libero
@pytest.mark.parametrize("suite", sorted(OPENPI_MAX_STEPS))
def test_libero_protocol_is_every_task_times_its_init_states(suite: str) -> None:
    """The episode list is exactly (tasks x fixed initial states) of the suite, in order, with
    openpi's step limit and 10 settle steps; read from LIBERO's benchmark, nothing rendered."""
    from sim.protocols import libero_protocol, protocol_for

    try:
        benchmark, _, _ = libero_setup.import_libero()
    except SimulatorNotInstalledError as err:
        pytest.skip(str(err))
    task_suite = benchmark.get_benchmark_dict()[suite]()
    protocol = libero_protocol(suite)
    expected = [
        (f"libero/{suite}/{task}", task_suite.get_task(task).name, state)
        for task in range(task_suite.n_tasks)
        for state in range(len(task_suite.get_task_init_states(task)))
    ]
    assert len(expected) == 50 * task_suite.n_tasks  # 50 fixed initial states per task
    assert [(e.env_id, e.task, e.init_state) for e in protocol.episodes] == expected
    limit = OPENPI_MAX_STEPS[suite]
    kwargs = {"max_episode_steps": limit, "num_settle_steps": 10}
    assert all(e.max_steps == limit and e.env_kwargs == kwargs for e in protocol.episodes)
    assert all(e.seed == e.init_state for e in protocol.episodes)
    assert [e.index for e in protocol.episodes] == list(range(len(expected)))
    one = protocol_for(suite=None, env_id=f"libero/{suite}/1", episodes=60)  # (50 states)
    assert one.name == f"{suite}/1" and protocol.name == suite  # one task: its own --out
    assert [e.key for e in one.episodes] == [e.key for e in protocol.episodes if "/1#" in e.key]


@pytest.mark.slow
@pytest.mark.libero
def test_rlvla3_eval_smoke_one_task_two_init_states(
    tmp_path: Path, libero_unavailable: str | None
) -> None:
    """CI's smoke: ``rlvla3 eval`` on one LIBERO task's first two initial states with a tiny
    random VLA, through the eval roles; a JSON report and a video come out."""
    if libero_unavailable is not None:
        pytest.skip(libero_unavailable)
    import json

    from tests.launching import run_eval, write_checkpoint_run

    kwargs = {"image_size": 64, "render_quality": "fast"}
    vla = {"d_model": 32, "num_layers": 1, "num_heads": 2, "patch_size": 16}
    cfg = {
        "run": {"name": "tiny_libero", "progress_interval_s": 10.0},
        "roles": {"env_worker": {"count": 1}, "rollout_server": {"count": 1}},
        "env": {"id": ENV_ID, "kwargs": kwargs},
        "policy": {"kind": "vla", "vla": vla},
    }
    write_checkpoint_run(tmp_path / "run", cfg)
    out = tmp_path / "eval"
    extra = ("--env", ENV_ID, "--episodes", "2", "--videos", "1")
    run_eval(tmp_path / "run", out, *extra, timeout_s=1200)
    report = json.loads((out / "eval.json").read_text())
    assert report["complete"] and report["protocol"]["episodes"] == 2
    assert [e["init_state"] for e in report["episodes"]] == [0, 1]
    for episode in report["episodes"]:  # the suite's limit (a success ends one sooner)
        assert episode["length"] == 220 or episode["success"], episode
    assert len(list((out / "videos").glob("*.gif"))) == 1
