"""The sharded mode of a training group (``rlvla3/algo/sharding.py``) and ``algo.target_kl``
in a group: two ranks in two spawned processes over gloo, through ``GroupUpdates`` as the
trainer drives it, against one process on the same samples."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import torch

from rlvla3.algo import data_parallel as dp
from rlvla3.algo.group_updates import GroupUpdates
from rlvla3.algo.learners import Objective
from rlvla3.algo.optim import build_optimizer
from rlvla3.algo.sharding import shard_units
from rlvla3.config.lora import LoraConfig
from rlvla3.config.run_config import AlgoConfig
from rlvla3.policy.lora import apply_lora
from rlvla3.policy.mlp import MLPPolicy
from rlvla3.runtime.checkpoints import resume_training, save_training
from rlvla3.runtime.train_group import TrainGroup, follower_store
from tests.test_data_parallel import SAMPLES, _policy, _spawn
from tests.test_ppo import _fixed_batch

UPDATES = 3
# target_kl low enough that the later updates stop early, at a minibatch both ranks agree on
ALGO = AlgoConfig(
    lr=0.01, epochs=3, minibatch_size=16, max_grad_norm=0.5, ent_coef=0.01, target_kl=0.002
)
LORA = LoraConfig(rank=2)


def _samples() -> dict:
    """The samples every update trains on (acted once by a fixed policy: its log-probs grow
    stale as the trained policy moves, so approx_kl grows)."""
    torch.manual_seed(11)
    return _fixed_batch(_policy(seed=3), n=SAMPLES)


def _start(lora: bool, seed: int) -> tuple[MLPPolicy, torch.optim.Optimizer]:
    policy = _policy(seed)
    if lora:
        apply_lora(policy, LORA)
    return policy, build_optimizer(policy, ALGO)


def _seed(update: int) -> int:
    """The shuffle seed the leader draws for ``update`` (``GroupUpdates.lead``)."""
    torch.manual_seed(100 + update)
    return int(torch.randint(0, 2**62, ()).item())


def _rank(case: str, ckpt: str, rank: int, port: int, out: str) -> None:
    """One rank of a group (``case``: sharded, sharded_lora, resume, replicated), driven as
    the trainer drives it: the leader leads each update, the other follows what it posts."""
    torch.set_num_threads(1)
    store = follower_store(f"127.0.0.1:{port}", timeout_s=30)
    group = TrainGroup(store, rank, 2, torch.device("cpu"), "127.0.0.1", timeout_s=30)
    policy, optimizer = _start(case == "sharded_lora", seed=7 + rank)  # shared state fixes it
    if case == "resume" and group.leader:
        assert resume_training(
            Path(ckpt), model=policy, optimizer=optimizer, device="cpu", log=_LOG
        )
    rebuild = None if case == "replicated" else functools.partial(build_optimizer, algo=ALGO)
    objective = Objective(ALGO, vf_coef=ALGO.vf_coef, norm_adv=True)
    updates = GroupUpdates(group, objective, policy, optimizer, rebuild)
    updates.share_state()
    samples = _samples()
    trace, metrics, values = [], [], None
    for update in range(1 if case == "resume" else UPDATES):
        if group.leader:
            if update == 0:  # the leader's critic pass, shared by the ranks when sharded
                values = updates.batch_policy().evaluate(samples["obs"], samples["actions"]).value
            torch.manual_seed(100 + update)
            metrics.append(updates.lead(samples, policy_coef=1.0, reference=None))
            module, _ = updates.whole()  # the weights a publish sends
            trace.append({k: v.clone() for k, v in module.state_dict().items()})
        else:
            while updates.follow(group.wait(lambda: False, lambda: None), None) is None:
                pass  # (an evaluation or a gathering: the update comes next)
            if updates.sharded:
                updates.follow(group.wait(lambda: False, lambda: None), None)  # the gather
    if group.leader:
        module, gathered = updates.whole(optimizer=True)
        if case == "sharded":
            save_training(
                Path(ckpt), model=module, optimizer=gathered, version=3, updates=3, keep=2
            )
        local = {
            k: v.to_local().numel()
            for k, v in updates.policy.state_dict().items()
            if hasattr(v, "to_local")
        }
        torch.save({"trace": trace, "metrics": metrics, "values": values, "local": local}, out)
    else:
        if updates.sharded:  # the leader's last gathering
            updates.follow(group.wait(lambda: False, lambda: None), None)
        torch.save({}, out)


_LOG = logging.getLogger(__name__)


def _one_process(
    policy: MLPPolicy, optimizer: torch.optim.Optimizer, updates: int, first: int = 0
) -> tuple[list[dict], list[dict]]:
    """The same updates in one process: the weights and metrics after each."""
    objective = Objective(ALGO, vf_coef=ALGO.vf_coef, norm_adv=True)
    samples, trace, metrics = _samples(), [], []
    for update in range(first, first + updates):
        generator = dp.shuffle_generator(_seed(update))
        metrics.append(
            objective.update(
                policy, optimizer, samples, policy_coef=1.0, reference=None, generator=generator
            )
        )
        trace.append({k: v.clone() for k, v in policy.state_dict().items()})
    return trace, metrics


def _run(case: str, tmp: Path, ckpt: Path) -> dict:
    tmp.mkdir(exist_ok=True)
    return _spawn(functools.partial(_rank, case, str(ckpt)), tmp)[0]


def _assert_same(group_trace: list[dict], one_trace: list[dict]) -> None:
    assert len(group_trace) == len(one_trace)
    for group_state, one_state in zip(group_trace, one_trace, strict=True):
        assert group_state.keys() == one_state.keys()
        for name, value in group_state.items():
            torch.testing.assert_close(value, one_state[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[dict, Path]:
    """A sharded group's run (its leader's record) and the checkpoint it wrote."""
    tmp = tmp_path_factory.mktemp("sharded")
    return _run("sharded", tmp / "ranks", tmp / "ckpt"), tmp / "ckpt"


def test_sharded_ranks_match_one_process_on_the_same_samples(sharded) -> None:
    record, _ = sharded
    policy, optimizer = _start(lora=False, seed=7)
    one_trace, one_metrics = _one_process(policy, optimizer, UPDATES)
    # each rank held half of every parameter (dim 0), not all of it
    assert record["local"]["critic.0.weight"] == policy.critic[0].weight.numel() // 2
    # the whole state gathered after each update is the unsharded one
    _assert_same(record["trace"], one_trace)
    stops = [m["num_minibatches"] for m in record["metrics"]]
    assert stops == [m["num_minibatches"] for m in one_metrics]
    assert stops[-1] < ALGO.epochs * 4  # target_kl stopped an update early


def test_the_leaders_critic_pass_is_shared_by_the_sharded_ranks(sharded) -> None:
    samples = _samples()
    expected = _policy(seed=7).evaluate(samples["obs"], samples["actions"]).value.detach()
    torch.testing.assert_close(sharded[0]["values"], expected)


def test_a_sharded_groups_checkpoint_resumes_into_a_sharded_group(sharded, tmp_path) -> None:
    _, ckpt = sharded
    resumed = _run("resume", tmp_path, ckpt)
    policy, optimizer = _start(lora=False, seed=7)
    _one_process(policy, optimizer, UPDATES)
    # (the optimizer's moments resumed too: one more update lands where one process's does)
    _assert_same(resumed["trace"], _one_process(policy, optimizer, 1, first=0)[0])


def test_replicated_ranks_agree_on_target_kl(tmp_path) -> None:
    replicated = _run("replicated", tmp_path, tmp_path / "ckpt")
    policy, optimizer = _start(lora=False, seed=7)
    one_trace, one_metrics = _one_process(policy, optimizer, UPDATES)
    stops = [m["num_minibatches"] for m in replicated["metrics"]]
    assert stops == [m["num_minibatches"] for m in one_metrics]
    assert stops[-1] < ALGO.epochs * 4
    _assert_same(replicated["trace"], one_trace)


def test_sharded_lora_gathers_only_the_trained_tensors(tmp_path) -> None:
    sharded = _run("sharded_lora", tmp_path, tmp_path / "ckpt")
    policy, optimizer = _start(lora=True, seed=7)
    one_trace, _ = _one_process(policy, optimizer, UPDATES)
    trained = policy.trained_state_names()
    assert trained and len(trained) < len(policy.state_dict())
    _assert_same(sharded["trace"], [{k: s[k] for k in trained} for s in one_trace])


def test_shard_units_are_the_elements_of_module_lists() -> None:
    blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    model = torch.nn.Sequential(blocks, torch.nn.Linear(2, 1))
    assert shard_units(model) == list(reversed(list(blocks)))
    assert shard_units(_policy(seed=0)) == []  # an MLP: one unit, the policy
