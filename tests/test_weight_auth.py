"""Authenticated weights that only move forward: hostile versions offered to a real weight
broadcaster, to a real rollout server's weight link and to a restarting trainer are refused and
counted, and the old weights keep serving (``transport/weight_auth.py``)."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from rlvla3.config.run_config import config_from_dict
from rlvla3.runtime.registry import Registry
from rlvla3.runtime.training_role import TrainingRole
from roles.rollout_server import RolloutServer
from roles.weight_broadcaster import WeightBroadcaster
from tests.conftest import wait_until
from transport import security, sockets
from transport.messages import ActionReply, ObsRequest, WeightsUpdate
from transport.weight_auth import (
    NO_TAG,
    VersionGate,
    new_link_id,
    weights_key,
    weights_tag,
)
from transport.weight_fanout import Broadcaster
from transport.weights import FlatLayout, start_store

SECRET = "a-run-secret-of-the-test-0123456789"
KEY = weights_key(SECRET)
OTHER_KEY = weights_key("another-runs-secret-0123456789")
HUGE = 2**62


def _flat(n: int, value: float) -> np.ndarray:
    return np.full(n, value, np.float32)


def _config(name: str, redis_url: str) -> object:
    return config_from_dict(
        {
            "run": {"name": name, "redis_url": redis_url},
            "roles": {
                "rollout_server": {"count": 1},
                "weight_broadcaster": {"count": 1},
                "trainer": {"count": 1},
            },
        }
    )


# --- the key, the tag and the gate ---------------------------------------------------------------
def test_the_weights_key_is_its_own_and_a_one_host_run_has_the_empty_key() -> None:
    keys = security.run_keys(SECRET)
    assert len(KEY) == 32 and KEY != OTHER_KEY
    assert SECRET.encode() not in KEY
    assert all(KEY not in k for k in (keys.server_secret, keys.client_secret))
    assert weights_key(None) == b""


def test_the_tag_binds_the_version_and_every_byte_of_the_weights() -> None:
    flat = _flat(1000, 0.5)
    tag = weights_tag(KEY, 3, flat)
    assert weights_tag(KEY, 3, flat.copy()) == tag
    flipped = flat.copy()
    flipped.view(np.uint32)[999] ^= 1  # one bit of the last value
    assert weights_tag(KEY, 3, flipped) != tag
    assert weights_tag(KEY, 4, flat) != tag
    assert weights_tag(OTHER_KEY, 3, flat) != tag
    assert weights_tag(KEY, 3, torch.from_numpy(flat)) == tag  # a torch buffer hashes the same


@pytest.mark.parametrize(
    ("version", "values", "signed_with", "why"),
    [
        (1, 0.0, KEY, "not newer than v1"),  # stale: equal
        (0, 0.0, KEY, "not newer than v1"),  # stale: older
        (HUGE, 0.0, KEY, "no trainer produced it"),
        (2, np.nan, KEY, "non-finite"),
        (2, np.inf, KEY, "non-finite"),
        (2, 0.0, OTHER_KEY, "HMAC does not match"),
        (2, 0.0, None, "HMAC does not match"),  # unsigned
    ],
    ids=["equal", "older", "2**62", "nan", "inf", "other-key", "unsigned"],
)
def test_the_gate_refuses_each_hostile_version(version, values, signed_with, why) -> None:
    gate = VersionGate(KEY)
    gate.accept(1, weights_tag(KEY, 1, _flat(8, 1.0)))
    flat = _flat(8, values)
    tag = NO_TAG if signed_with is None else weights_tag(signed_with, version, flat)
    problem = gate.problem(version, flat, tag, trained=2)
    assert problem is not None and why in problem
    good = _flat(8, 2.0)
    assert gate.problem(2, good, weights_tag(KEY, 2, good), trained=2) is None


def test_a_gate_for_resends_takes_the_same_version_again_only_with_the_same_weights() -> None:
    gate = VersionGate(KEY, resends=True)
    flat = _flat(8, 1.0)
    gate.accept(1, weights_tag(KEY, 1, flat))
    assert gate.problem(1, flat, weights_tag(KEY, 1, flat), trained=1) is None
    other = _flat(8, 7.0)
    assert "not newer" in gate.problem(1, other, weights_tag(KEY, 1, other), trained=1)


def test_link_ids_are_random() -> None:
    ids = {new_link_id("rollout_server", 0) for _ in range(100)}
    assert len(ids) == 100
    for link_id in ids:
        assert re.fullmatch(r"rollout_server-0-[0-9a-f]{32}", link_id)


# --- a real weight broadcaster -------------------------------------------------------------------
@pytest.fixture
def broadcaster(tmp_path, redis_url) -> Iterator[tuple[WeightBroadcaster, Registry]]:
    cfg = _config("auth_bc", redis_url)
    registry = Registry(redis_url, "auth_bc")
    registry.register("weight_broadcaster", 0, node="local", host="127.0.0.1", pid=os.getpid())
    registry.heartbeat("weight_broadcaster", 0, 600.0, {})
    role = WeightBroadcaster(cfg, 0, node="local", run_dir=tmp_path)
    role.weights_key = KEY
    role.setup()
    try:
        yield role, registry
    finally:
        role.updates.close()
        role.requests.close()
        registry.clear_run()


def test_the_broadcaster_refuses_hostile_versions_and_keeps_the_good_one(broadcaster) -> None:
    role, registry = broadcaster
    sender = sockets.push(hwm=16)
    sender.connect(registry.endpoints("weight_broadcaster", "updates")[0])
    layout, n = "L", 64

    def offer(version: int, values: float, key: bytes | None) -> str:
        """Send one update and step the role until it took or refused it; which it did."""
        flat = _flat(n, values)
        tag = b"" if key is None else weights_tag(key, version, flat)
        rejected, current = role.stats().get("weights_rejected", 0), role.current
        assert sender.send(WeightsUpdate(version=version, layout=layout, flat=flat, tag=tag), 5)

        def handled() -> str | None:
            role.step()
            if role.stats().get("weights_rejected", 0) > rejected:
                return "refused"
            return "taken" if role.current is not current else None

        return wait_until(handled, 10, f"v{version} handled")

    registry.set_trained_version(1)
    assert offer(1, 1.0, KEY) == "taken"
    assert role.current.version == 1 and role.broadcaster.version == 1
    assert offer(2, np.nan, KEY) == "refused"  # a version the trainer might produce, but NaN
    assert offer(HUGE, 1.0, KEY) == "refused"  # far above what any trainer recorded
    assert offer(0, 1.0, KEY) == "refused"  # stale
    assert offer(1, 5.0, KEY) == "refused"  # the same number, other weights
    assert offer(1, 5.0, OTHER_KEY) == "refused"
    assert offer(1, 5.0, None) == "refused"
    registry.set_trained_version(2)
    assert offer(2, 2.0, OTHER_KEY) == "refused"  # the next version, another run's key
    assert offer(2, 2.0, None) == "refused"  # the next version, unsigned
    assert role.stats()["weights_rejected"] == 8
    assert role.current.version == role.broadcaster.version == 1
    assert np.all(role.current.flat == 1.0) and registry.weight_version() == 1
    assert offer(2, 2.0, KEY) == "taken"  # the trainer's next version still goes through
    assert role.broadcaster.version == 2 and role.stats()["weights_rejected"] == 8
    sender.close()


# --- a real rollout server's weight link ---------------------------------------------------------
@pytest.fixture
def server(tmp_path, redis_url) -> Iterator[tuple[RolloutServer, Registry, Broadcaster]]:
    """A CartPole rollout server set up in this process, linked to a ``Broadcaster`` played by
    the test (the role of a peer that reached its link), with v0 installed."""
    cfg = _config("auth_rs", redis_url)
    registry = Registry(redis_url, "auth_rs")
    store = start_store("127.0.0.1", timeout_s=30)
    for role_name in ("weight_broadcaster", "rollout_server"):
        registry.register(role_name, 0, node="local", host="127.0.0.1", pid=os.getpid())
        registry.heartbeat(role_name, 0, 600.0, {})
    registry.publish_endpoint("weight_broadcaster", 0, "store", f"127.0.0.1:{store.port}")
    role = RolloutServer(cfg, 0, node="local", run_dir=tmp_path)
    role.weights_key = KEY
    setup = threading.Thread(target=role.setup, daemon=True)  # returns once v0 is in
    setup.start()
    link_id = wait_until(lambda: registry.endpoints("rollout_server", "weights_link"), 30)[0]
    fake = Broadcaster(store, timeout_s=30)
    fake.add(link_id)
    registry.set_trained_version(0)
    first = torch.from_numpy(role.layout.flatten(role.active).detach().numpy() + 0.01)
    assert fake.publish(0, first, tag=weights_tag(KEY, 0, first)) == []
    setup.join(timeout=30)
    assert not setup.is_alive()
    role._maybe_swap()
    try:
        yield role, registry, fake
    finally:
        role.stop_event.set()
        for link in fake.links.values():  # the server's weights thread, waiting, sees it end
            link.group.abort()
        role.requests.close()
        registry.clear_run()


def _serves_with(role: RolloutServer, version: int) -> None:
    sent: list[tuple[bytes, ActionReply]] = []
    role.requests.send_to = lambda identity, msg: sent.append((identity, msg)) or True
    request = ObsRequest(env_key="0/0", request_id=1, obs={"state": np.zeros(4, np.float32)})
    assert role._serve([(b"env", request)]) == 1
    ((_, reply),) = sent
    assert reply.policy_version == version and np.isfinite(reply.value)


def test_the_server_link_id_is_random(server) -> None:
    _role, registry, _ = server
    (link_id,) = registry.endpoints("rollout_server", "weights_link")
    assert re.fullmatch(r"rollout_server-0-[0-9a-f]{32}", link_id)
    assert str(os.getpid()) not in link_id


def test_the_server_refuses_hostile_versions_on_its_link_and_serves_on(server) -> None:
    role, registry, fake = server
    assert role.version == 0
    served = role.active_target.flat.clone()
    numel = role.layout.numel

    def offer(version: int, flat: torch.Tensor, tag: bytes, rejected: int) -> None:
        assert fake.publish(version, flat, tag=tag) == []
        wait_until(lambda: role.stats().get("weights_rejected", 0) == rejected, 10, "refusal")
        role._maybe_swap()
        assert role.version == 0 and torch.equal(role.active_target.flat, served)
        _serves_with(role, 0)

    registry.set_trained_version(1)
    nan = torch.full((numel,), float("nan"))
    offer(1, nan, weights_tag(KEY, 1, nan), 1)
    huge = served.clone()
    offer(HUGE, huge, weights_tag(KEY, HUGE, huge), 2)
    stale = served + 1.0
    offer(0, stale, weights_tag(KEY, 0, stale), 3)
    forged = served + 1.0
    offer(1, forged, weights_tag(OTHER_KEY, 1, forged), 4)
    offer(1, forged, NO_TAG, 5)
    good = served + 0.5
    assert fake.publish(1, good, tag=weights_tag(KEY, 1, good)) == []
    wait_until(lambda: role.pending_version == 1, 10, "v1 received")
    role._maybe_swap()
    assert role.version == 1 and torch.equal(role.active_target.flat, good)
    assert role.stats()["weights_rejected"] == 5
    _serves_with(role, 1)


# --- a restarting trainer --------------------------------------------------------------------------
class _Catcher(TrainingRole):
    """The part of a trainer that catches up with the run (``TrainingRole.catch_up_weights``)."""

    name = "trainer"

    def step(self) -> None:  # (never run)
        pass


@pytest.mark.parametrize(
    ("held_version", "signed_with", "taken"),
    [(5, KEY, True), (5, None, False), (5, OTHER_KEY, False), (HUGE, KEY, False)],
    ids=["signed", "unsigned", "other-key", "2**62"],
)
def test_a_restarted_trainer_keeps_its_checkpoint_over_an_unauthenticated_copy(
    tmp_path: Path, redis_url, monkeypatch, held_version, signed_with, taken
) -> None:
    role = _Catcher(_config("auth_tr", redis_url), 0, node="local", run_dir=tmp_path)
    role.weights_key = KEY
    module = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(1.0)  # what the checkpoint of v3 restored
    layout = FlatLayout.of(module)
    flat = np.full(layout.numel, 9.0, np.float32)
    tag = NO_TAG if signed_with is None else weights_tag(signed_with, held_version, flat)
    held = WeightsUpdate(version=held_version, layout=layout.digest, flat=flat, tag=tag)
    monkeypatch.setattr(role, "_held_weights", lambda after: held)
    role.registry.set_trained_version(5)
    role.registry.set_weight_version(5)
    try:
        version = role.catch_up_weights(module, 3)
    finally:
        role.registry.clear_run()
    assert version == 5  # the count goes on after the run's newest, either way
    expected = 9.0 if taken else 1.0
    assert all(torch.all(p == expected) for p in module.parameters())
    assert role.stats().get("weights_rejected", 0) == (0 if taken else 1)
