"""The training group's messages (``rlvla3/runtime/train_group.py``): two ranks of one gloo
group, in two threads of this process, over rank 0's real ``TCPStore``."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlvla3.runtime.train_group import (
    POLL_IDLE_S,
    STOP,
    GroupError,
    TrainGroup,
    follower_store,
)
from transport.weights import start_store


@pytest.fixture
def ranks():
    """Rank 0 and rank 1 of a group of two."""
    store = start_store("127.0.0.1", timeout_s=30)
    client = follower_store(f"127.0.0.1:{store.port}", timeout_s=30)

    def rank(index: int) -> TrainGroup:
        own = store if index == 0 else client
        return TrainGroup(own, index, 2, torch.device("cpu"), "127.0.0.1", timeout_s=30)

    with ThreadPoolExecutor(2) as pool:
        leader, follower = pool.map(rank, [0, 1])
    yield leader, follower
    leader.close()
    follower.close()


def test_a_waiting_poll_sees_a_header_posted_while_it_waits(ranks) -> None:
    leader, follower = ranks
    posted, polling = threading.Event(), threading.Event()

    def post_once_polling() -> None:
        assert polling.wait(timeout=30)  # the follower is entering its wait
        leader.post("update", {"n": 1}, {})
        posted.set()

    poster = threading.Thread(target=post_once_polling)
    poster.start()
    polling.set()
    message = follower.poll(wait_s=10.0)
    poster.join()
    assert posted.is_set() and message is not None and message.info == {"n": 1}
    assert follower.poll() is None  # nothing more: at once


def test_a_waiting_poll_gives_up_after_its_wait(ranks) -> None:
    started = time.monotonic()
    assert ranks[1].poll(wait_s=POLL_IDLE_S) is None
    assert time.monotonic() - started < 1.0


def test_a_lazy_message_brings_its_tensors_one_at_a_time(ranks) -> None:
    leader, follower = ranks
    tensors = {"a": torch.arange(3.0), "b": torch.ones(2, 2, dtype=torch.int64)}
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(leader.post, "state", {}, tensors)
        message = follower.wait(lazy=True)
        assert message.tensors == {} and [s[0] for s in message.pending] == ["a", "b"]
        received = dict(follower.receive(message))
        sent.result(timeout=30)
    assert received.keys() == tensors.keys()
    for name, value in tensors.items():
        assert torch.equal(received[name], value)


def test_a_malformed_header_at_a_stop_is_a_group_error(ranks) -> None:
    leader, follower = ranks
    leader.store.set("message/1", "not json")
    with pytest.raises(GroupError, match="not a header"):
        follower.follow_to_stop(lambda message: None, timeout_s=10.0)


def test_a_follower_at_a_stop_follows_until_the_leader_says_stop(ranks) -> None:
    leader, follower = ranks
    leader.post("update", {}, {})
    leader.post(STOP, {}, {})
    followed = []
    assert follower.follow_to_stop(followed.append, timeout_s=10.0)
    assert [m.kind for m in followed] == ["update"]


def test_the_group_watch_waits_out_expired_heartbeats_but_not_a_restart(monkeypatch) -> None:
    """After a Redis outage longer than a heartbeat's TTL every peer's heartbeat has expired:
    a peer unseen for less than the TTL is not yet gone (it beats again within a second of
    the link's return); unseen for longer, or back with another pid, it left the group."""
    from types import SimpleNamespace

    from rlvla3.runtime import group_watch
    from rlvla3.runtime.group_watch import GroupWatch

    clock = [100.0]
    monkeypatch.setattr(group_watch.time, "monotonic", lambda: clock[0])
    peer = {"pid": 42, "alive": True}
    registry = SimpleNamespace(roles=lambda: [SimpleNamespace(role="trainer", index=1, **peer)])
    role = SimpleNamespace(
        name="trainer",
        registry=registry,
        cfg=SimpleNamespace(run=SimpleNamespace(heartbeat_ttl_s=5.0)),
    )
    watch = GroupWatch(role, SimpleNamespace(world_size=2, rank=0))

    def check_at(t: float) -> None:
        clock[0] = t
        watch.check()

    check_at(102.0)
    peer["alive"] = False  # the outage: every heartbeat expired
    check_at(110.0)
    check_at(113.0)  # unseen for 3 s: not yet
    peer["alive"] = True  # it beats again
    check_at(115.0)
    peer["alive"] = False  # now it is gone for good
    check_at(120.0)
    with pytest.raises(GroupError, match="trainer/1 left the group"):
        check_at(126.0)
    peer.update(alive=True, pid=43)  # restarted: another process in its place, at once
    watch = GroupWatch(role, SimpleNamespace(world_size=2, rank=0))
    peer["pid"] = 44
    with pytest.raises(GroupError, match="trainer/1 left the group"):
        check_at(128.0)
