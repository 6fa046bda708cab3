"""PPO with off-policy corrections, written to read top to bottom like cleanrl's ``ppo.py``.

The trainer receives trajectory *chunks*: up to T consecutive steps of one env, cut at episode
ends, each step tagged with the behaviour policy's log-prob and value. From a chunk come
advantages and returns (``rlvla3/algo/advantages.py``: GAE, or V-trace for lagged data), many
chunks are flattened into one batch (``rlvla3/algo/batch.py``), and ``ppo_update`` trains on it.
Rollouts may be one or two policy versions stale, so the clipped surrogate is taken against the
*behaviour* log-probs, which is exactly the ratio that corrects for the lag; truncated importance
weights and V-trace are the optional extras.

Every function here is pure torch and works on CPU tensors; nothing here knows about networking.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from rlvla3.algo.advantages import normalize_advantages
from rlvla3.algo.data_parallel import DataParallel
from rlvla3.policy.base import ActorCritic

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_coef: float, is_weights: Tensor | None
) -> Tensor:
    """Scalar ``mean(w * max(-A r, -A clip(r, 1 - eps, 1 + eps)))`` over float32[N] inputs."""
    pg_losses = torch.max(
        -advantages * ratio, -advantages * ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef)
    )
    if is_weights is not None:
        pg_losses = pg_losses * is_weights.detach()
    return pg_losses.mean()


def _value_loss(
    new_values: Tensor, returns: Tensor, old_values: Tensor | None, clip_coef: float
) -> Tensor:
    """Scalar ``0.5 * mean((V - R)^2)``; cleanrl's clipped variant when ``old_values`` is given."""
    v_losses = (new_values - returns) ** 2
    if old_values is not None:
        v_clipped = old_values + (new_values - old_values).clamp(-clip_coef, clip_coef)
        v_losses = torch.max(v_losses, (v_clipped - returns) ** 2)
    return 0.5 * v_losses.mean()


def ppo_loss(
    new_log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    new_values: Tensor,
    returns: Tensor,
    entropy: Tensor,
    *,
    clip_coef: float,
    vf_coef: float,
    ent_coef: float,
    old_values: Tensor | None = None,
    clip_vloss: bool = False,
    is_weights: Tensor | None = None,
    policy_coef: float = 1.0,
) -> tuple[Tensor, dict[str, float]]:
    """The PPO-clip objective, as a loss to minimise.

    ``loss = policy_coef * (policy_loss - ent_coef * mean(entropy)) + vf_coef * value_loss``, where
    ``policy_loss = mean(w * max(-A r, -A clip(r, 1-eps, 1+eps)))`` with ``r = exp(new - old)``
    taken against the behaviour log-probs and ``w`` the optional per-sample ``is_weights``
    (1 if absent), and ``value_loss = 0.5 * mean((V - R)^2)`` (cleanrl's clipped variant when
    ``clip_vloss``, which needs ``old_values``).

    Args:
        new_log_probs: float32[N], log pi_theta(a|x), with grad.
        old_log_probs: float32[N], behaviour log-probs recorded at act time.
        advantages: float32[N], already normalised if wanted.
        new_values: float32[N], current critic output, with grad.
        returns: float32[N], value targets.
        entropy: float32[N], entropy of pi_theta(.|x), with grad.
        clip_coef: PPO ratio clip epsilon (also the value clip when ``clip_vloss``).
        vf_coef: value loss coefficient.
        ent_coef: entropy bonus coefficient.
        old_values: float32[N], behaviour values, only for ``clip_vloss``.
        clip_vloss: clip the value update around ``old_values``.
        is_weights: float32[N], optional per-sample weights on the policy loss (no grad).
        policy_coef: weight of the policy terms; 0 trains the critic alone (value warm-up).

    Returns:
        ``(loss, metrics)``: the scalar loss with grad, and floats ``loss``, ``policy_loss``,
        ``value_loss``, ``entropy``, ``approx_kl`` (the k3 estimator), ``clip_frac``.
    """
    if clip_vloss and old_values is None:
        raise ValueError("clip_vloss=True needs old_values")
    log_ratio = new_log_probs - old_log_probs
    ratio = log_ratio.exp()
    policy_loss = _clipped_surrogate(ratio, advantages, clip_coef, is_weights)
    value_loss = _value_loss(new_values, returns, old_values if clip_vloss else None, clip_coef)
    entropy_mean = entropy.mean()
    loss = policy_coef * (policy_loss - ent_coef * entropy_mean) + vf_coef * value_loss
    with torch.no_grad():
        approx_kl = ((ratio - 1.0) - log_ratio).mean()
        clip_frac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    metrics = {
        "loss": loss.item(),
        "policy_loss": policy_loss.item(),
        "value_loss": value_loss.item(),
        "entropy": entropy_mean.item(),
        "approx_kl": approx_kl.item(),
        "clip_frac": clip_frac.item(),
    }
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# The update
# ---------------------------------------------------------------------------------------------


def _index_batch(batch: dict[str, object], idx: Tensor) -> dict[str, object]:
    """Rows ``idx`` of every tensor in ``batch`` (recursing into the ``obs`` dict)."""
    out: dict[str, object] = {}
    for key, value in batch.items():
        out[key] = _index_batch(value, idx) if isinstance(value, dict) else value[idx]
    return out


def frozen_reference(policy: ActorCritic, state: dict[str, Tensor] | None = None) -> ActorCritic:
    """A frozen copy of ``policy`` (eval mode, no gradients), with ``state``'s weights if given:
    the reference policy of ``reference_kl``."""
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if state is not None:
        reference.load_state_dict(state)
    return reference


def reference_kl(new_log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """Scalar estimate of KL(pi_theta || pi_ref) from actions the policy took (k3 estimator:
    ``mean((r - 1) - log r)`` with ``r = pi_ref(a) / pi_theta(a)``; unbiased, never negative).

    The actions come from the behaviour policy, a version or two behind ``pi_theta``: close
    enough for a regulariser. Gradients flow through ``new_log_probs`` only.
    """
    log_r = ref_log_probs.detach() - new_log_probs
    return (log_r.exp() - 1.0 - log_r).mean()


def _minibatch_loss(
    policy: ActorCritic,
    mb: dict[str, object],
    *,
    reference: ActorCritic | None = None,
    ref_kl_coef: float = 0.0,
    **loss_kwargs: object,
) -> tuple[Tensor, dict[str, float]]:
    """Re-evaluate the policy on one minibatch and return ``ppo_loss`` for it (plus
    ``ref_kl_coef * reference_kl`` when a reference policy is given)."""
    out = policy.evaluate(mb["obs"], mb["actions"])
    loss, metrics = ppo_loss(
        out.log_prob,
        mb["log_probs"],
        mb["advantages"],
        out.value,
        mb["returns"],
        out.entropy,
        old_values=mb["values"],
        is_weights=mb.get("is_weights"),
        **loss_kwargs,
    )
    if out.aux_loss is not None:
        aux = out.aux_loss.mean()
        loss = loss + aux
        metrics["aux_loss"] = aux.item()
        metrics["loss"] = loss.item()
    if reference is not None:
        with torch.no_grad():
            ref_log_probs = reference.evaluate(mb["obs"], mb["actions"]).log_prob
        kl = reference_kl(out.log_prob, ref_log_probs)
        # Not scaled by policy_coef: during a critic-only warm-up the value loss still moves a
        # trunk shared with the actor (the VLA's), and the KL term is what holds the actor.
        loss = loss + ref_kl_coef * kl
        metrics["ref_kl"] = kl.item()
        metrics["loss"] = loss.item()
    return loss, metrics


def _item(value: Tensor) -> float:
    """A scalar's value; a sharded policy's gradient norm is a ``DTensor``, whole on every rank."""
    return float(value.full_tensor().item() if hasattr(value, "full_tensor") else value.item())


def _minibatch_kl(
    metrics: dict[str, float], weight: float, data_parallel: DataParallel | None
) -> float:
    """The minibatch's approx_kl. A training group agrees on it (its slices' values weighted by
    their shares, all-reduced), so that every rank stops at the same minibatch."""
    kl = metrics.get("approx_kl", 0.0)
    return kl if data_parallel is None else data_parallel.mean_over_ranks(kl, weight)


def explained_variance(values: Tensor, returns: Tensor) -> float:
    """1 - Var(R - V) / Var(R) for float32[N] tensors (nan when Var(R) = 0)."""
    var_returns = returns.var()
    if var_returns.item() == 0.0:
        return float("nan")
    return (1.0 - (returns - values).var() / var_returns).item()


def ppo_update(
    policy: ActorCritic,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, Tensor | dict[str, Tensor]],
    *,
    epochs: int,
    minibatch_size: int,
    clip_coef: float,
    vf_coef: float,
    ent_coef: float,
    max_grad_norm: float,
    norm_adv: bool = True,
    clip_vloss: bool = False,
    target_kl: float | None = None,
    generator: torch.Generator | None = None,
    policy_coef: float = 1.0,
    reference: ActorCritic | None = None,
    ref_kl_coef: float = 0.0,
    data_parallel: DataParallel | None = None,
) -> dict[str, float]:
    """Run ``epochs`` passes of shuffled minibatch PPO updates over one flat batch.

    Args:
        policy: the ``ActorCritic`` being trained (put in train mode by the caller if it matters).
        optimizer: optimizer over ``policy.parameters()``.
        batch: ``obs`` (dict of tensors [N, ...]), ``actions`` ([N] or [N, D]), ``log_probs``
            (float32[N], behaviour), ``advantages`` (float32[N]), ``returns`` (float32[N]),
            ``values`` (float32[N], behaviour), optional ``is_weights`` (float32[N]).
        epochs: passes over the batch.
        minibatch_size: samples per gradient step (the last minibatch of a pass may be smaller).
        clip_coef, vf_coef, ent_coef, clip_vloss: see ``ppo_loss``.
        max_grad_norm: global gradient-norm clip.
        norm_adv: normalise advantages per minibatch.
        target_kl: stop the remaining epochs once a minibatch's approx_kl exceeds this.
        generator: RNG for the shuffles, for reproducibility.
        policy_coef: see ``ppo_loss`` (0: update the critic only).
        reference: a frozen policy; with ``ref_kl_coef`` > 0 the loss adds
            ``ref_kl_coef * reference_kl`` (metric ``ref_kl``), also when ``policy_coef`` is 0.
        data_parallel: the training group's ranks share each minibatch
            (``rlvla3/algo/data_parallel.py``); every rank must call with the same ``batch``
            and ``generator`` state. The metrics are this rank's slice's; with ``target_kl``
            the ranks agree on each minibatch's approx_kl (one small all-reduce).

    Returns:
        The metrics of ``ppo_loss`` plus ``grad_norm`` averaged over minibatches, and
        ``explained_variance`` (of the behaviour values), ``num_minibatches``, ``num_epochs``,
        ``skipped_minibatches`` (non-finite gradients: no optimizer step, not averaged in).
    """
    n = batch["advantages"].shape[0]
    totals: dict[str, float] = {}
    num_minibatches, num_epochs, skipped, stop = 0, 0, 0, False
    while num_epochs < epochs and not stop:
        num_epochs += 1
        for idx in torch.randperm(n, generator=generator).split(minibatch_size):
            mb = _index_batch(batch, idx)
            if norm_adv:  # over the whole minibatch, also when ranks share it
                mb["advantages"] = normalize_advantages(mb["advantages"])
            weight = 1.0
            if data_parallel is not None:  # this rank's slice of the minibatch
                positions, weight = data_parallel.share(len(idx))
                mb = _index_batch(mb, positions)
            optimizer.zero_grad(set_to_none=True)
            metrics: dict[str, float] = {}
            if len(mb["advantages"]):  # (a rank's slice of a short last minibatch may be empty)
                loss, metrics = _minibatch_loss(
                    policy,
                    mb,
                    clip_coef=clip_coef,
                    vf_coef=vf_coef,
                    ent_coef=ent_coef,
                    clip_vloss=clip_vloss,
                    policy_coef=policy_coef,
                    reference=reference if ref_kl_coef > 0 else None,
                    ref_kl_coef=ref_kl_coef,
                )
                if data_parallel is not None:
                    loss = data_parallel.weigh_loss(loss, weight)
                loss.backward()
            if data_parallel is not None:
                params = [p for p in policy.parameters() if p.requires_grad]
                data_parallel.reduce_gradients(params, weight=weight)
            grad_norm = _item(nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm))
            if not math.isfinite(grad_norm):  # one NaN step would make every weight NaN for good
                skipped += 1
                continue
            optimizer.step()
            metrics["grad_norm"] = grad_norm
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
            num_minibatches += 1
            if target_kl is not None and _minibatch_kl(metrics, weight, data_parallel) > target_kl:
                stop = True
                break
    result = {key: value / max(num_minibatches, 1) for key, value in totals.items()}
    result["explained_variance"] = explained_variance(batch["values"], batch["returns"])
    result["num_minibatches"] = float(num_minibatches)
    result["num_epochs"] = float(num_epochs)
    result["skipped_minibatches"] = float(skipped)
    return result
