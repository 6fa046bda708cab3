"""A token VLA at work in one process, each as a callable to time (``calls_per_s``): the bare
``transformers`` model's inference and training loops, the baselines of
``bench/token_vla_scale.py``, and what rlvla3 runs in their place (``TokenVLAPolicy.act``, the
trainer's PPO update through ``rlvla3/algo``).

The bare loops take the processor's batch pre-built and run the model alone, the least any
policy built on it must do: inference is one forward over the right-padded prompts with the KV
cache, then one single-token forward per further action token (argmax over the action tokens);
training is one teacher-forced forward over the prompts with the action tokens appended, the
summed action-token log-probs and a linear value head's MSE, backward, an Adam step over the
trainable parameters (LoRA's adapters and the head).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from rlvla3.algo.learners import build_learner
from rlvla3.algo.optim import build_optimizer
from rlvla3.config.run_config import Config
from rlvla3.policy.token_vla import TokenVLAPolicy
from transport.messages import TrajectoryChunk


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously to Python)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calls_per_s(fn: Callable[[], Any], window_s: float, device: torch.device) -> tuple[float, Any]:
    """(calls of ``fn`` per second over at least ``window_s`` after one warm-up call, the last
    call's result). Each call ends synchronised: its result is ready, as a caller needs it."""
    result = fn()  # warm-up: kernels chosen, allocator and caches filled
    synchronize(device)
    calls, started = 0, time.perf_counter()
    while True:
        result = fn()
        synchronize(device)
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= window_s:
            return calls / elapsed, result


def tabletop_observations(env_id: str, kwargs: dict[str, Any], n: int) -> dict[str, np.ndarray]:
    """``n`` first observations of the env (seeds 0..n-1), each key stacked to [n, ...]."""
    from sim.envs import make_env

    env = make_env(env_id, seed=0, **kwargs)
    try:
        rows = [env.reset(seed=i)[0] for i in range(n)]
    finally:
        env.close()
    return {key: np.stack([row[key] for row in rows]) for key in rows[0]}


def _accepts(model: nn.Module, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def bare_inference(
    model: nn.Module, inputs: dict[str, Tensor], action_ids: Tensor, count: int
) -> Callable[[], Tensor]:
    """The bare decoding loop: ``count`` argmax action tokens per prompt of ``inputs``."""
    keep = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    # transformers 5 names the cache argument ``cache`` from 5.2x on, ``past_key_values`` before
    cache_arg = "cache" if _accepts(model, "cache") else "past_key_values"

    @torch.inference_mode()
    def decode() -> Tensor:
        out = model(**inputs, use_cache=True, **keep)
        cache = getattr(out, "cache", None) or out.past_key_values
        mask = inputs["attention_mask"]
        token = out.logits[:, -1, action_ids].argmax(-1)
        tokens = [token]
        for _ in range(count - 1):
            mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
            step = model(
                input_ids=action_ids[token][:, None],
                attention_mask=mask,
                use_cache=True,
                **{cache_arg: cache},
            )
            token = step.logits[:, -1, action_ids].argmax(-1)
            tokens.append(token)
        return torch.stack(tokens, dim=1)

    return decode


def bare_training(
    model: nn.Module, inputs: dict[str, Tensor], action_ids: Tensor, count: int, lr: float
) -> Callable[[], float]:
    """The bare training step on the prompts of ``inputs`` with ``count`` random action tokens
    each (module docstring); returns the loss."""
    device = action_ids.device
    rows = len(inputs["input_ids"])
    targets = torch.randint(len(action_ids), (rows, count), device=device)
    batch = dict(inputs)
    batch["input_ids"] = torch.cat([inputs["input_ids"], action_ids[targets]], dim=1)
    mask = inputs["attention_mask"]
    batch["attention_mask"] = torch.cat([mask, mask.new_ones(rows, count)], dim=1)
    hidden = int(model.config.get_text_config().hidden_size)
    value_head = nn.Linear(hidden, 1).to(device)
    trained = [p for p in model.parameters() if p.requires_grad] + list(value_head.parameters())
    optimizer = torch.optim.Adam(trained, lr=lr, eps=1e-5, fused=True)
    returns = torch.randn(rows, device=device)
    # the last count + 1 positions: the first count of them predict the action tokens
    keep = {"logits_to_keep": count + 1} if _accepts(model, "logits_to_keep") else {}

    def step() -> float:
        out = model(**batch, output_hidden_states=True, use_cache=False, **keep)
        logits = out.logits[:, -count - 1 : -1, action_ids].float()
        log_prob = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1).sum(-1)
        value = value_head(out.hidden_states[-1][:, -count - 1].float()).squeeze(-1)
        loss = -log_prob.mean() + 0.5 * (value - returns).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return step


def synthetic_chunks(
    policy: TokenVLAPolicy, obs: dict[str, Tensor], samples: int, chunk_len: int
) -> list[TrajectoryChunk]:
    """``samples`` env steps as the env workers send them: the observations in turn, the
    policy's own actions, log-probs and values on them, random rewards, chunks of
    ``chunk_len`` steps (one episode each, cut by its time limit)."""
    with torch.inference_mode():
        out = policy.act(obs)
    rows = len(out.log_prob)
    rng = np.random.default_rng(0)
    chunks = []
    for start in range(0, samples, chunk_len):
        idx = np.arange(start, min(start + chunk_len, samples)) % rows
        n = len(idx)
        chunks.append(
            TrajectoryChunk(
                worker_index=0,
                env_index=len(chunks),
                chunk_id=len(chunks),
                obs={k: v.cpu().numpy()[idx] for k, v in obs.items()},
                actions=out.action.cpu().numpy()[idx],
                rewards=rng.standard_normal(n).astype(np.float32),
                terminated=np.zeros(n, bool),
                truncated=np.arange(n) == n - 1,
                log_probs=out.log_prob.cpu().numpy()[idx],
                values=out.value.cpu().numpy()[idx],
                policy_versions=np.zeros(n, np.int64),
                bootstrap_value=0.0,
            )
        )
    return chunks


def trainer_update(
    policy: TokenVLAPolicy, cfg: Config, chunks: list[TrajectoryChunk], device: torch.device
) -> Callable[[], dict[str, float]]:
    """What the trainer runs per version on ``chunks``: the learner of ``algo.kind`` builds the
    batch (advantages; with a correction, the no-grad forward over it) and trains on it
    (``algo.epochs`` passes of ``algo.minibatch_size``); returns the update's metrics."""
    samples = sum(len(c.rewards) for c in chunks)
    learner = build_learner(cfg.algo, on_policy_only=False, batch_steps=samples, device=device)
    optimizer = build_optimizer(policy, cfg.algo)

    def update() -> dict[str, float]:
        for chunk in chunks:
            learner.accept(chunk)
        taken = learner.take_batch(policy, 0)
        assert taken.batch is not None  # (every step is of version 0, the trainer's)
        return learner.objective.update(
            policy, optimizer, taken.batch, policy_coef=1.0, reference=None
        )

    return update
