"""What the ranks of a sharded group hold whole (``rlvla3/algo/group_state.py``,
``rlvla3/algo/sharding.py``): two ranks in two spawned processes over gloo, driven as the
trainer drives them, each recording what it keeps alive."""

from __future__ import annotations

import functools
import gc
import warnings
import weakref

import pytest
import torch

from rlvla3.algo import sharding
from rlvla3.algo.group_updates import GroupUpdates
from rlvla3.algo.learners import Objective
from rlvla3.algo.optim import build_optimizer
from rlvla3.config.run_config import AlgoConfig
from rlvla3.runtime.train_group import STOP, TrainGroup, follower_store
from tests.test_data_parallel import _policy, _spawn
from tests.test_sharded_training import _samples

# no target_kl, no critic pass: nothing in an update calls the group's own all-reduce
ALGO = AlgoConfig(lr=0.01, epochs=1, minibatch_size=16, max_grad_norm=0.5)
UPDATES = 2


class _LiveCount:
    """How many of the tensors seen so far were alive at once, at most (scalars, Adam's
    ``step``, left out: a rank keeps them whole)."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.most = 0

    def see(self, tensor: object) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.dim():
            self.refs.append(weakref.ref(tensor))
        self.most = max(self.most, sum(r() is not None for r in self.refs))


def _counting_receive(group: TrainGroup, live: _LiveCount) -> None:
    """``group.receive``, counting the whole tensors of the state alive as each arrives."""
    receive = group.receive

    def counted(message):
        for name, tensor in receive(message):
            live.see(tensor)
            yield name, tensor

    group.receive = counted  # type: ignore[method-assign]


def _counting_gathers(live: _LiveCount) -> None:
    """``sharding.whole``, counting the whole tensors alive as each is gathered."""
    gather = sharding.whole

    def counted(value):
        full = gather(value)
        live.see(full)
        return full

    sharding.whole = counted


def _moments_over_their_slice(optimizer: torch.optim.Optimizer) -> list[str]:
    """Moments whose storage is more than their own slice (a view of a whole tensor)."""
    over = []
    for index, entry in optimizer.state.items():
        for key, value in entry.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            if local.dim() and local.untyped_storage().nbytes() > local.numel() * 4:
                over.append(f"{index}/{key}")
    return over


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = follower_store(f"127.0.0.1:{port}", timeout_s=30)
    group = TrainGroup(store, rank, 2, torch.device("cpu"), "127.0.0.1", timeout_s=30)
    policy = _policy(7)
    optimizer = build_optimizer(policy, ALGO)
    if group.leader:  # a resumed leader: its optimizer holds moments
        s = _samples()
        out_ = policy.evaluate(s["obs"], s["actions"])
        (out_.value.sum() + out_.log_prob.sum()).backward()
        del out_  # (its graph holds the parameters)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    whole_params = [weakref.ref(p) for p in policy.parameters()]
    whole_moments = [
        weakref.ref(v) for st in optimizer.state.values() for v in st.values() if v.dim()
    ]
    received, gathered = _LiveCount(), _LiveCount()
    _counting_receive(group, received)
    rebuild = functools.partial(build_optimizer, algo=ALGO)
    objective = Objective(ALGO, vf_coef=ALGO.vf_coef, norm_adv=True)
    updates = GroupUpdates(group, objective, policy, optimizer, rebuild)
    updates.share_state()
    gc.collect()
    record = {
        # ``optimizer``: a reference kept to the optimizer over the whole parameters
        "kept_optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups),
        "kept_optimizer_state": len(optimizer.state),
        "whole_params_alive": sum(r() is not None for r in whole_params),
        "whole_moments_alive": sum(r() is not None for r in whole_moments),
        "moments_over_slice": _moments_over_their_slice(updates.optimizer),
        "moments": sum(len(st) for st in updates.optimizer.state.values()),
        "received_at_once": received.most,
        "received": len(received.refs),
    }
    _counting_gathers(gathered)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if group.leader:
            _lead(group, updates)
        else:
            _follow(group, updates)
    record["view_warnings"] = sum("view tensor" in str(w.message) for w in caught)
    record["gathered_at_once"] = gathered.most
    record["gathered"] = len(gathered.refs)
    if group.leader:
        record["headers_left"] = [
            k for k in (f"message/{i}" for i in range(1, group._seq + 1)) if store.check([k])
        ]
    torch.save(record, out)


def _lead(group: TrainGroup, updates: GroupUpdates) -> None:
    samples = _samples()
    for _ in range(UPDATES):
        updates.lead(samples, policy_coef=1.0, reference=None)
        updates.whole()  # a publish
    module, gathered = updates.whole(optimizer=True)  # a checkpoint
    assert module.tensors and gathered.whole["state"]
    group.post(STOP, {}, {})  # (the last header: a follower reads it on its way out)


def _follow(group: TrainGroup, updates: GroupUpdates) -> None:
    while (message := group.wait()).kind != STOP:
        updates.follow(message, None)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return _spawn(_rank, tmp_path_factory.mktemp("ranks"))


def test_after_sharing_no_rank_keeps_whole_weights_or_moments(ranks) -> None:
    leader, follower = ranks
    for record in ranks:
        # the optimizer over the whole parameters, still referenced, holds none of them
        assert record["kept_optimizer_params"] == 0 and record["kept_optimizer_state"] == 0
        assert record["whole_params_alive"] == 0
        # every moment a slice in storage of its own, none a view of a whole tensor
        assert record["moments"] and not record["moments_over_slice"]
    assert leader["whole_moments_alive"] == 0  # its resumed moments went with the share


def test_a_follower_takes_the_leaders_state_one_tensor_at_a_time(ranks) -> None:
    follower = ranks[1]
    assert follower["received"] == 36  # 12 weights, their 24 moments
    # a constant few at once, not all 36: the one arriving, and the last ones until the
    # loop and the backend's last broadcast let go of them
    assert follower["received_at_once"] <= 3


def test_only_the_leader_keeps_what_a_gathering_gathers(ranks) -> None:
    leader, follower = ranks
    assert follower["gathered"] == leader["gathered"] == 12 * (UPDATES + 1) + 24
    assert follower["gathered_at_once"] <= 1
    assert leader["gathered_at_once"] >= 36  # a checkpoint's 12 weights and 24 moments


def test_sharded_updates_and_gathers_leave_no_header_in_the_store(ranks) -> None:
    assert ranks[0]["headers_left"] == [f"message/{3 + 2 * UPDATES}"]  # the stop alone


def test_a_sharded_pass_gives_fsdp_no_view_to_warn_of(ranks) -> None:
    assert [r["view_warnings"] for r in ranks] == [0, 0]
