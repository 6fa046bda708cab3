"""The MLP policy's numpy serving path (``act_numpy``) against its torch ``act``/``evaluate``.

Tolerance: float32 arithmetic in a different order, atol 1e-5 on log-probs and values.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlvla3.policy.mlp import MLPPolicy
from transport.weights import FlatLayout

ATOL = 1e-5


def _states(n: int, dim: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def _evaluate(policy: MLPPolicy, states: np.ndarray, action: np.ndarray):
    with torch.no_grad():
        return policy.evaluate({"state": torch.from_numpy(states)}, torch.from_numpy(action))


def test_discrete_matches_torch_and_samples_the_softmax():
    torch.manual_seed(0)
    policy = MLPPolicy(4, gym.spaces.Discrete(3), hidden_sizes=(16,))
    with torch.no_grad():
        policy.actor[-1].weight.mul_(100)  # spread the probabilities so sampling is checkable
    states = _states(5, 4)
    rng = np.random.default_rng(1)
    greedy = policy.act_numpy({"state": states}, True, rng)
    with torch.no_grad():
        torch_greedy = policy.act({"state": torch.from_numpy(states)}, deterministic=True)
    np.testing.assert_array_equal(greedy.action, torch_greedy.action.numpy())
    assert greedy.env_action is greedy.action  # the rollout server then sends it only once
    ref = _evaluate(policy, states, greedy.action)
    np.testing.assert_allclose(greedy.log_prob, ref.log_prob.numpy(), atol=ATOL)
    np.testing.assert_allclose(greedy.value, ref.value.numpy(), atol=ATOL)

    one = np.repeat(states[:1], 20_000, axis=0)
    sampled = policy.act_numpy({"state": one}, False, rng)
    with torch.no_grad():
        probs = torch.softmax(policy.actor(torch.from_numpy(states[:1])), -1)[0].numpy()
    freq = np.bincount(sampled.action, minlength=3) / len(one)
    np.testing.assert_allclose(freq, probs, atol=0.015)  # ~5 standard errors at 20k samples
    np.testing.assert_allclose(sampled.log_prob, np.log(probs)[sampled.action], atol=ATOL)


def test_one_state_head_matches_torch_and_samples_the_softmax():
    """A single state takes the Python-float head (``sample_one_discrete``): the same greedy
    action and log-probabilities as torch, and draws from the same softmax."""
    torch.manual_seed(0)
    policy = MLPPolicy(4, gym.spaces.Discrete(3), hidden_sizes=(16,))
    with torch.no_grad():
        policy.actor[-1].weight.mul_(100)
    states = _states(5, 4)
    rng = np.random.default_rng(2)
    for state in states:
        one = state[None]
        greedy = policy.act_numpy({"state": one}, True, rng)
        with torch.no_grad():
            torch_greedy = policy.act({"state": torch.from_numpy(one)}, deterministic=True)
        np.testing.assert_array_equal(greedy.action, torch_greedy.action.numpy())
        assert greedy.action.shape == (1,) and greedy.action.dtype == np.int64
        ref = _evaluate(policy, one, greedy.action)
        np.testing.assert_allclose(greedy.log_prob, ref.log_prob.numpy(), atol=ATOL)
        np.testing.assert_allclose(greedy.value, ref.value.numpy(), atol=ATOL)
    one = states[:1]
    draws = [policy.act_numpy({"state": one}, False, rng) for _ in range(20_000)]
    actions = np.array([d.action[0] for d in draws])
    with torch.no_grad():
        probs = torch.softmax(policy.actor(torch.from_numpy(one)), -1)[0].numpy()
    np.testing.assert_allclose(np.bincount(actions, minlength=3) / len(actions), probs, atol=0.015)
    log_probs = np.array([d.log_prob[0] for d in draws])
    np.testing.assert_allclose(log_probs, np.log(probs)[actions], atol=ATOL)


def test_gaussian_log_prob_matches_evaluate_and_env_action_is_clipped():
    torch.manual_seed(0)
    space = gym.spaces.Box(-0.5, 0.5, (2,), np.float32)
    policy = MLPPolicy(3, space, hidden_sizes=(8, 8), activation="relu")
    with torch.no_grad():
        policy.log_std.fill_(0.3)
    states = _states(64, 3)
    out = policy.act_numpy({"state": states}, False, np.random.default_rng(2))
    ref = _evaluate(policy, states, out.action)
    np.testing.assert_allclose(out.log_prob, ref.log_prob.numpy(), atol=ATOL)
    np.testing.assert_allclose(out.value, ref.value.numpy(), atol=ATOL)
    assert (np.abs(out.action) > 0.5).any()  # some samples fall outside the box...
    np.testing.assert_array_equal(
        out.env_action, np.clip(out.action, -0.5, 0.5)
    )  # ...and are clipped
    mean = policy.act_numpy({"state": states}, True, np.random.default_rng(2)).action
    with torch.no_grad():
        np.testing.assert_allclose(mean, policy.actor(torch.from_numpy(states)).numpy(), atol=ATOL)


def _assert_matches_torch(policy: MLPPolicy, states: np.ndarray) -> None:
    out = policy.act_numpy({"state": states}, True, np.random.default_rng(0))
    ref = _evaluate(policy, states, out.action)
    np.testing.assert_allclose(out.value, ref.value.numpy(), atol=ATOL)
    np.testing.assert_allclose(out.log_prob, ref.log_prob.numpy(), atol=ATOL)


@pytest.mark.parametrize("batch", [1, 256], ids=["fused", "views"])
def test_follows_weights_written_in_place_and_rebinding(batch: int) -> None:
    # Small batches run on copies of the weights (fused actor and critic), large ones on
    # views: both must see every way a rollout server's weights change.
    policy = MLPPolicy(4, gym.spaces.Discrete(2))
    states = _states(batch, 4)
    _assert_matches_torch(policy, states)  # built on the original storage
    with torch.no_grad():
        policy.critic[0].weight.add_(1.0)  # an in-place update of one parameter
    _assert_matches_torch(policy, states)
    layout = FlatLayout.of(policy)
    flat = layout.bind(policy)  # parameters move into one flat buffer
    _assert_matches_torch(policy, states)
    flat.copy_(torch.randn(flat.numel()))  # a write into the buffer, as torch sees it
    _assert_matches_torch(policy, states)
    flat.numpy()[:] = np.random.default_rng(3).standard_normal(flat.numel())  # behind torch
    torch.autograd.graph.increment_version(flat)  # what recv_body does after a collective
    _assert_matches_torch(policy, states)


def test_no_numpy_path_for_gelu():
    policy = MLPPolicy(4, gym.spaces.Discrete(2), activation="gelu")
    assert policy.act_numpy({"state": _states(2, 4)}, False, np.random.default_rng(0)) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_numpy_path_on_gpu():
    policy = MLPPolicy(4, gym.spaces.Discrete(2)).cuda()
    assert policy.act_numpy({"state": _states(2, 4)}, False, np.random.default_rng(0)) is None
