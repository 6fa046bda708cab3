"""The rollout server's answers: a request served alone (the single-request path of
``RolloutServer._serve``) gets what it would get in a batch, and non-finite observations are
refused on both paths without costing the others their replies."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import pytest

from rlvla3.config.run_config import config_from_dict
from roles.request_batch import all_usable, stack_observations, without_unusable
from roles.rollout_server import RolloutServer
from transport.codec import decode, encode
from transport.messages import ActionReply, ObsBatchRequest, ObsRequest


@pytest.fixture
def server(tmp_path, redis_url) -> Iterator[tuple[RolloutServer, list[tuple[bytes, ActionReply]]]]:
    """A CartPole rollout server set up in this process (inference only: its initial weights),
    its replies recorded instead of sent."""
    cfg = config_from_dict(
        {
            "run": {"name": "serving", "redis_url": redis_url},
            "roles": {"rollout_server": {"count": 1}},
        }
    )
    role = RolloutServer(cfg, 0, node="local", run_dir=tmp_path)
    role.setup()
    sent: list[tuple[bytes, ActionReply]] = []
    role.requests.send_to = lambda identity, msg: sent.append((identity, msg)) or True
    try:
        yield role, sent
    finally:
        role.requests.close()


def _request(i: int, state: np.ndarray) -> ObsRequest:
    return ObsRequest(env_key=f"0/{i}", request_id=i, obs={"state": state.astype(np.float32)})


@pytest.mark.parametrize("greedy", [True, False])
def test_a_request_alone_gets_what_it_gets_in_a_batch(server, greedy) -> None:
    role, sent = server
    role.greedy = greedy
    states = np.random.default_rng(0).normal(size=(6, 4))
    requests = [(f"env{i}".encode(), _request(i, s)) for i, s in enumerate(states)]
    for item in requests:
        assert role._serve([item]) == 1
    alone = list(sent)
    sent.clear()
    assert role._serve(requests) == len(requests)
    batched = list(sent)
    for (id_a, a), (id_b, b) in zip(alone, batched, strict=True):
        assert id_a == id_b and a.request_id == b.request_id
        assert a.policy_version == b.policy_version == 0
        assert a.action.shape == b.action.shape == () and a.action.dtype == b.action.dtype
        assert a.value == pytest.approx(b.value, abs=1e-5)  # the critic does not sample
        if greedy:
            assert a.action == b.action
            assert a.log_prob == pytest.approx(b.log_prob, abs=1e-5)
        assert a.log_prob <= 0 and np.isfinite(a.log_prob)
        wire = decode(encode(a))  # what an env worker receives
        assert isinstance(wire, ActionReply) and wire.action == a.action


@pytest.mark.parametrize("value", [np.nan, 3e38])
def test_unusable_observations_are_refused_alone_and_in_a_batch(server, value) -> None:
    """NaN, and a finite but absurd value (a blown-up simulator's 3e38 overflows a model's
    activations until its sampling fails): refused and counted, the rest served."""
    role, sent = server
    bad = (b"bad", _request(9, np.array([0.0, value, 0.0, 0.0])))
    assert role._serve([bad]) == 0 and sent == []
    good = [(f"env{i}".encode(), _request(i, np.zeros(4))) for i in range(3)]
    assert role._serve([good[0], bad, *good[1:]]) == 3
    assert [identity for identity, _ in sent] == [b"env0", b"env1", b"env2"]
    assert role.stats()["bad_requests"] == 2


def test_the_torch_path_serves_a_received_request_without_warnings(server) -> None:
    """A received request's arrays are read-only views of the message; the torch path (for
    policies without a numpy path) copies them rather than handing torch read-only memory."""
    role, sent = server
    role.active.act_numpy = lambda *args: None  # as a VLA policy: torch only
    req = decode(encode(_request(0, np.zeros(4))))
    assert not req.obs["state"].flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert role._serve([(b"a", req)]) == 1
        assert role._serve([(b"b", req), (b"c", req)]) == 2
    assert [identity for identity, _ in sent] == [b"a", b"b", b"c"]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("size", [4, 1000])  # checked as Python floats, and in numpy
def test_the_usable_check_sees_every_nan_inf_and_absurd_value(dtype, size) -> None:
    """``all_usable`` checks small float arrays as Python floats: a NaN, inf or value beyond
    1e9 anywhere must fail it; values up to the limit must not."""
    from rlvla3.algo.number_limits import MAX_OBS_MAGNITUDE

    largest = min(MAX_OBS_MAGNITUDE, float(np.finfo(dtype).max))  # float16's: 65504
    big = np.full((1, size), largest, dtype)
    assert all_usable({"state": big, "image": np.full((1, 3), 255, np.uint8)})
    assert all_usable({"state": -big})
    absurd = [] if dtype is np.float16 else [[3e38], [-2e9]]
    for bad in ([np.nan], [np.inf], [-np.inf], [np.inf, -np.inf], *absurd):
        arr = np.zeros((1, size), dtype)
        arr[0, : len(bad)] = bad
        assert not all_usable({"image": np.zeros((1, 3), np.uint8), "state": arr}), bad


def test_a_mixed_batch_stacks_in_order_and_loses_only_the_unusable_requests() -> None:
    """Single and group requests stack row after row; a group with one non-finite row is taken
    out whole, its rows with it, and the other requests keep their rows in order."""
    states = np.arange(6 * 2, dtype=np.float32).reshape(6, 2)
    bad_group = states[3:5].copy()
    bad_group[1, 0] = np.inf
    batch = [
        (b"a", ObsRequest(env_key="0/0", request_id=0, obs={"state": states[0]})),
        (b"b", ObsBatchRequest(env_key="0/1+2", request_id=1, obs={"state": states[1:3]})),
        (b"c", ObsBatchRequest(env_key="0/3+2", request_id=2, obs={"state": bad_group})),
        (b"d", ObsRequest(env_key="0/5", request_id=3, obs={"state": states[5]})),
    ]
    obs, rows = stack_observations(batch, ["state"])
    assert rows == [1, 2, 2, 1] and obs["state"].shape == (6, 2)
    kept, obs, rows, refused = without_unusable(batch, obs, rows)
    assert [identity for identity, _ in kept] == [b"a", b"b", b"d"] and rows == [1, 2, 1]
    assert [req.request_id for req in refused] == [2]
    np.testing.assert_array_equal(obs["state"], states[[0, 1, 2, 5]])
