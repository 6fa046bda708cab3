"""PPO maths (GAE, V-trace, the clipped loss), the MLP policy, and one update step."""

from __future__ import annotations

import copy
import math

import gymnasium as gym
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvla3.algo.advantages import (
    compute_gae,
    normalize_advantages,
    truncated_importance_weights,
    vtrace,
)
from rlvla3.algo.ppo import ppo_loss, ppo_update, reference_kl
from rlvla3.policy.mlp import MLPPolicy

torch.set_num_threads(1)

REWARDS = torch.tensor([1.0, 2.0, 3.0])
VALUES = torch.tensor([0.5, 1.0, 1.5])
GAMMA, LAM = 0.9, 0.8


def close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------


def test_gae_hand_computed_bootstrapped():
    # deltas: 1 + .9*1 - .5 = 1.4 ; 2 + .9*1.5 - 1 = 2.35 ; 3 + .9*2 - 1.5 = 3.3
    # A2 = 3.3 ; A1 = 2.35 + .72*3.3 = 4.726 ; A0 = 1.4 + .72*4.726 = 4.80272
    adv, ret = compute_gae(REWARDS, VALUES, 2.0, GAMMA, LAM)
    close(adv, [4.80272, 4.726, 3.3])
    close(ret, [5.30272, 5.726, 4.8])


def test_gae_terminated_chunk_bootstraps_zero():
    # last delta: 3 + 0 - 1.5 = 1.5 ; A1 = 2.35 + .72*1.5 = 3.43 ; A0 = 1.4 + .72*3.43 = 3.8696
    adv, ret = compute_gae(REWARDS, VALUES, 0.0, GAMMA, LAM)
    close(adv, [3.8696, 3.43, 1.5])
    close(ret, [4.3696, 4.43, 3.0])
    # A done on the last step ignores whatever bootstrap value is passed.
    adv_done, _ = compute_gae(REWARDS, VALUES, 2.0, GAMMA, LAM, dones=torch.tensor([0, 0, 1]))
    close(adv_done, [3.8696, 3.43, 1.5])


def test_gae_truncated_chunk_bootstraps_final_value():
    # Truncated (or cut by length): bootstrap from V(final obs); a tensor scalar works too.
    adv, _ = compute_gae(REWARDS, VALUES, torch.tensor(2.0), GAMMA, LAM)
    close(adv, [4.80272, 4.726, 3.3])


def test_gae_done_mid_chunk_stops_bootstrap_and_trace():
    # done at t=1: delta1 = 2 - 1 = 1, A1 = 1 (no carry from t=2); A0 = 1.4 + .72*1 = 2.12
    dones = torch.tensor([False, True, False])
    adv, _ = compute_gae(REWARDS, VALUES, 2.0, GAMMA, LAM, dones=dones)
    close(adv, [2.12, 1.0, 3.3])


@settings(max_examples=30, deadline=None)
@given(
    rewards=st.lists(st.floats(-5, 5), min_size=1, max_size=8),
    bootstrap=st.floats(-5, 5),
    gamma=st.floats(0.0, 1.0),
)
def test_gae_lambda_one_is_discounted_return(rewards, bootstrap, gamma):
    r = torch.tensor(rewards, dtype=torch.float64)
    v = torch.linspace(-1.0, 1.0, len(rewards), dtype=torch.float64)
    _, ret = compute_gae(r, v, bootstrap, gamma, 1.0)
    expected, acc = [], bootstrap
    for reward in reversed(rewards):
        acc = reward + gamma * acc
        expected.append(acc)
    torch.testing.assert_close(ret, torch.tensor(expected[::-1], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# V-trace and importance weights
# ---------------------------------------------------------------------------------------------


def test_vtrace_on_policy_equals_n_step_returns():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    log_probs = -torch.rand(6, generator=gen)
    vs, pg_adv = vtrace(log_probs, log_probs, rewards, values, 0.7, 0.95)
    adv, ret = compute_gae(rewards, values, 0.7, 0.95, lam=1.0)
    torch.testing.assert_close(vs, ret)
    torch.testing.assert_close(pg_adv, adv)
    # The same holds with a done mid-chunk (no bootstrap across it).
    dones = torch.tensor([False, False, True, False, False, False])
    vs, pg_adv = vtrace(log_probs, log_probs, rewards, values, 0.7, 0.95, dones=dones)
    adv, ret = compute_gae(rewards, values, 0.7, 0.95, lam=1.0, dones=dones)
    torch.testing.assert_close(vs, ret)
    torch.testing.assert_close(pg_adv, adv)


def test_vtrace_hand_computed_with_truncation():
    # ratios 0.5 => rho = c = 0.5 ; gamma = 1, V = 0, bootstrap 1:
    # vs1 = 0.5*(1 + 1) = 1 ; vs0 = 0.5*(1 + 0) + 0.5*(vs1 - V1) = 1
    # pg1 = 0.5*(1 + 1) = 1 ; pg0 = 0.5*(1 + vs1) = 1
    behaviour = torch.zeros(2)
    target = torch.full((2,), math.log(0.5))
    vs, pg = vtrace(behaviour, target, torch.ones(2), torch.zeros(2), 1.0, 1.0)
    close(vs, [1.0, 1.0])
    close(pg, [1.0, 1.0])
    # ratio 2 with rho_bar = 1: the weight is clipped to 1, same as on-policy.
    vs2, _ = vtrace(behaviour, -target, torch.ones(2), torch.zeros(2), 1.0, 1.0)
    close(vs2, [3.0, 2.0])


def test_truncated_importance_weights():
    behaviour = torch.zeros(3)
    target = torch.tensor([math.log(2.0), math.log(0.5), 0.0], requires_grad=True)
    w = truncated_importance_weights(behaviour, target, clip=1.0)
    close(w, [1.0, 0.5, 1.0])
    assert not w.requires_grad


def test_normalize_advantages():
    adv = normalize_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert abs(adv.mean().item()) < 1e-6
    assert abs(adv.std().item() - 1.0) < 1e-5
    close(normalize_advantages(torch.tensor([4.0])), [0.0])


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------

LOSS_KW = dict(clip_coef=0.2, vf_coef=0.5, ent_coef=0.01)


def _loss_inputs():
    new_lp = torch.tensor([math.log(1.5), math.log(0.5), 0.0], requires_grad=True)
    return dict(
        new_log_probs=new_lp,
        old_log_probs=torch.zeros(3),
        advantages=torch.tensor([1.0, -2.0, 0.5]),
        new_values=torch.tensor([1.0, 2.0, 3.0]),
        returns=torch.tensor([1.5, 2.0, 2.0]),
        entropy=torch.full((3,), 0.6),
    )


def test_ppo_loss_hand_computed_with_clipping():
    inputs = _loss_inputs()
    loss, m = ppo_loss(**inputs, **LOSS_KW)
    # ratio 1.5, A=+1: max(-1.5, -1.2) = -1.2 ; ratio 0.5, A=-2: max(1.0, 1.6) = 1.6 ;
    # ratio 1, A=.5: -0.5  =>  policy loss = (-1.2 + 1.6 - 0.5)/3 = -0.033333
    assert m["policy_loss"] == pytest.approx(-0.1 / 3, abs=1e-6)
    # value: 0.5 * mean(0.25, 0, 1) = 0.208333
    assert m["value_loss"] == pytest.approx(1.25 / 6, abs=1e-6)
    assert m["entropy"] == pytest.approx(0.6)
    assert loss.item() == pytest.approx(-0.1 / 3 + 0.5 * 1.25 / 6 - 0.01 * 0.6, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    kl = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 3
    assert m["approx_kl"] == pytest.approx(kl, abs=1e-6)
    # Clipped samples get no policy gradient; the unclipped one gets -A * ratio / N.
    loss.backward()
    close(inputs["new_log_probs"].grad, [0.0, 0.0, -0.5 / 3])


def test_ppo_loss_is_weights_and_value_clipping():
    inputs = _loss_inputs()
    _, m = ppo_loss(**inputs, **LOSS_KW, is_weights=torch.tensor([1.0, 0.5, 1.0]))
    assert m["policy_loss"] == pytest.approx((-1.2 + 0.8 - 0.5) / 3, abs=1e-6)
    # old values [0, 2, 2.5] -> clipped [0.2, 2, 2.7]; max errs (1.69, 0, 1) -> 0.5 * 2.69 / 3
    old_values = torch.tensor([0.0, 2.0, 2.5])
    _, m = ppo_loss(**inputs, **LOSS_KW, old_values=old_values, clip_vloss=True)
    assert m["value_loss"] == pytest.approx(0.5 * 2.69 / 3, abs=1e-6)
    with pytest.raises(ValueError):
        ppo_loss(**inputs, **LOSS_KW, clip_vloss=True)


# ---------------------------------------------------------------------------------------------
# The MLP policy
# ---------------------------------------------------------------------------------------------

SPACES = [gym.spaces.Discrete(3), gym.spaces.Box(-1.0, 1.0, shape=(2,))]


@pytest.mark.parametrize("space", SPACES, ids=["discrete", "box"])
def test_mlp_policy_shapes_and_log_prob_roundtrip(space):
    torch.manual_seed(0)
    policy = MLPPolicy(5, space, hidden_sizes=(16, 16))
    obs = {"state": torch.randn(7, 5)}
    out = policy.act(obs)
    if isinstance(space, gym.spaces.Discrete):
        assert out.action.shape == (7,) and out.action.dtype == torch.int64
        assert int(out.action.max()) < 3
    else:
        assert out.action.shape == (7, 2) and out.action.dtype == torch.float32
    assert out.log_prob.shape == (7,) and out.value.shape == (7,)
    ev = policy.evaluate(obs, out.action)
    torch.testing.assert_close(ev.log_prob, out.log_prob)
    torch.testing.assert_close(ev.value, out.value)
    assert ev.entropy.shape == (7,) and bool((ev.entropy > 0).all())
    det = policy.act(obs, deterministic=True)
    assert det.action.shape == out.action.shape


def test_mlp_policy_gaussian_sums_log_prob_and_inits_small():
    policy = MLPPolicy(3, gym.spaces.Box(-2.0, 2.0, shape=(4,)))
    obs = {"state": torch.randn(5, 3)}
    action = torch.randn(5, 4)
    mean = policy.actor(obs["state"])
    expected = torch.distributions.Normal(mean, 1.0).log_prob(action).sum(-1)
    torch.testing.assert_close(policy.evaluate(obs, action).log_prob, expected)
    # Orthogonal init with gain 0.01 on the policy output: near-uniform / near-zero-mean start.
    assert policy.actor[-1].weight.abs().max() < 0.05
    # The env gets actions clipped to the box; the state dict holds weights only.
    clipped = policy.to_env_action(torch.tensor([[-3.0, 0.5, 3.0, -2.0]]))
    close(clipped, [[-2.0, 0.5, 2.0, -2.0]])
    assert set(policy.state_dict()) == {"log_std"} | {
        f"{net}.{i}.{p}"
        for net in ("actor", "critic")
        for i in (0, 2, 4)
        for p in ("weight", "bias")
    }
    with pytest.raises(TypeError):
        MLPPolicy(3, gym.spaces.MultiBinary(2))


# ---------------------------------------------------------------------------------------------
# One update
# ---------------------------------------------------------------------------------------------


def _fixed_batch(policy: MLPPolicy, n: int = 64) -> dict:
    gen = torch.Generator().manual_seed(1)
    obs = {"state": torch.randn(n, 4, generator=gen)}
    return acted_batch(policy, obs, gen)


def acted_batch(policy, obs: dict, gen: torch.Generator) -> dict:
    """A PPO batch of ``obs`` acted by ``policy``, random advantages drawn from ``gen``."""
    with torch.no_grad():
        out = policy.act(obs)
    advantages = torch.randn(len(out.action), generator=gen)
    return {
        "obs": obs,
        "actions": out.action,
        "log_probs": out.log_prob,
        "values": out.value,
        "advantages": advantages,
        "returns": out.value + advantages,
    }


def test_ppo_update_reduces_loss_on_fixed_batch():
    torch.manual_seed(0)
    policy = MLPPolicy(4, gym.spaces.Discrete(2), hidden_sizes=(32, 32))
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    batch = _fixed_batch(policy)
    kw = dict(epochs=1, minibatch_size=64, max_grad_norm=0.5, **LOSS_KW)
    first = ppo_update(policy, optimizer, batch, **kw)
    second = ppo_update(policy, optimizer, batch, **kw)
    assert second["loss"] < first["loss"]
    assert first["approx_kl"] == pytest.approx(0.0, abs=1e-6)  # ratio is exactly 1 at first
    assert first["num_minibatches"] == 1.0


def test_ppo_update_minibatch_count_and_is_weights():
    torch.manual_seed(0)
    policy = MLPPolicy(4, gym.spaces.Discrete(2), hidden_sizes=(8,))
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    batch = _fixed_batch(policy, n=10)
    batch["is_weights"] = torch.full((10,), 0.5)
    kw = dict(epochs=2, minibatch_size=4, max_grad_norm=0.5, **LOSS_KW)
    metrics = ppo_update(policy, optimizer, batch, **kw)
    assert metrics["num_minibatches"] == 6.0 and metrics["num_epochs"] == 2.0
    for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac", "grad_norm"):
        assert math.isfinite(metrics[key])
    # target_kl = 0 stops after the first minibatch whose KL is positive.
    metrics = ppo_update(policy, optimizer, batch, **kw, target_kl=0.0)
    assert metrics["num_minibatches"] < 6.0


def test_value_warmup_leaves_the_actor_untouched():
    """``policy_coef=0`` (the trainer's ``algo.value_warmup_updates``) trains the critic only."""
    torch.manual_seed(0)
    policy = MLPPolicy(4, gym.spaces.Discrete(2), hidden_sizes=(8,))
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    actor = {k: v.clone() for k, v in policy.state_dict().items() if k.startswith("actor")}
    critic = {k: v.clone() for k, v in policy.state_dict().items() if k.startswith("critic")}
    kw = dict(epochs=2, minibatch_size=32, max_grad_norm=0.5, **LOSS_KW)
    ppo_update(policy, optimizer, _fixed_batch(policy), policy_coef=0.0, **kw)
    state = policy.state_dict()
    assert all(torch.equal(state[k], v) for k, v in actor.items())
    assert not all(torch.equal(state[k], v) for k, v in critic.items())


def test_reference_kl_pulls_the_policy_back_to_the_reference():
    """With ``ref_kl_coef`` and no advantage signal, updates move the policy towards the frozen
    reference: its KL to the reference falls. A reference equal to the policy costs nothing."""
    torch.manual_seed(0)
    reference = MLPPolicy(4, gym.spaces.Discrete(3), hidden_sizes=(16,)).requires_grad_(False)
    reference.actor[-1].weight.mul_(200)  # peaked, so far from the near-uniform new policy
    policy = MLPPolicy(4, gym.spaces.Discrete(3), hidden_sizes=(16,))
    batch = _fixed_batch(policy)
    batch["advantages"] = torch.zeros_like(batch["advantages"])  # no reward signal at all
    kw = dict(
        epochs=1, minibatch_size=64, max_grad_norm=10.0, clip_coef=0.2, vf_coef=0.0, ent_coef=0.0
    )
    twin = copy.deepcopy(reference).requires_grad_(True)
    same = ppo_update(
        twin,
        torch.optim.SGD(twin.parameters(), lr=0.0),
        batch,
        reference=reference,
        ref_kl_coef=1.0,
        **kw,
    )
    assert same["ref_kl"] == pytest.approx(0.0, abs=1e-7)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    first = ppo_update(policy, optimizer, batch, reference=reference, ref_kl_coef=1.0, **kw)
    for _ in range(30):
        last = ppo_update(policy, optimizer, batch, reference=reference, ref_kl_coef=1.0, **kw)
    assert first["ref_kl"] > 0.01
    assert last["ref_kl"] < 0.2 * first["ref_kl"]
    no_ref = ppo_update(policy, optimizer, batch, reference=reference, ref_kl_coef=0.0, **kw)
    assert "ref_kl" not in no_ref  # coefficient 0: the reference is not even evaluated


def test_ref_kl_coef_needs_an_init_checkpoint():
    from rlvla3.config.run_config import load_config
    from rlvla3.config.typed_load import ConfigError

    with pytest.raises(ConfigError, match="algo.ref_kl_coef: needs policy.init_checkpoint"):
        load_config(None, ["algo.ref_kl_coef=0.5"])
    cfg = load_config(None, ["algo.ref_kl_coef=0.5", "policy.init_checkpoint=runs/sft"])
    assert cfg.algo.ref_kl_coef == 0.5


def test_reference_kl_holds_a_shared_trunk_during_value_warmup():
    """Critic-only updates (``policy_coef=0``) through a trunk shared with the actor move the
    actor too; the KL term still applies then and keeps it near the reference."""
    torch.manual_seed(0)

    class SharedTrunk(MLPPolicy):  # actor and critic read the same first layer, as in the VLA
        def __init__(self) -> None:
            super().__init__(4, gym.spaces.Discrete(3), hidden_sizes=(16,))
            self.critic[0] = self.actor[0]
            with torch.no_grad():  # a confident actor, whose output the trunk really drives
                self.actor[-1].weight.mul_(100)

    def drift(ref_kl_coef: float) -> float:
        torch.manual_seed(1)
        policy = SharedTrunk()
        reference = copy.deepcopy(policy).requires_grad_(False)
        batch = _fixed_batch(policy)
        batch["returns"] = batch["values"] + 5 * torch.randn_like(batch["values"])
        optimizer = torch.optim.Adam(policy.parameters(), lr=3e-2)
        kw = dict(
            epochs=4,
            minibatch_size=16,
            max_grad_norm=10.0,
            clip_coef=0.2,
            vf_coef=1.0,
            ent_coef=0.0,
            policy_coef=0.0,
        )
        for _ in range(10):
            ppo_update(policy, optimizer, batch, reference=reference, ref_kl_coef=ref_kl_coef, **kw)
        with torch.no_grad():
            new = policy.evaluate(batch["obs"], batch["actions"]).log_prob
            ref = reference.evaluate(batch["obs"], batch["actions"]).log_prob
        return float(reference_kl(new, ref))

    assert drift(ref_kl_coef=10.0) < 0.5 * drift(ref_kl_coef=0.0)
