"""The simulator adapter contract: gymnasium wrapper, table-top task, expert, straggler wrapper."""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from sim.adapter import SimAdapter, SimulatorNotInstalledError
from sim.envs import make_env
from sim.experts import TableTopExpert
from sim.gym_adapter import GymAdapter
from sim.straggler import StragglerAdapter, StragglerConfig, lognormal_mu
from sim.tabletop import (
    COLOURS,
    NUM_OBJECTS,
    OBS_MODES,
    SCENE_DIM,
    STATE_DIM,
    TableTopConfig,
    TableTopEnv,
)
from tests.instructions import decode_instruction


def _check_obs(env: SimAdapter, obs: dict[str, np.ndarray]) -> None:
    assert set(obs) == set(env.observation_space.spaces)
    for key, space in env.observation_space.spaces.items():
        assert obs[key].dtype == space.dtype, key
        assert obs[key].shape == space.shape, key
    assert env.observation_space.contains(obs)


def _rollout(env: SimAdapter, seed: int, actions: list[Any]) -> list[tuple]:
    obs, _ = env.reset(seed=seed)
    out = [({k: v.copy() for k, v in obs.items()},)]
    for a in actions:
        obs, reward, term, trunc, _ = env.step(a)
        out.append(({k: v.copy() for k, v in obs.items()}, reward, term, trunc))
        if term or trunc:
            break
    return out


def _same(a: list[tuple], b: list[tuple]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if any(not np.array_equal(x[0][k], y[0][k]) for k in x[0]) or x[1:] != y[1:]:
            return False
    return True


# ----------------------------------------------------------------------------------- gymnasium
@pytest.mark.parametrize("env_id, obs_dim", [("CartPole-v1", 4), ("Pendulum-v1", 3)])
def test_gym_adapter_contract(env_id: str, obs_dim: int) -> None:
    env = make_env(env_id, seed=3)
    assert isinstance(env, GymAdapter)
    assert env.observation_space["state"].shape == (obs_dim,)
    assert env.instruction is None
    obs, info = env.reset()
    _check_obs(env, obs)
    assert isinstance(info, dict)
    env.action_space.seed(0)
    actions = [env.action_space.sample() for _ in range(30)]
    for a in actions:
        obs, reward, term, trunc, info = env.step(a)
        _check_obs(env, obs)
        assert type(reward) is float and type(term) is bool and type(trunc) is bool
        if term or trunc:
            break
    # the construction seed is the first episode's seed; an explicit seed reproduces it
    assert _same(_rollout(make_env(env_id, seed=3), 3, actions), _rollout(env, 3, actions))
    assert not _same(_rollout(env, 4, actions), _rollout(env, 3, actions))
    env.close()


def test_gym_adapter_actions_and_truncation() -> None:
    cart = make_env("CartPole-v1", seed=0)
    cart.reset()
    cart.step(np.array([1], dtype=np.int64))  # batched int from a policy head
    cart.step(np.int64(0))
    pend = make_env("Pendulum-v1", seed=0)
    assert pend.max_episode_steps == 200
    pend.reset()
    for i in range(200):
        _, _, term, trunc, _ = pend.step(np.array([5.0]))  # clipped to [-2, 2]
        assert not term
        assert trunc == (i == 199)


def test_gym_adapter_flattens_discrete_observations() -> None:
    env = make_env("FrozenLake-v1", seed=0, is_slippery=False)
    obs, _ = env.reset()
    assert obs["state"].shape == (16,) and obs["state"].dtype == np.float32
    assert obs["state"].sum() == 1.0 and obs["state"][0] == 1.0


def test_make_env_reserved_and_unknown_ids() -> None:
    # Ids behind optional extras name the extra to install -- when it is not installed.
    if importlib.util.find_spec("mani_skill") is None:
        with pytest.raises(SimulatorNotInstalledError, match="maniskill"):
            make_env("maniskill/PickCube-v1", seed=0)
    if importlib.util.find_spec("libero") is None:
        with pytest.raises(ImportError, match="libero"):
            make_env("libero/libero_spatial", seed=0)
    with pytest.raises(KeyError, match="rlvla3/TableTop-v0"):
        make_env("rlvla3/NoSuchTask-v0", seed=0)
    with pytest.raises(TypeError):
        make_env("rlvla3/TableTop-v0", seed=0, no_such_option=1)


# ----------------------------------------------------------------------------------- table-top
def test_tabletop_rgb_contract() -> None:
    env = make_env("rlvla3/TableTop-v0", seed=0)
    assert isinstance(env, TableTopEnv)
    space = env.observation_space
    assert space["image"].shape == (64, 64, 3) and space["image"].dtype == np.uint8
    assert space["instruction"].shape == (64,) and space["instruction"].dtype == np.int32
    assert space["proprio"].shape == (4,) and space["proprio"].dtype == np.float32
    assert env.action_space == spaces.Box(-1.0, 1.0, (2,), np.float32)
    obs, info = env.reset()
    _check_obs(env, obs)
    assert info["success"] is False
    assert decode_instruction(obs["instruction"]) == env.instruction == info["instruction"]
    rng = np.random.default_rng(0)
    for _ in range(40):
        obs, reward, term, trunc, info = env.step(rng.uniform(-1.5, 1.5, size=2))
        _check_obs(env, obs)
        assert type(info["success"]) is bool and type(reward) is float
        if term or trunc:
            obs, _ = env.reset()
    image = env.render()
    assert image.shape == (64, 64, 3) and len(np.unique(image.reshape(-1, 3), axis=0)) >= 7


def test_tabletop_state_mode_encodes_goal() -> None:
    env = make_env("rlvla3/TableTop-v0", seed=1, obs_mode="state")
    assert set(env.observation_space.spaces) == {"state"}
    for seed in range(10):
        obs, _ = env.reset(seed=seed)
        _check_obs(env, obs)
        assert obs["state"].shape == (STATE_DIM,)
        st = env.privileged_state()
        one_hots = obs["state"][-2 * NUM_OBJECTS :]
        assert np.argmax(one_hots[:NUM_OBJECTS]) == st.block_index
        assert np.argmax(one_hots[NUM_OBJECTS:]) == st.target_index
        assert env.instruction == (
            f"push the {COLOURS[st.block_index]} block to the {COLOURS[st.target_index]} target"
        )
        np.testing.assert_allclose(obs["state"][:2], st.pusher_pos, atol=1e-6)
    assert env.render().shape == (64, 64, 3)


def test_tabletop_rgb_plus_state_mode_is_both_in_step() -> None:
    """``rgb+state``: the camera keys plus the privileged state, which follows every step."""
    rgb = make_env("rlvla3/TableTop-v0", seed=3, obs_mode="rgb")
    both = make_env("rlvla3/TableTop-v0", seed=3, obs_mode="rgb+state")
    state_only = make_env("rlvla3/TableTop-v0", seed=3, obs_mode="state")
    assert set(both.observation_space.spaces) == set(rgb.observation_space.spaces) | {"state"}
    obs = [env.reset(seed=3)[0] for env in (rgb, both, state_only)]
    for _ in range(3):
        _check_obs(both, obs[1])
        assert all(np.array_equal(obs[0][k], obs[1][k]) for k in obs[0])
        np.testing.assert_array_equal(obs[1]["state"], obs[2]["state"])
        obs = [env.step(np.array([0.5, -0.3], np.float32))[0] for env in (rgb, both, state_only)]


def test_tabletop_rgb_plus_goal_mode_says_where_the_named_block_and_target_are() -> None:
    """``rgb+goal``: the camera keys plus the named block's and target's positions (a plan's
    labels), which follow the block as it is pushed."""
    rgb = make_env("rlvla3/TableTopEasy-v0", seed=4, obs_mode="rgb")
    goal = make_env("rlvla3/TableTopEasy-v0", seed=4, obs_mode="rgb+goal")
    assert set(goal.observation_space.spaces) == set(rgb.observation_space.spaces) | {"goal"}
    obs = [env.reset(seed=4)[0] for env in (rgb, goal)]
    moved, done = False, False
    while not done:
        _check_obs(goal, obs[1])
        assert all(np.array_equal(obs[0][k], obs[1][k]) for k in obs[0])
        st = goal.privileged_state()
        named = np.concatenate([st.block_pos[st.block_index], st.target_pos[st.target_index]])
        np.testing.assert_allclose(obs[1]["goal"], named, atol=1e-6)
        before = obs[1]["goal"][:2].copy()
        toward = named[:2] - st.pusher_pos  # the easy task's pusher starts behind the block
        action = (toward / np.abs(toward).max()).astype(np.float32)
        steps = [env.step(action) for env in (rgb, goal)]
        obs, done = [s[0] for s in steps], steps[1][2] or steps[1][3]
        moved |= not np.allclose(obs[1]["goal"][:2], before)
    assert moved


def test_tabletop_rgb_plus_scene_mode_says_where_everything_is_but_not_what_is_named() -> None:
    """``rgb+scene``: the camera keys plus the state without its one-hots, so which block and
    target count is only in the instruction."""
    scene = make_env("rlvla3/TableTopEasy-v0", seed=4, obs_mode="rgb+scene")
    state = make_env("rlvla3/TableTopEasy-v0", seed=4, obs_mode="rgb+state")
    assert set(scene.observation_space.spaces) == {"image", "instruction", "proprio", "scene"}
    obs = [env.reset(seed=4)[0] for env in (scene, state)]
    for _ in range(3):
        _check_obs(scene, obs[0])
        assert obs[0]["scene"].shape == (SCENE_DIM,)
        np.testing.assert_array_equal(obs[0]["scene"], obs[1]["state"][:SCENE_DIM])
        np.testing.assert_array_equal(obs[0]["instruction"], obs[1]["instruction"])
        obs = [env.step(np.array([0.7, 0.2], np.float32))[0] for env in (scene, state)]
    assert np.abs(obs[0]["scene"][2:4]).max() > 0  # the pusher's velocity


def test_rlvla3_demos_offers_every_tabletop_obs_mode() -> None:
    """The CLI keeps its own copy of the modes (it imports no simulator to build its parser)."""
    from rlvla3.cli import build_parser

    parser = build_parser()
    for mode in OBS_MODES:
        assert parser.parse_args(["demos", "--out", "d", "--obs-mode", mode]).obs_mode == mode


@pytest.mark.parametrize("obs_mode", OBS_MODES)
def test_tabletop_deterministic_under_seed(obs_mode: str) -> None:
    actions = list(np.random.default_rng(5).uniform(-1, 1, size=(30, 2)))
    a = make_env("rlvla3/TableTop-v0", seed=7, obs_mode=obs_mode)
    b = make_env("rlvla3/TableTop-v0", seed=123, obs_mode=obs_mode)
    assert _same(_rollout(a, 7, actions), _rollout(b, 7, actions))
    assert not _same(_rollout(a, 8, actions), _rollout(b, 7, actions))
    # construction seed == seed of the first reset() without one
    c = make_env("rlvla3/TableTop-v0", seed=7, obs_mode=obs_mode)
    first, _ = c.reset()
    assert all(np.array_equal(first[k], _rollout(a, 7, [])[0][0][k]) for k in first)


def test_tabletop_instruction_changes_between_episodes() -> None:
    env = make_env("rlvla3/TableTop-v0", seed=0)
    seen: dict[str, np.ndarray] = {}
    for _ in range(30):
        obs, _ = env.reset()
        seen[env.instruction] = obs["instruction"]
    assert len(seen) >= 5
    tokens = {bytes(v.tobytes()) for v in seen.values()}
    assert len(tokens) == len(seen)  # the instruction is in the observation


def test_tabletop_truncation_and_step_after_done() -> None:
    env = TableTopEnv(TableTopConfig(obs_mode="state", max_episode_steps=5), seed=0)
    env.reset()
    for i in range(5):
        _, _, term, trunc, info = env.step(np.zeros(2))
        assert not term and not info["success"]
        assert trunc == (i == 4)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(np.zeros(2))


def test_expert_success_flag_and_rate() -> None:
    env = make_env("rlvla3/TableTop-v0", seed=0, obs_mode="state")
    expert = TableTopExpert()
    successes, returns = 0, []
    for seed in range(50):
        env.reset(seed=seed)
        total = 0.0
        while True:
            _, reward, term, trunc, info = env.step(expert.act(env.privileged_state()))
            total += reward
            if term or trunc:
                break
        assert term == info["success"]
        successes += info["success"]
        returns.append(total)
    assert successes / 50 >= 0.9
    assert np.mean(returns) > 5.0  # success bonus + shaping


def test_easy_variant_is_short_and_keeps_shapes() -> None:
    easy = make_env("rlvla3/TableTopEasy-v0", seed=0, obs_mode="state")
    normal = make_env("rlvla3/TableTop-v0", seed=0, obs_mode="state")
    assert easy.config.easy and easy.observation_space == normal.observation_space
    expert, lengths = TableTopExpert(), []
    for seed in range(20):
        easy.reset(seed=seed)
        while True:
            _, _, term, trunc, info = easy.step(expert.act(easy.privileged_state()))
            if term or trunc:
                break
        assert info["success"]
        lengths.append(easy.privileged_state().step)
    assert np.mean(lengths) < 8


# ----------------------------------------------------------------------------------- straggler
class _CountingEnv(SimAdapter):
    """A trivial adapter: the state is the number of steps taken."""

    def __init__(self) -> None:
        self.observation_space = spaces.Dict({"state": spaces.Box(0, np.inf, (1,), np.float32)})
        self.action_space = spaces.Discrete(2)
        self.steps = 0

    def reset(self, seed: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
        self.steps = 0
        return {"state": np.zeros(1, np.float32)}, {}

    def step(self, action: Any) -> tuple:
        self.steps += 1
        return {"state": np.full(1, self.steps, np.float32)}, 1.0, False, False, {}


def test_straggler_lognormal_mean_without_sleeping() -> None:
    slept: list[float] = []
    cfg = StragglerConfig(distribution="lognormal", mean_ms=2.0, sigma=1.0, seed=0)
    env = StragglerAdapter(_CountingEnv(), cfg, sleep=slept.append)
    env.reset()
    n = 20_000
    for _ in range(n):
        _, _, _, _, info = env.step(0)
        assert info["straggler_delay_s"] == slept[-1]
    delays = np.array(slept)
    assert len(delays) == n and env.inner.steps == n
    assert env.cfg.expected_delay_s == pytest.approx(0.002)
    assert delays.mean() == pytest.approx(0.002, rel=0.05)  # ~5 standard errors
    # the median pins mu = ln(mean) - sigma^2/2 (a naive mu = ln(mean) gives median == mean)
    assert np.median(delays) == pytest.approx(np.exp(lognormal_mu(2.0, 1.0)) / 1000, rel=0.05)
    assert delays.max() > 10 * delays.mean()  # heavy tail


def test_straggler_constant_none_and_validation() -> None:
    slept: list[float] = []
    cfg = StragglerConfig(distribution="constant", mean_ms=3.0)
    const = StragglerAdapter(_CountingEnv(), cfg, sleep=slept.append)
    for _ in range(5):
        const.step(0)
    assert slept == [0.003] * 5
    slept.clear()
    none = StragglerAdapter(
        _CountingEnv(), StragglerConfig(distribution="none"), sleep=slept.append
    )
    _, _, _, _, info = none.step(0)
    assert slept == [] and info["straggler_delay_s"] == 0.0 and none.cfg.expected_delay_s == 0.0
    with pytest.raises(ValueError):
        StragglerConfig(distribution="pareto")
    with pytest.raises(ValueError):
        StragglerConfig(mean_ms=-1.0)


def test_straggler_really_blocks() -> None:
    env = StragglerAdapter(_CountingEnv(), StragglerConfig(distribution="constant", mean_ms=2.0))
    start = time.perf_counter()
    for _ in range(10):
        env.step(0)
    assert time.perf_counter() - start >= 0.02  # a lower bound only: never flaky


def _timer_slack_ns(set_to: int | None = None) -> int:
    """The calling thread's timer slack (PR_GET_TIMERSLACK), after setting it if asked."""
    libc = ctypes.CDLL(None)
    if set_to is not None:
        libc.prctl(29, ctypes.c_ulong(set_to), 0, 0, 0)  # PR_SET_TIMERSLACK
    return libc.prctl(30, 0, 0, 0, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is Linux's")
def test_straggler_tightens_the_timer_slack_of_the_thread_that_steps() -> None:
    """Its sleeps end on time instead of up to the default 50 µs late."""
    seen: dict[str, int] = {}

    def step_in_a_thread() -> None:  # a thread of its own: slack is per thread
        env = StragglerAdapter(
            _CountingEnv(), StragglerConfig(distribution="constant", mean_ms=0.1)
        )
        seen["before"] = _timer_slack_ns(set_to=50_000)  # Linux's default
        env.step(0)
        seen["after"] = _timer_slack_ns()

    thread = threading.Thread(target=step_in_a_thread)
    thread.start()
    thread.join(timeout=30)
    assert seen == {"before": 50_000, "after": 1}


def test_make_env_with_straggler_wraps_and_seeds() -> None:
    cfg = StragglerConfig(mean_ms=0.1)  # real sleeps, but short
    delays = []
    for _ in range(2):
        env = make_env("rlvla3/TableTop-v0", seed=11, straggler=cfg, obs_mode="state")
        assert isinstance(env, StragglerAdapter)
        env.reset()
        assert env.privileged_state().step == 0  # task extras pass through
        assert env.instruction is not None and env.max_episode_steps == 60
        delays.append([env.step(np.zeros(2))[4]["straggler_delay_s"] for _ in range(5)])
    assert delays[0] == delays[1] and len(set(delays[0])) == 5
