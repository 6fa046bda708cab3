"""GRPO: group-relative advantages against hand-worked numbers, groups assembled from chunks that
arrive in any order, the staleness bound per sample, and same-seed groups of envs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlvla3.algo.batch import build_grpo_batch
from rlvla3.algo.grpo import GroupAssembler, GroupRounds, group_advantages
from rlvla3.config.run_config import AlgoConfig, ConfigError, config_from_dict
from roles.env.chunk_sink import ChunkStream
from roles.env.env_slot import EnvSlot
from transport.messages import TrajectoryChunk


def chunk(
    producer: str,
    group: str,
    rewards: list[float],
    *,
    ends: bool,
    versions: list[int] | None = None,
) -> TrajectoryChunk:
    n = len(rewards)
    done = np.zeros(n, bool)
    done[-1] = ends
    return TrajectoryChunk(
        worker_index=0,
        env_index=0,
        chunk_id=0,
        obs={"state": np.arange(n * 2, dtype=np.float32).reshape(n, 2)},
        actions=np.zeros(n, np.int64),
        rewards=np.asarray(rewards, np.float32),
        terminated=done,
        truncated=np.zeros(n, bool),
        log_probs=np.full(n, -0.7, np.float32),
        values=np.zeros(n, np.float32),
        policy_versions=np.asarray(versions if versions is not None else [0] * n, np.int64),
        bootstrap_value=0.0,
        producer=producer,
        group=group,
    )


def test_advantages_by_hand() -> None:
    # returns 1, 0, 0, 1: mean 0.5, population std 0.5 -> +1, -1, -1, +1
    np.testing.assert_allclose(group_advantages([1, 0, 0, 1]), [1, -1, -1, 1], atol=1e-5)
    # returns 3, 1, 2: mean 2, std sqrt(2/3) = 0.8165 -> +1.2247, -1.2247, 0
    np.testing.assert_allclose(group_advantages([3, 1, 2]), [1.2247449, -1.2247449, 0], atol=1e-5)
    # every episode alike: nothing to learn from the group
    assert group_advantages([2.0, 2.0, 2.0]).tolist() == [0.0, 0.0, 0.0]


def test_a_group_is_released_when_its_last_episode_ends_whatever_the_order() -> None:
    groups = GroupAssembler(group_size=2)
    a1 = chunk("0/0#x", "g", [1.0, 1.0], ends=False)
    b = chunk("0/1#x", "g", [1.0], ends=True)  # return 1
    a2 = chunk("0/0#x", "g", [1.0], ends=True)  # episode a: return 3
    assert groups.add(a1) is None and groups.add(b) is None
    assert groups.held == 2
    done = groups.add(a2)
    assert done is not None and groups.held == 0
    by_first = {chunks[0].producer: (chunks, adv) for chunks, adv in done.episodes}
    assert by_first["0/0#x"][0] == [a1, a2]  # in arrival order
    assert by_first["0/0#x"][1] == pytest.approx(1.0, abs=1e-5)  # (3 - 2) / 1
    assert by_first["0/1#x"][1] == pytest.approx(-1.0, abs=1e-5)


def test_a_group_takes_no_more_episodes_than_its_size() -> None:
    groups = GroupAssembler(group_size=2)
    groups.add(chunk("0/0#x", "g", [1.0], ends=False))
    groups.add(chunk("0/1#x", "g", [1.0], ends=False))
    with pytest.raises(ValueError, match="algo.group_size is 2"):
        groups.add(chunk("0/2#x", "g", [1.0], ends=True))
    with pytest.raises(ValueError, match="group: empty"):
        groups.add(chunk("0/0#x", "", [1.0], ends=True))


def test_incomplete_groups_past_the_staleness_bound_are_evicted() -> None:
    groups = GroupAssembler(group_size=2)
    old = chunk("0/0#x", "old", [1.0, 1.0], ends=True, versions=[2, 3])
    fresh = chunk("0/1#x", "fresh", [1.0], ends=False, versions=[8])
    groups.add(old)
    groups.add(fresh)
    assert groups.evict_stale(version=10, max_staleness=4) == [old]  # newest step 7 behind
    assert groups.held == 1
    assert groups.evict_stale(version=12, max_staleness=4) == []  # 4 behind: still trainable


def test_the_staleness_bound_applies_per_sample() -> None:
    algo = AlgoConfig(kind="grpo", correction="none", max_staleness=2)
    mixed = chunk("0/0#x", "g", [1.0, 1.0, 1.0], ends=True, versions=[1, 5, 6])
    fresh = chunk("0/1#x", "g", [0.0], ends=True, versions=[6])
    batch, left_out = build_grpo_batch(
        [(mixed, 1.0), (fresh, -1.0)], policy=None, algo=algo, device=torch.device("cpu"), version=6
    )
    assert left_out == 1  # the step from version 1
    assert batch is not None
    assert batch["advantages"].tolist() == [1.0, 1.0, -1.0]
    assert batch["obs"]["state"].tolist() == [[2.0, 3.0], [4.0, 5.0], [0.0, 1.0]]
    assert batch["returns"].abs().sum() == 0  # no critic
    stale, left_out = build_grpo_batch(
        [(mixed, 1.0)], policy=None, algo=algo, device=torch.device("cpu"), version=20
    )
    assert stale is None and left_out == 3


def test_one_env_may_run_several_episodes_of_a_group() -> None:
    groups = GroupAssembler(group_size=3)
    first = chunk("0/0#x", "g", [1.0], ends=True)  # return 1
    slow = chunk("0/1#x", "g", [0.0, 0.0], ends=False)
    second = chunk("0/0#x", "g", [1.0, 1.0, 1.0], ends=True)  # the same env again: return 3
    assert groups.add(first) is None and groups.add(slow) is None
    assert groups.add(second) is None  # 2 of 3 episodes ended
    slow_end = chunk("0/1#x", "g", [2.0], ends=True)  # the slow one: return 2
    done = groups.add(slow_end)
    assert done is not None and groups.held == 0
    episodes = [[id(c) for c in chunks] for chunks, _ in done.episodes]
    assert episodes == [[id(first)], [id(slow), id(slow_end)], [id(second)]]
    # returns 1, 2, 3: mean 2, std sqrt(2/3)
    np.testing.assert_allclose([a for _, a in done.episodes], [-1.2247449, 0, 1.2247449], atol=1e-5)


def _slot(rounds: GroupRounds, env_index: int) -> EnvSlot:
    stream = ChunkStream(env_index, f"0/{env_index}#inc")
    return EnvSlot(0, stream, rounds)


def test_a_groups_episodes_start_from_one_seed_and_fast_envs_do_not_run_ahead() -> None:
    rounds = GroupRounds(group_size=2, run_seed=0, worker_index=0, incarnation="inc")
    # envs 0 and 1 (pool 0) start; env 0's episodes are short: it runs both of round 1 while
    # env 1 is still in its first, and env 1's next episode opens round 2.
    e0, e1 = rounds.start_episode(0), rounds.start_episode(1)
    fast_a, fast_b, slow_next = (
        rounds.start_episode(0),
        rounds.start_episode(0),
        rounds.start_episode(1),
    )
    assert e0 == e1 and e0[0] == "0/0#inc:0"  # same group, same seed
    assert fast_a == fast_b and fast_a[0] == "0/0#inc:1"
    assert slow_next[0] == "0/0#inc:2"
    assert len({e0[1], fast_a[1], slow_next[1]}) == 3  # each group starts elsewhere
    other_pool = rounds.start_episode(2)
    assert other_pool[0] == "0/1#inc:0" and other_pool[1] != e0[1]
    other_worker = GroupRounds(2, 0, worker_index=1, incarnation="inc").start_episode(0)
    assert other_worker[1] != e0[1]


def test_env_slots_take_their_group_and_seed_from_the_worker() -> None:
    cfg = config_from_dict(
        {"env": {"num_envs_per_worker": 4}, "algo": {"kind": "grpo", "group_size": 2}}
    )
    rounds = GroupRounds(cfg.algo.group_size, cfg.run.seed, 0, "inc")  # the worker's rounds
    first, second = _slot(rounds, 0), _slot(rounds, 1)
    assert first.next_group_seed() == second.next_group_seed()
    assert first.stream.group == second.stream.group == "0/0#inc:0"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (
            {"algo": {"kind": "grpo", "group_size": 3}, "env": {"num_envs_per_worker": 4}},
            "algo.group_size",
        ),
        ({"algo": {"kind": "grpo"}, "run": {"mode": "sync"}}, "algo.kind"),
        ({"algo": {"kind": "grpo", "correction": "vtrace"}}, "algo.correction"),
    ],
)
def test_grpo_settings_that_cannot_work_are_refused_at_load(overrides: dict, field: str) -> None:
    raw = {"env": {"num_envs_per_worker": 4}, **overrides}
    with pytest.raises(ConfigError, match=field):
        config_from_dict(raw)
