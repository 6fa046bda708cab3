"""Env groups: a gymnasium vector env steps exactly like the same envs stepped one by one,
episode boundaries included (the episode's last observation for the bootstrap, the next
episode's first one to act on)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.env_group import SeparateEnvs, VectorEnvs
from sim.envs import make_env


def test_a_vector_env_steps_like_separate_envs_across_episode_ends() -> None:
    n, seed = 3, 7
    vector = VectorEnvs("CartPole-v1", n, seed=seed, mode="sync")
    separate = SeparateEnvs([make_env("CartPole-v1", seed=seed + i) for i in range(n)])
    rng = np.random.default_rng(0)
    obs_v = [vector.reset(i) for i in range(n)]
    obs_s = [separate.reset(i, seed=seed + i) for i in range(n)]
    episodes = [0] * n
    returns = [0.0] * n
    for _ in range(400):
        for a, b in zip(obs_v, obs_s, strict=True):
            np.testing.assert_array_equal(a["state"], b["state"])
        actions = [int(x) for x in rng.integers(0, 2, n)]
        for i, (v, s) in enumerate(zip(vector.step(actions), separate.step(actions), strict=True)):
            np.testing.assert_array_equal(v.obs["state"], s.obs["state"])  # the last obs too
            assert (v.reward, v.terminated, v.truncated) == (s.reward, s.terminated, s.truncated)
            returns[i] += v.reward
            if v.terminated or v.truncated:
                assert v.reset_obs is not None and s.reset_obs is None
                obs_v[i], obs_s[i] = v.reset_obs, separate.reset(i)
                episodes[i] += 1
                returns[i] = 0.0
            else:
                assert v.reset_obs is None
                obs_v[i], obs_s[i] = v.obs, s.obs
    assert min(episodes) >= 5  # random CartPole episodes are short: many boundaries crossed
    vector.close()
    separate.close()


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_native_and_sync_vector_envs_give_flat_state_observations(env_id: str) -> None:
    single = make_env(env_id, seed=0)
    group = VectorEnvs(env_id, 4, seed=0)
    assert group.observation_space == single.observation_space
    obs = group.reset(2)
    assert obs["state"].shape == single.observation_space["state"].shape
    assert obs["state"].dtype == np.float32
    actions = [single.action_space.sample() for _ in range(4)]
    stepped = group.step(actions)
    assert len(stepped) == 4 and all(s.obs["state"].dtype == np.float32 for s in stepped)
    group.close()
    single.close()


def test_a_native_vector_env_reports_its_next_step_resets_as_restarts() -> None:
    group = VectorEnvs("CartPole-v1", 4, seed=3)  # CartPole's own vector env: NEXT_STEP resets
    assert group.next_step_reset
    for i in range(4):
        group.reset(i)
    rng = np.random.default_rng(1)
    lengths, current, was_done = [], [0] * 4, [False] * 4
    for _ in range(300):
        for i, res in enumerate(group.step([int(a) for a in rng.integers(0, 2, 4)])):
            if was_done[i]:
                assert res.restarted and res.reward == 0.0 and not (res.terminated or res.truncated)
                was_done[i] = False
                continue
            assert not res.restarted and res.reward == 1.0  # CartPole: 1 per step survived
            current[i] += 1
            if res.terminated or res.truncated:
                assert res.reset_obs is None  # it resets at its next step
                lengths.append(current[i])
                current[i], was_done[i] = 0, True
    assert len(lengths) >= 8 and all(8 <= n <= 500 for n in lengths)
    group.close()
