"""Data-parallel learners (``rlvla3/algo/data_parallel.py``, ``rlvla3/runtime/train_group.py``):
two ranks in two spawned processes over gloo against one process, fed the same samples."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import traceback
from pathlib import Path

import gymnasium as gym
import pytest
import torch

from rlvla3.algo import data_parallel as dp
from rlvla3.algo.learners import Objective
from rlvla3.algo.optim import build_optimizer
from rlvla3.algo.sft_update import sft_update
from rlvla3.config.run_config import AlgoConfig
from rlvla3.policy.mlp import MLPPolicy
from rlvla3.runtime.train_group import GroupError, TrainGroup, _parse_header, follower_store
from tests.test_ppo import _fixed_batch
from transport.weights import start_store

UPDATES = 3
# 49 samples in minibatches of 16: the last holds one, so one rank's slice of it is empty
ALGO = AlgoConfig(lr=0.01, epochs=2, minibatch_size=16, max_grad_norm=0.5, ent_coef=0.01)
SAMPLES = 49


def _policy(seed: int) -> MLPPolicy:
    torch.manual_seed(seed)
    return MLPPolicy(4, gym.spaces.Discrete(2), hidden_sizes=(16, 16))


def _batch(policy: MLPPolicy, update: int) -> dict:
    """The update's samples, acted by ``policy`` as it stands (one fixed set of observations)."""
    return _fixed_batch(policy, n=SAMPLES)


def _weights(policy: MLPPolicy) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in policy.parameters()])


def _train(
    policy: MLPPolicy, optimizer, batch: dict, update: int, data_parallel: dp.DataParallel | None
):
    objective = Objective(ALGO, vf_coef=ALGO.vf_coef, norm_adv=True)
    objective.update(
        policy,
        optimizer,
        batch,
        policy_coef=1.0,
        reference=None,
        generator=dp.shuffle_generator(update),
        data_parallel=data_parallel,
    )


def _rank(rank: int, port: int, out: str) -> None:
    """One rank: join, take the leader's state, then train on the batches the leader posts."""
    torch.set_num_threads(1)
    store = follower_store(f"127.0.0.1:{port}", timeout_s=30)
    group = TrainGroup(store, rank, 2, torch.device("cpu"), "127.0.0.1", timeout_s=30)
    policy = _policy(seed=rank)  # a follower starts from other weights: the state message fixes it
    optimizer = build_optimizer(policy, ALGO)
    shared = dp.DataParallel(group)
    trace = []
    if group.leader:
        dp.post_state(group, dp.whole_state(policy, optimizer))
    else:
        dp.load_state(group, group.wait(lazy=True), policy, optimizer)
    for update in range(UPDATES):
        if group.leader:
            batch = _batch(policy, update)
            group.post("update", {"update": update}, dp.flatten_tree(batch))
        else:
            message = group.wait(lambda: False, lambda: None)
            assert message.kind == "update" and message.info == {"update": update}
            batch = dp.unflatten_tree(message.tensors)
        _train(policy, optimizer, batch, update, shared)
        trace.append(_weights(policy))
    torch.save({"trace": torch.stack(trace), "reduced": shared.reduced_bytes}, out)


def _as_a_role(target, rank: int, port: int, out: str) -> None:
    """Run ``target(rank, port, out)``, then leave as a role process does
    (``rlvla3/runtime/role.py``): without the interpreter's teardown, where a daemon thread
    still blocked in a C++ call (a gloo receive, a TCPStore wait) can abort a process whose work
    is done and saved ("terminate called without an active exception")."""
    code = 0
    try:
        target(rank, port, out)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawn(target, tmp: Path) -> list[dict]:
    """Run ``target(rank, port, out)`` as ranks 0 and 1 of a group; what each saved."""
    store = start_store("127.0.0.1", timeout_s=30)
    ctx = multiprocessing.get_context("spawn")
    outs = [str(tmp / f"rank{r}.pt") for r in range(2)]
    procs = [
        ctx.Process(target=_as_a_role, args=(target, r, store.port, outs[r])) for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    codes = [p.exitcode for p in procs]
    # (a negative code is a signal, which leaves no traceback above)
    assert codes == [0, 0], f"a rank failed, exit codes {codes} (its traceback is above)"
    return [torch.load(Path(o), weights_only=True) for o in outs]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return _spawn(_rank, tmp_path_factory.mktemp("ranks"))


def test_ranks_hold_identical_weights_after_every_update(two_ranks) -> None:
    first, second = (r["trace"] for r in two_ranks)
    assert torch.equal(first, second)
    assert two_ranks[0]["reduced"] > 0


def test_two_ranks_match_one_process_on_the_same_samples(two_ranks) -> None:
    policy = _policy(seed=0)
    optimizer = build_optimizer(policy, ALGO)
    trace = []
    for update in range(UPDATES):
        _train(policy, optimizer, _batch(policy, update), update, data_parallel=None)
        trace.append(_weights(policy))
    one = torch.stack(trace)
    assert not torch.allclose(one[0], one[-1])  # the updates moved the weights
    torch.testing.assert_close(two_ranks[0]["trace"], one, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "raw, named",
    [
        (b"not json", "not a header"),
        (b'{"kind": "update", "info": {}, "tensors": [["x", "complex128", [2]]]}', "tensor spec"),
        (b'{"kind": "update", "info": {}, "tensors": [["x", "float32", [-1]]]}', "shape"),
        (b'{"kind": "update", "info": {}, "tensors": [["x", "uint8", [99999999999]]]}', "bytes"),
    ],
)
def test_a_malformed_group_message_is_refused_by_name(raw: bytes, named: str) -> None:
    with pytest.raises(GroupError, match=named):
        _parse_header(raw)


# --- SFT: each rank its own samples, the loss over the global batch ------------------------------


def _sft_batch(step: int, rows: slice = slice(None)) -> tuple[dict, torch.Tensor]:
    """Step ``step``'s global batch of 12 demonstrated frames (``rows``: a rank's share)."""
    gen = torch.Generator().manual_seed(200 + step)
    obs = torch.randn(12, 4, generator=gen)
    actions = torch.randint(0, 2, (12,), generator=gen)
    return {"state": obs[rows]}, actions[rows]


def _sft_steps(policy: MLPPolicy, rows: slice, data_parallel: dp.DataParallel | None) -> list:
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.01)
    trace = []
    for step in range(UPDATES):
        obs, actions = _sft_batch(step, rows)
        sft_update(
            policy,
            optimizer,
            policy.evaluate,
            obs,
            actions,
            precision=contextlib.nullcontext,
            data_parallel=data_parallel,
        )
        trace.append(_weights(policy))
    return trace


def _sft_rank(rank: int, port: int, out: str) -> None:
    """An SFT rank: its share of every step's frames."""
    torch.set_num_threads(1)
    store = follower_store(f"127.0.0.1:{port}", timeout_s=30)
    group = TrainGroup(store, rank, 2, torch.device("cpu"), "127.0.0.1", timeout_s=30)
    # uneven halves (5 and 7 frames): the loss is the global batch's mean, not a mean of means
    rows = slice(0, 5) if rank == 0 else slice(5, 12)
    trace = _sft_steps(_policy(seed=0), rows, dp.DataParallel(group))
    torch.save({"trace": torch.stack(trace)}, out)


def test_two_sft_ranks_match_one_with_the_doubled_batch(tmp_path) -> None:
    ranks = _spawn(_sft_rank, tmp_path)
    assert torch.equal(ranks[0]["trace"], ranks[1]["trace"])
    one = torch.stack(_sft_steps(_policy(seed=0), slice(None), data_parallel=None))
    torch.testing.assert_close(ranks[0]["trace"], one, rtol=1e-5, atol=1e-6)
