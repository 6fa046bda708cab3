"""RL loop pieces without processes: staleness filter, batch building, flat weight layout."""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlvla3.algo.advantages import compute_gae
from rlvla3.algo.batch import build_batch, chunk_staleness, keep_chunk
from rlvla3.config.run_config import AlgoConfig
from rlvla3.policy.mlp import MLPPolicy
from transport.messages import TrajectoryChunk
from transport.weights import FlatLayout


def chunk(
    versions: list[int], terminated_last: bool = False, bootstrap: float = 0.5
) -> TrajectoryChunk:
    n = len(versions)
    terminated = np.zeros(n, bool)
    terminated[-1] = terminated_last
    return TrajectoryChunk(
        worker_index=0,
        env_index=0,
        chunk_id=0,
        obs={"state": np.arange(n * 4, dtype=np.float32).reshape(n, 4) / 10},
        actions=np.arange(n, dtype=np.int64) % 2,
        rewards=np.ones(n, np.float32),
        terminated=terminated,
        truncated=np.zeros(n, bool),
        log_probs=np.full(n, -0.69, np.float32),
        values=np.full(n, 0.25, np.float32),
        policy_versions=np.array(versions, np.int64),
        bootstrap_value=bootstrap,
    )


@pytest.mark.parametrize(
    ("versions", "trainer", "max_staleness", "on_policy", "kept"),
    [
        ([5, 5, 5], 5, 2, False, True),
        ([3, 4, 5], 5, 2, False, True),  # the oldest step decides: 2 behind, allowed
        ([2, 5, 5], 5, 2, False, False),  # 3 behind: dropped
        ([4, 4], 5, 2, True, False),  # per-round training keeps only the current version
        ([5, 5], 5, 0, True, True),
        ([6, 6], 5, 2, False, False),  # from the future: never
    ],
)
def test_staleness_filter_drops_exactly_what_it_should(
    versions, trainer, max_staleness, on_policy, kept
):
    staleness = chunk_staleness(chunk(versions), trainer)
    assert staleness == trainer - min(versions)
    assert keep_chunk(staleness, max_staleness=max_staleness, on_policy_only=on_policy) is kept


@pytest.mark.parametrize("correction", ["none", "truncated_is", "vtrace"])
def test_build_batch_shapes_and_on_policy_agreement(correction: str) -> None:
    torch.manual_seed(0)
    policy = MLPPolicy(4, gym.spaces.Discrete(2))
    chunks = [chunk([1, 1, 1]), chunk([1, 1], terminated_last=True, bootstrap=0.0)]
    batch = build_batch(
        chunks, policy, AlgoConfig(correction=correction, lam=1.0), torch.device("cpu")
    )
    assert batch["obs"]["state"].shape == (5, 4)
    assert batch["advantages"].shape == batch["returns"].shape == (5,)
    if correction == "truncated_is":
        assert batch["is_weights"].shape == (5,) and bool((batch["is_weights"] <= 1.0).all())
    if correction == "none":  # behaviour values: GAE exactly as computed by hand per chunk
        _, ret = compute_gae(torch.ones(3), torch.full((3,), 0.25), 0.5, 0.99, 1.0)
        torch.testing.assert_close(batch["returns"][:3], ret)


@pytest.mark.parametrize("correction", ["none", "vtrace"])
@pytest.mark.parametrize("bootstrap_truncated", [True, False])
def test_a_truncated_episode_bootstraps_only_when_asked(correction, bootstrap_truncated) -> None:
    """``algo.bootstrap_truncated``: a time-limit truncation is bootstrapped from the value of
    its last observation, or, when false, ends the return like a termination."""
    policy = MLPPolicy(4, gym.spaces.Discrete(2))
    truncated = chunk([0, 0, 0], bootstrap=10.0)
    truncated.truncated[-1] = True
    algo = AlgoConfig(
        correction=correction, gamma=1.0, lam=1.0, bootstrap_truncated=bootstrap_truncated
    )
    returns = build_batch([truncated], policy, algo, torch.device("cpu"))["returns"]
    # rewards of 1 each; the behaviour values (0.25) count on-policy under "none"
    tail = 10.0 if bootstrap_truncated else 0.0
    if correction == "none":
        torch.testing.assert_close(returns, torch.tensor([3.0, 2.0, 1.0]) + tail)
    else:  # the V-trace targets differ in how they weigh the values, not in the bootstrap
        assert (returns[-1] > 5.0) == bootstrap_truncated


def test_flat_layout_round_trip() -> None:
    torch.manual_seed(0)
    a, b = MLPPolicy(4, gym.spaces.Discrete(2)), MLPPolicy(4, gym.spaces.Discrete(2))
    layout = FlatLayout.of(a)
    assert layout.digest == FlatLayout.of(b).digest
    assert layout.numel == sum(p.numel() for p in a.parameters())
    layout.load(b, layout.flatten(a))
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    with pytest.raises(ValueError, match="elements"):
        layout.load(b, torch.zeros(3))


def test_bound_module_is_updated_in_place_through_its_flat_buffer() -> None:
    torch.manual_seed(0)
    a, b = MLPPolicy(4, gym.spaces.Discrete(2)), MLPPolicy(4, gym.spaces.Discrete(2))
    layout = FlatLayout.of(a)
    before = {k: v.clone() for k, v in b.state_dict().items()}
    flat = layout.bind(b)
    for k, v in b.state_dict().items():  # binding keeps the values
        assert torch.equal(v, before[k])
    flat.copy_(layout.flatten(a))  # what WeightLink.recv_body does: write the buffer only
    obs = {"state": torch.randn(3, 4)}
    torch.testing.assert_close(b.act(obs, deterministic=True).value, a.act(obs, True).value)
    assert all(p.data_ptr() - flat.data_ptr() in range(flat.numel() * 4) for p in b.parameters())


def test_bind_refuses_tied_weights() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    model[1].weight = model[0].weight
    with pytest.raises(ValueError, match="share storage"):
        FlatLayout.of(model).bind(model)


def test_mlp_discrete_act_samples_its_categorical_and_scores_like_evaluate() -> None:
    torch.manual_seed(0)
    policy = MLPPolicy(4, gym.spaces.Discrete(3)).eval()
    with torch.no_grad():  # make the three probabilities clearly different
        policy.actor[-1].bias.copy_(torch.tensor([1.0, 0.0, -1.0]))
    obs = {"state": torch.zeros(1, 4).expand(60_000, 4)}
    out = policy.act(obs)
    probs = torch.softmax(policy.actor(obs["state"][:1]), -1)[0].detach()
    freq = torch.bincount(out.action, minlength=3).float() / 60_000
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)  # 4+ sigma at n = 60k
    torch.testing.assert_close(out.log_prob, policy.evaluate(obs, out.action).log_prob)
    greedy = policy.act(obs, deterministic=True).action
    assert bool((greedy == 0).all())


CARTPOLE_OBS = gym.spaces.Dict({"state": gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)})


def _with(base: TrajectoryChunk, **changes: object) -> TrajectoryChunk:
    fields = {name: getattr(base, name) for name in base.__struct_fields__}
    return TrajectoryChunk(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({}, None),
        ({"rewards": np.ones(3, np.float32)}, r"log_probs: float32\[4\], expected \[3\]"),
        ({"rewards": np.array([1, np.nan, 1, 1], np.float32)}, "rewards: not finite"),
        ({"values": np.full(4, np.inf, np.float32)}, "values: not finite"),
        ({"bootstrap_value": float("nan")}, "bootstrap_value: not finite"),
        # finite, but its square overflows float32: would zero every other advantage
        ({"rewards": np.array([1, 1e30, 1, 1], np.float32)}, "rewards: magnitude 1e.30, over"),
        ({"values": np.full(4, -2e6, np.float32)}, "values: magnitude 2e.06, over 1e.06"),
        ({"bootstrap_value": 1e20}, "bootstrap_value: magnitude 1e.20"),
        ({"log_probs": np.array([-1e7, -1, -1, -1], np.float32)}, "log_probs: magnitude"),
        ({"rewards": np.array([1, -1e5, 1e5, 1], np.float32)}, None),  # large, not absurd
        ({"obs": {"state": np.full((4, 4), 1e12, np.float32)}}, r"obs\['state'\]: magnitude"),
        ({"terminated": np.zeros(4, np.float32)}, "terminated: float32"),
        # above its own number it would give up chunks not pushed yet
        ({"chunk_id": 5, "resend_from": 6}, r"resend_from: 6, expected -1 to chunk_id \(5\)"),
        ({"resend_from": -2}, "resend_from: -2"),
        ({"chunk_id": 5, "resend_from": 5}, None),
        ({"policy_versions": np.zeros(0, np.int64)}, r"policy_versions: int64\[0\]"),
        ({"obs": {"state": np.zeros((4, 7), np.float32)}}, r"obs\['state'\]: float32\[4, 7\]"),
        ({"obs": {"state": np.full((4, 4), np.nan, np.float32)}}, r"obs\['state'\]: not finite"),
        ({"obs": {"state": np.zeros((4, 4), np.float32), "x": np.zeros(4)}}, "obs: keys"),
        ({"actions": np.array([0, 1, 7, 0])}, r"actions: values 0..7 outside \[0, 2\)"),
        ({"actions": np.array([0, -1, 1, 0])}, r"actions: values -1..1 outside"),
        ({"actions": np.zeros(4, np.float32)}, "actions: expected integers"),
        ({"actions": np.zeros((4, 1), np.int64)}, r"actions: shape \[4, 1\], expected \[4\]"),
        ({"log_probs": np.array([0.5, -1, -1, -1], np.float32)}, "log_probs: 0.5 above 0"),
        ({"log_probs": np.array([1e-6, 0, -1, -1], np.float32)}, None),  # float32 rounding
    ],
)
def test_chunk_check_names_what_would_break_training(changes, problem) -> None:
    from rlvla3.algo.chunk_check import chunk_problem

    policy = MLPPolicy(4, gym.spaces.Discrete(2))
    found = chunk_problem(
        _with(chunk([1, 1, 1, 1]), **changes), CARTPOLE_OBS, policy.action_spec(), chunk_len=4
    )
    if problem is None:
        assert found is None
    else:
        assert found is not None and re.match(problem, found), found


def test_continuous_actions_must_be_finite_and_of_sane_magnitude() -> None:
    from rlvla3.algo.chunk_check import chunk_problem
    from rlvla3.policy.base import ActionSpec

    spec = ActionSpec(shape=(2,))
    base = chunk([1, 1, 1, 1])

    def problem(actions: np.ndarray) -> str | None:
        return chunk_problem(_with(base, actions=actions), CARTPOLE_OBS, spec, chunk_len=4)

    assert problem(np.full((4, 2), -3.5, np.float32)) is None  # outside [-1, 1]: a sample
    assert problem(np.full((4, 2), np.inf, np.float32)) == "actions: not finite"
    assert problem(np.full((4, 2), 1e30, np.float32)) == "actions: magnitude 1e+30, over 1e+06"
    assert problem(np.zeros((4, 2), np.int64)) == "actions: expected finite floats, got int64"


def test_a_chunk_longer_than_chunk_len_is_refused() -> None:
    """Consistent, but one step over ``env.chunk_len``: refused, naming the field."""
    from rlvla3.algo.chunk_check import chunk_problem

    spec = MLPPolicy(4, gym.spaces.Discrete(2)).action_spec()
    assert chunk_problem(chunk([1] * 4), CARTPOLE_OBS, spec, chunk_len=4) is None
    found = chunk_problem(chunk([1] * 5), CARTPOLE_OBS, spec, chunk_len=4)
    assert found == "rewards: 5 steps, over env.chunk_len=4"


def test_a_nan_minibatch_leaves_the_weights_finite() -> None:
    from rlvla3.algo.ppo import ppo_update

    policy = MLPPolicy(4, gym.spaces.Discrete(2))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    good = build_batch([chunk([0] * 8)], policy, AlgoConfig(), torch.device("cpu"))
    bad = {**good, "advantages": torch.full_like(good["advantages"], float("nan"))}
    before = [p.detach().clone() for p in policy.parameters()]
    metrics = ppo_update(
        policy,
        opt,
        bad,
        epochs=1,
        minibatch_size=4,
        clip_coef=0.2,
        vf_coef=0.5,
        ent_coef=0.0,
        max_grad_norm=0.5,
    )
    assert metrics["skipped_minibatches"] == 2
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
    metrics = ppo_update(
        policy,
        opt,
        good,
        epochs=1,
        minibatch_size=4,
        clip_coef=0.2,
        vf_coef=0.5,
        ent_coef=0.0,
        max_grad_norm=0.5,
    )
    assert metrics["skipped_minibatches"] == 0
    assert all(torch.isfinite(p).all() for p in policy.parameters())


def test_token_ids_outside_their_space_are_refused_and_an_image_is_not_scanned() -> None:
    """An instruction's token ids index an embedding: one out of its Box's range would crash
    the policy's forward on a rollout server or in the trainer."""
    from rlvla3.algo.chunk_check import obs_problem

    space = gym.spaces.Dict(
        {
            "image": gym.spaces.Box(0, 255, (2, 2, 3), np.uint8),
            "instruction": gym.spaces.Box(0, 256, (3,), np.int32),
        }
    )
    obs = {
        "image": np.full((2, 2, 3), 255, np.uint8),
        "instruction": np.array([1, 256, 0], np.int32),
    }
    assert obs_problem(obs, space) is None
    for bad in ([1, 300, 0], [-7, 1, 2], [2**31 - 1, 0, 0]):
        obs["instruction"] = np.array(bad, np.int32)
        found = obs_problem(obs, space)
        assert found is not None and found.startswith("obs['instruction']: values"), found
        assert "outside the space's [0, 256]" in found


def test_a_chunk_claiming_a_version_from_the_future_is_never_kept() -> None:
    """Staleness is taken from the oldest step, but a newer step than the trainer's version
    (a bookkeeping bug, or a forged chunk) makes the whole chunk one from the future."""
    from rlvla3.algo.batch import chunk_staleness, keep_chunk

    c = _with(chunk([1, 1, 1, 1]), policy_versions=np.array([5, 5, 6, 2**62], np.int64))
    assert chunk_staleness(c, 7) < 0
    assert not keep_chunk(chunk_staleness(c, 7), max_staleness=4, on_policy_only=False)
    ok = _with(chunk([1, 1, 1, 1]), policy_versions=np.array([5, 5, 6, 7], np.int64))
    assert chunk_staleness(ok, 7) == 2
