"""Transformer policies in the sharded mode (``settings.shard``, ``rlvla3/algo/sharding.py``):
our VLA (its blocks each an FSDP unit) and a token VLA (a tiny random-weight LLaVA), two ranks
in two spawned processes over gloo against one process: PPO updates through ``GroupUpdates``
as the RL trainer drives them, and SFT steps through ``GroupState`` and ``sft_update`` as the
SFT trainer drives them (each rank its own frames, one process the doubled batch)."""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from rlvla3.algo.data_parallel import DataParallel
from rlvla3.algo.group_state import GroupState
from rlvla3.algo.group_updates import GroupUpdates
from rlvla3.algo.learners import Objective
from rlvla3.algo.optim import build_optimizer
from rlvla3.algo.sft_update import sft_update
from rlvla3.algo.sharding import run_as_forward, shard_units
from rlvla3.config.run_config import AlgoConfig
from rlvla3.policy.sft_tokens import frame_tokens
from rlvla3.policy.vla import VLAConfig, VLAPolicy
from rlvla3.runtime.checkpoints import resume_training, save_training
from rlvla3.runtime.train_group import TrainGroup, follower_store
from sim.tokenizer import encode_instruction
from tests.test_data_parallel import _spawn
from tests.test_ppo import acted_batch

STEPS = 2
SAMPLES = 12
ALGO = AlgoConfig(lr=0.01, epochs=2, minibatch_size=6, max_grad_norm=0.5, ent_coef=0.01)
TEXTS = ["push the red block to the blue target", "go", "push the green block left"]


# --- the two families, the same weights in every process ----------------------------------------


def _policy(family: str, model_dir: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if family == "vla":
        config = VLAConfig(
            image_size=16,
            patch_size=8,
            d_model=16,
            num_layers=2,
            num_heads=2,
            max_instruction_len=48,
            proprio_dim=4,
            action_dim=2,
            num_bins=8,
        )
        return VLAPolicy(config).train()
    from tests.test_token_vla import make_policy

    # (the checkpoint's weights are fixed; the value head is what the seed draws)
    return make_policy(Path(model_dir)).train()


def _observations(family: str, n: int, seed: int) -> dict[str, torch.Tensor]:
    from tests.tiny_vlms import IMAGE_SIZE

    size = 16 if family == "vla" else IMAGE_SIZE
    rng = np.random.default_rng(seed)
    texts = [TEXTS[i % len(TEXTS)] for i in range(n)]
    return {
        "image": torch.from_numpy(rng.integers(0, 256, (n, size, size, 3), np.uint8)),
        "instruction": torch.from_numpy(np.stack([encode_instruction(t, 48) for t in texts])),
        "proprio": torch.from_numpy(rng.normal(size=(n, 4)).astype(np.float32)),
    }


def _actions(policy: torch.nn.Module, n: int, seed: int) -> torch.Tensor:
    spec = policy.action_spec()
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.num_choices, (n, *spec.shape), generator=generator)


def _group(rank: int, port: int) -> TrainGroup:
    torch.set_num_threads(1)
    store = follower_store(f"127.0.0.1:{port}", timeout_s=60)
    return TrainGroup(store, rank, 2, torch.device("cpu"), "127.0.0.1", timeout_s=60)


def _state(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _follow_gather(state: GroupState, group: TrainGroup) -> None:
    state.join(group.wait(lambda: False, lambda: None))


# --- PPO updates ----------------------------------------------------------------------------------


def _rl_batch(policy: torch.nn.Module, family: str) -> dict:
    torch.manual_seed(5)  # (the actions drawn)
    return acted_batch(
        policy, _observations(family, SAMPLES, seed=1), torch.Generator().manual_seed(2)
    )


def _objective() -> Objective:
    return Objective(ALGO, vf_coef=ALGO.vf_coef, norm_adv=True)


def _rl_rank(family: str, model_dir: str, rank: int, port: int, out: str) -> None:
    group = _group(rank, port)
    policy = _policy(family, model_dir, seed=7 + rank)  # the shared state makes it rank 0's
    rebuild = functools.partial(build_optimizer, algo=ALGO)
    updates = GroupUpdates(group, _objective(), policy, build_optimizer(policy, ALGO), rebuild)
    updates.share_state()
    if not group.leader:
        for _ in range(STEPS):
            updates.follow(group.wait(lambda: False, lambda: None), None)  # the update
            _follow_gather(updates.state, group)
        torch.save({}, out)
        return
    batch = _rl_batch(_policy(family, model_dir, seed=7), family)
    trace, norms = [], []
    for update in range(STEPS):
        torch.manual_seed(100 + update)  # (the shuffle's seed)
        norms.append(updates.lead(batch, policy_coef=1.0, reference=None)["grad_norm"])
        trace.append(_state(updates.whole()[0]))
    local = {k: v.to_local().numel() for k, v in policy.state_dict().items() if _dtensor(v)}
    torch.save({"trace": trace, "norms": norms, "batch": batch, "local": local}, out)


def _dtensor(value) -> bool:
    return hasattr(value, "to_local")


def _rl_one_process(family: str, model_dir: str, batch: dict) -> tuple[list[dict], list]:
    from rlvla3.algo import data_parallel as dp

    policy = _policy(family, model_dir, seed=7)
    optimizer, trace, norms = build_optimizer(policy, ALGO), [], []
    for update in range(STEPS):
        torch.manual_seed(100 + update)
        seed = int(torch.randint(0, 2**62, ()).item())
        metrics = _objective().update(
            policy,
            optimizer,
            batch,
            policy_coef=1.0,
            reference=None,
            generator=dp.shuffle_generator(seed),
        )
        trace.append(_state(policy))
        norms.append(metrics["grad_norm"])
    return trace, norms


# --- SFT steps ------------------------------------------------------------------------------------


def _sft_optimizer(policy: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=0.01)


def _sft_frames(policy, family: str, step: int, rows: slice) -> tuple[dict, torch.Tensor]:
    obs = _observations(family, SAMPLES, seed=200 + step)
    return {k: v[rows] for k, v in obs.items()}, _actions(policy, SAMPLES, seed=300 + step)[rows]


def _sft_steps(
    policy, evaluate, optimizer, family: str, rows: slice, data_parallel, after, steps=STEPS
):
    """SFT steps (``steps``: how many, or which) on ``rows`` of each step's frames
    (``after()`` after each); their (loss, gradient norm)s."""
    figures = []
    for step in range(steps) if isinstance(steps, int) else steps:
        obs, actions = _sft_frames(policy, family, step, rows)
        figure = sft_update(
            policy,
            optimizer,
            evaluate,
            obs,
            actions,
            precision=contextlib.nullcontext,
            data_parallel=data_parallel,
        )
        figures.append(figure)
        after()
    return figures


def _sft_rank(
    family: str, model_dir: str, ckpt: str, resume: bool, rank: int, port: int, out: str
) -> None:
    """``STEPS`` steps, then a checkpoint into ``ckpt``; ``resume``: one more step from it."""
    group = _group(rank, port)
    policy = _policy(family, model_dir, seed=7 + rank)
    evaluate = frame_tokens(policy, row_tokens=4096).evaluate  # (as the role: before sharding)
    optimizer = _sft_optimizer(policy)
    if resume and group.leader:  # (as the role: rank 0 loads it whole, then shares it)
        assert resume_training(
            Path(ckpt), model=policy, optimizer=optimizer, device="cpu", log=logging.getLogger()
        )
    state = GroupState(group, policy, optimizer, _sft_optimizer)
    state.share()
    evaluate = run_as_forward(policy, "sft_evaluate", evaluate)
    # uneven shares (5 and 7 frames): the loss is the global batch's mean
    rows = slice(0, 5) if group.leader else slice(5, SAMPLES)
    trace: list[dict] = []
    if group.leader:
        after = lambda: trace.append(_state(state.whole()[0]))  # noqa: E731
    else:
        after = lambda: _follow_gather(state, group)  # noqa: E731
    data_parallel = DataParallel(group, sharded=True)
    steps = range(STEPS, STEPS + 1) if resume else STEPS
    figures = _sft_steps(
        policy, evaluate, state.optimizer, family, rows, data_parallel, after, steps
    )
    local = {k: v.to_local().numel() for k, v in policy.state_dict().items() if _dtensor(v)}
    if not resume and group.leader:
        module, whole_optimizer = state.whole(optimizer=True)
        save_training(
            Path(ckpt), model=module, optimizer=whole_optimizer, version=1, updates=1, keep=1
        )
    elif not resume:
        _follow_gather(state, group)
    torch.save({"trace": trace, "figures": figures, "local": local}, out)


def _sft_one_process(family: str, model_dir: str, steps: int = STEPS) -> tuple[list[dict], list]:
    policy = _policy(family, model_dir, seed=7)
    evaluate = frame_tokens(policy, row_tokens=4096).evaluate
    trace: list[dict] = []
    after = lambda: trace.append(_state(policy))  # noqa: E731
    optimizer = _sft_optimizer(policy)
    figures = _sft_steps(policy, evaluate, optimizer, family, slice(None), None, after, steps)
    return trace, figures


# --- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    pytest.importorskip("transformers")
    from tests.tiny_vlms import write_tiny_vlm

    return str(write_tiny_vlm(tmp_path_factory.mktemp("llava"), "llava"))


def _model_dir(family: str, request) -> str:
    return request.getfixturevalue("llava_dir") if family == "token_vla" else ""


def _assert_same(group_trace: list[dict], one_trace: list[dict], family: str) -> None:
    # The token VLA's one process packs all 12 frames in one sequence, each rank its own 5 or
    # 7: the sums run in another order, and Adam magnifies that on near-zero gradients (two
    # replicated ranks land as far from one process).
    atol = 1e-4 if family == "token_vla" else 1e-5
    assert len(group_trace) == len(one_trace) == STEPS
    for group_state, one_state in zip(group_trace, one_trace, strict=True):
        assert group_state.keys() == one_state.keys()
        for name, value in group_state.items():
            torch.testing.assert_close(value, one_state[name], rtol=1e-4, atol=atol, msg=name)
    first, last = one_trace[0], one_trace[-1]
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the steps moved weights


def _assert_half_held(leader: dict, policy: torch.nn.Module) -> None:
    """Every block was a unit of its own, and the leader held about half of each parameter."""
    assert len(shard_units(policy)) >= 2
    whole = policy.state_dict()
    assert sum(leader["local"].values()) < 0.6 * sum(whole[k].numel() for k in leader["local"])


@pytest.mark.parametrize("family", ["vla", "token_vla"])
def test_sharded_transformer_ranks_match_one_process_in_ppo(family, request, tmp_path) -> None:
    model_dir = _model_dir(family, request)
    leader = _spawn(functools.partial(_rl_rank, family, model_dir), tmp_path)[0]
    _assert_half_held(leader, _policy(family, model_dir, seed=7))
    one_trace, one_norms = _rl_one_process(family, model_dir, leader["batch"])
    # the gradients' scale too (Adam's steps alone would not show a sum taken twice)
    assert leader["norms"] == pytest.approx(one_norms, rel=1e-4)
    _assert_same(leader["trace"], one_trace, family)


def _sft_group(family: str, model_dir: str, tmp: Path, resume: bool) -> dict:
    ranks = tmp / ("resumed" if resume else "ranks")
    ranks.mkdir()
    target = functools.partial(_sft_rank, family, model_dir, str(tmp / "ckpt"), resume)
    return _spawn(target, ranks)[0]


@pytest.mark.parametrize("family", ["vla", "token_vla"])
def test_two_sharded_sft_ranks_match_one_with_the_doubled_batch(family, request, tmp_path) -> None:
    model_dir = _model_dir(family, request)
    leader = _sft_group(family, model_dir, tmp_path, resume=False)
    _assert_half_held(leader, _policy(family, model_dir, seed=7))
    one_trace, one_figures = _sft_one_process(family, model_dir)
    # the global batch's loss and gradient norm, as one process has them
    flat = lambda figures: [x for figure in figures for x in figure]  # noqa: E731
    assert flat(leader["figures"]) == pytest.approx(flat(one_figures), rel=1e-4)
    _assert_same(leader["trace"], one_trace, family)


def test_a_sharded_sft_groups_checkpoint_resumes_into_a_sharded_group(tmp_path) -> None:
    _sft_group("vla", "", tmp_path, resume=False)  # its checkpoint: whole tensors, gathered
    resumed = _sft_group("vla", "", tmp_path, resume=True)
    # one more step from it, AdamW's moments included, lands where one process's third does
    one_trace, _ = _sft_one_process("vla", "", steps=STEPS + 1)
    torch.testing.assert_close(resumed["trace"][0], one_trace[-1], rtol=1e-4, atol=1e-5)
