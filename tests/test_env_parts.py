"""The parts env runners are made of (``roles/env/``): the policy client's retry and reply
matching against a real server socket, the pacing's pauses and sync rounds, the evaluation
rounds' bookkeeping, and the episode queue's writes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from roles.env.episode_queue import EpisodeQueue, FinishedEpisode
from roles.env.eval_rounds import EvalRounds
from roles.env.pacing import EpisodeBudget, Pacing
from roles.env.peers import Peers
from roles.env.policy_client import PolicyClient
from tests.env_fakes import RecordingCounters
from transport import sockets
from transport.messages import ActionReply


def _reply(request_id: int, action: int) -> ActionReply:
    return ActionReply(
        request_id=request_id, action=np.array(action), log_prob=-0.1, value=0.5, policy_version=3
    )


def _act_against(serve: Callable[[sockets.RouterSocket], None], timeout_s: float):
    """A ``PolicyClient``'s one ask for one observation, answered by ``serve`` on a real
    router socket in a thread: its acts and counters."""
    server = sockets.RouterSocket()
    address = server.bind()
    counters = RecordingCounters()
    thread = threading.Thread(target=serve, args=(server,), daemon=True)
    thread.start()
    client = PolicyClient(
        env_key="0/0",
        env_index=0,
        timeout_s=timeout_s,
        peers=Peers([address], []),
        counters=counters,
        log=logging.getLogger("test"),
        stop_event=threading.Event(),
    )
    client.open()
    try:
        acts = client.act([{"state": np.zeros(3, np.float32)}])
    finally:
        client.close()
        thread.join(timeout=10)
        server.close()
    return acts, counters.counters


def test_the_policy_client_resends_on_timeout_and_skips_late_replies() -> None:
    """The server leaves the first request unanswered; the client re-sends it after its
    timeout, and of the two replies to come, the one to the first request is skipped."""

    def serve(server: sockets.RouterSocket) -> None:
        first = server.recv_from(timeout_s=10)
        second = server.recv_from(timeout_s=10)
        assert first is not None and second is not None
        server.send_to(second[0], _reply(first[1].request_id, action=7))  # late: skipped
        server.send_to(second[0], _reply(second[1].request_id, action=2))

    acts, counters = _act_against(serve, timeout_s=0.5)
    assert [int(a.action) for a in acts] == [2] and acts[0].version == 3
    assert counters["request_timeouts"] == 1
    assert counters["action_requests"] == 1  # one ask, however many sends


def test_a_reply_that_cannot_be_acted_on_is_counted_and_the_client_waits_for_a_good_one() -> None:
    """A broken or hostile server's reply to the request just sent (an impossible version,
    a NaN log-prob) is refused and counted, not acted on; the right one that follows is."""

    def serve(server: sockets.RouterSocket) -> None:
        got = server.recv_from(timeout_s=10)
        assert got is not None
        peer, request = got
        bad = _reply(request.request_id, action=7)
        server.send_to(peer, msgspec.structs.replace(bad, policy_version=2**63 - 1))
        server.send_to(peer, msgspec.structs.replace(bad, log_prob=float("nan")))
        server.send_to(peer, _reply(request.request_id, action=2))

    acts, counters = _act_against(serve, timeout_s=10.0)
    assert [int(a.action) for a in acts] == [2]
    assert counters["bad_replies"] == 2 and "request_timeouts" not in counters


def test_a_batch_reply_is_held_to_the_rows_asked_for() -> None:
    from roles.env.policy_client import reply_problem
    from transport.messages import ActionBatchReply

    def batch(rows: int, **changes: Any) -> ActionBatchReply:
        fields = dict(
            request_id=1,
            actions=np.zeros(rows, np.int64),
            log_probs=np.zeros(rows, np.float32),
            values=np.zeros(rows, np.float32),
            policy_version=1,
        )
        return ActionBatchReply(**{**fields, **changes})

    assert reply_problem(batch(3), 3) is None
    assert reply_problem(batch(3, actions=np.zeros(2, np.int64)), 3).startswith("actions:")
    assert reply_problem(batch(3, env_actions=np.zeros((4, 2))), 3).startswith("env_actions:")
    assert reply_problem(batch(3, values=np.zeros((3, 1), np.float32)), 3).startswith("values:")
    assert reply_problem(batch(3, policy_version=-1), 3).startswith("policy_version -1")
    # absurd numbers: the trainer would refuse every chunk holding one (data lost)
    huge = np.array([0, 1e30, 0], np.float32)
    assert reply_problem(batch(3, values=huge), 3).startswith("values: float32[3], expected 3")
    continuous = np.zeros((3, 2), np.float32)
    assert reply_problem(batch(3, actions=continuous), 3) is None
    continuous[1, 0] = np.nan
    assert reply_problem(batch(3, actions=continuous), 3) == "actions: not finite or beyond 1e+06"
    assert reply_problem(batch(3, env_actions=np.full((3, 2), 2e6)), 3).startswith("env_actions")


def test_a_single_reply_is_held_to_sane_numbers() -> None:
    from roles.env.policy_client import reply_problem

    good = _reply(1, action=2)
    assert reply_problem(good, None) is None
    for changes in ({"value": 1e30}, {"log_prob": -float("inf")}, {"log_prob": float("nan")}):
        assert reply_problem(msgspec.structs.replace(good, **changes), None).startswith(
            "log_prob, value: not finite or beyond"
        )
    sampled = msgspec.structs.replace(good, action=np.full(2, 3e38, np.float32))
    assert reply_problem(sampled, None) == "action: not finite or beyond 1e+06"


def test_pacing_holds_runners_during_back_pressure_and_asks_again_after() -> None:
    pacing = Pacing(threading.Event(), groups=1, lock_step=False, version=0)
    asked: list[int] = []

    def ask() -> int:
        asked.append(1)
        return 5

    assert pacing.hold(4, round_over=False, ask=ask, version_of=int) is None and not asked
    assert pacing.pause() and not pacing.pause()  # one pause, counted once
    threading.Timer(0.2, pacing.resume).start()
    assert pacing.hold(4, round_over=False, ask=ask, version_of=int) == 5 and len(asked) == 1


@pytest.mark.parametrize(("start", "first"), [(-1, 0), (0, 0), (-1, 7)])
def test_an_episode_budget_pauses_after_its_episodes_until_the_next_version(
    start: int, first: int
) -> None:
    """``first``: the first version published (7: a resumed trainer's); ``start``: what the
    worker read at setup (-1: nothing published yet)."""
    pacing = Pacing(threading.Event(), groups=1, lock_step=False, version=start)
    budget = EpisodeBudget(pacing, per_version=1, version=start)
    budget.episode_ended()  # played on the first version (servers serve nothing before it)
    assert pacing.paused
    budget.see(first, evaluating=False)  # published: already played, no second budget
    assert pacing.paused
    budget.see(first + 1, evaluating=False)
    assert not pacing.paused
    budget.episode_ended()
    assert pacing.paused
    budget.see(first + 1, evaluating=True)  # the end-of-run evaluation plays unpaused
    assert not pacing.paused


def test_a_sync_round_waits_for_a_newer_version_and_acts_on_the_newest() -> None:
    pacing = Pacing(threading.Event(), groups=1, lock_step=True, version=0)
    assert pacing.round_over(8, chunk_len=8) and not pacing.round_over(7, chunk_len=8)
    versions = iter([1, 2, 2])  # the server swaps weights in between two batches
    threading.Timer(0.2, pacing.see_version, args=(2,)).start()
    assert pacing.hold(0, round_over=True, ask=lambda: next(versions), version_of=int) == 2
    pacing.stop_event.set()
    with pytest.raises(InterruptedError):  # stopped while waiting for a version after 2
        pacing.hold(2, round_over=True, ask=lambda: 2, version_of=int)


def test_eval_rounds_hand_out_episodes_and_void_an_unfinished_round() -> None:
    rounds = EvalRounds()
    assert not rounds.start(1, version=5, episodes=2)
    first, second = rounds.take(), rounds.take()
    assert first is not None and second is not None and rounds.take() is None
    rounds.finish(first, {"return": 1.0, "length": 3})
    assert rounds.collect(2) is None  # one of two in
    assert rounds.start(2, version=6, episodes=1)  # round 1 voided
    assert not rounds.still_current(second)
    rounds.finish(second, {"return": 9.0, "length": 9})  # an old round's: dropped
    third = rounds.take()
    assert third is not None and (third.round, third.version, third.index) == (2, 6, 0)
    rounds.finish(third, {"return": 2.0, "length": 4})
    done = rounds.collect(1)
    assert done is not None and (done.round, done.version) == (2, 6)
    assert done.results == [{"return": 2.0, "length": 4}]
    assert rounds.collect(1) is None  # collected once


class _Registry:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.series: list[dict[str, Any]] = []

    def counters(self) -> dict[str, int]:
        if self.fail:
            raise ConnectionError("redis gone")
        return {"env_steps": 40}

    def append(self, series: str, points: list[dict[str, Any]]) -> None:
        self.series.extend(points)


def test_the_episode_queue_keeps_episodes_a_failed_write_did_not_record() -> None:
    counters = RecordingCounters()
    queue = EpisodeQueue(worker_index=3, counters=counters)
    queue.record(
        FinishedEpisode(episode_return=2.0, length=5, success=None, versions=(1, 2), greedy=False)
    )
    queue.record(
        FinishedEpisode(episode_return=1.0, length=4, success=True, versions=(2, 2), greedy=True)
    )
    assert counters.counters["episodes"] == 2
    with pytest.raises(ConnectionError):
        queue.write(_Registry(fail=True))  # type: ignore[arg-type]
    assert len(queue) == 2
    registry = _Registry(fail=False)
    queue.write(registry)  # type: ignore[arg-type]
    assert len(queue) == 0 and [p["return"] for p in registry.series] == [2.0, 1.0]
    first, second = registry.series
    assert (first["worker"], first["min_version"], first["max_version"]) == (3, 1, 2)
    assert "success" not in first and second["success"] is True and second["greedy"] is True
    assert first["env_steps"] == second["env_steps"] == 40
