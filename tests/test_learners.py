"""The trainer's learners (PPO, GRPO: admission, holding, batches, eviction) and its chunk
accounting (counters and ledger entries for each fate of a chunk), without processes."""

from __future__ import annotations

import collections
import contextlib
import logging

import gymnasium as gym
import msgspec
import numpy as np
import pytest
import torch

from rlvla3.algo.learners import GrpoLearner, PpoLearner, build_learner
from rlvla3.config.run_config import AlgoConfig
from rlvla3.policy.mlp import MLPPolicy
from rlvla3.runtime.chunk_accounting import ChunkAccounting, producer_problem
from rlvla3.runtime.chunk_ledger import (
    balance,
    buffered_field,
    pushed_field,
    received_field,
    settled_field,
)
from tests.test_grpo import chunk
from transport.messages import TrajectoryChunk

CPU = torch.device("cpu")


def grouped(
    versions: list[int], group: str, producer: str, *, ends: bool = True
) -> TrajectoryChunk:
    """A chunk of ``len(versions)`` reward-1 steps (2-dim observations) of ``group``."""
    return chunk(producer, group, [1.0] * len(versions), ends=ends, versions=versions)


def ungrouped(versions: list[int], producer: str = "0/0#x") -> TrajectoryChunk:
    return grouped(versions, "", producer)


def test_the_learner_follows_algo_kind() -> None:
    ppo = build_learner(AlgoConfig(), on_policy_only=False, batch_steps=4, device=CPU)
    grpo = build_learner(AlgoConfig(kind="grpo"), on_policy_only=False, batch_steps=4, device=CPU)
    assert isinstance(ppo, PpoLearner) and ppo.objective.vf_coef == AlgoConfig().vf_coef
    assert isinstance(grpo, GrpoLearner)
    assert (grpo.objective.vf_coef, grpo.objective.norm_adv) == (0.0, False)  # no critic


def test_ppo_buffers_until_batch_steps_and_bounds_staleness_on_arrival() -> None:
    learner = PpoLearner(AlgoConfig(max_staleness=2), False, batch_steps=4, device=CPU)
    assert learner.admits(2) and not learner.admits(3) and not learner.admits(-1)
    per_round = PpoLearner(AlgoConfig(max_staleness=2), True, batch_steps=4, device=CPU)
    assert per_round.admits(0) and not per_round.admits(1)
    assert learner.chunk_problem(ungrouped([5])) is None
    assert learner.accept(ungrouped([5, 5])) is None and not learner.ready
    assert learner.accept(ungrouped([4, 5])) is None and learner.ready and learner.held == 2
    policy = MLPPolicy(2, gym.spaces.Discrete(2))
    taken = learner.take_batch(policy, version=5)
    assert taken.samples == 4 and taken.left_out == 0
    assert taken.batch is not None and taken.batch["advantages"].shape == (4,)
    assert taken.trained_lags.tolist() == [0, 0, 1, 0]
    assert learner.held == 0 and not learner.ready
    assert learner.evict_stale(version=100) == []


def test_grpo_holds_groups_and_bounds_staleness_per_sample() -> None:
    algo = AlgoConfig(kind="grpo", group_size=2, max_staleness=2, correction="none")
    learner = GrpoLearner(algo, False, batch_steps=3, device=CPU)
    assert learner.admits(50)  # held: the bound applies when the group is trained
    assert not GrpoLearner(algo, True, 3, CPU).admits(1)
    assert "group: empty" in learner.chunk_problem(ungrouped([0]))
    assert learner.accept(grouped([1, 5], "g", "a")) is None
    assert learner.held == 1 and not learner.ready
    assert learner.accept(grouped([6], "g", "b")) is None
    assert learner.held == 2 and learner.ready
    assert learner.accept(grouped([6], "g2", "c", ends=False)) is None
    assert learner.accept(grouped([6], "g2", "d", ends=False)) is None
    third_episode = learner.accept(grouped([6], "g2", "e"))
    assert third_episode is not None and "algo.group_size is 2" in third_episode
    assert learner.held == 4  # not the refused chunk
    taken = learner.take_batch(MLPPolicy(2, gym.spaces.Discrete(2)), version=6)
    assert taken.left_out == 1 and taken.samples == 2  # the step of version 1
    assert taken.trained_lags.tolist() == [1, 0]
    assert learner.held == 2  # group g2 still waits
    assert learner.evict_stale(version=8) == []
    assert len(learner.evict_stale(version=9)) == 2 and learner.held == 0


def test_grpo_takes_a_batch_of_nothing_when_every_step_is_too_stale() -> None:
    learner = GrpoLearner(AlgoConfig(kind="grpo", group_size=1, max_staleness=1), False, 1, CPU)
    assert learner.accept(grouped([1], "g", "a")) is None
    taken = learner.take_batch(MLPPolicy(2, gym.spaces.Discrete(2)), version=9)
    assert taken.batch is None and taken.left_out == 1 and taken.samples == 0


class _RedisSets:
    """The Redis calls of ``chunk_acks.hand_back_chunks``: ``SADD`` in a pipeline, one set."""

    def __init__(self, members: set[str]) -> None:
        self.members, self.replies = members, []

    def pipeline(self, transaction: bool = True) -> _RedisSets:
        self.replies = []
        return self

    def sadd(self, key: str, member: str) -> None:
        self.replies.append(int(member not in self.members))
        self.members.add(member)

    def execute(self) -> list[int]:
        return self.replies


class FakeTrainer:
    """The part of a Role the accounting uses, recording what it was told."""

    name, index = "trainer", 0
    chunk_key = b""  # a one-host run's: no chunk tags

    def __init__(
        self,
        ledger: dict[str, int] | None = None,
        backlog: int = 0,
        handed_back: set[str] | None = None,
    ) -> None:
        """``handed_back``: the run's chunks handed back by failed trainers (shared by the
        trainers of one test, as the run's Redis set is)."""
        self.counters: collections.Counter[str] = collections.Counter()
        self.ledger: collections.Counter[str] = collections.Counter()
        self.highs: dict[str, int] = {}
        self.flushes = 0
        self.log = logging.getLogger("fake-trainer")
        stored = dict(ledger or {})
        self.registry = type(
            "Registry",
            (),
            {
                "chunk_ledger": lambda _: stored,
                "chunk_backlog": lambda _: backlog,
                "run_id": "fake",
                "redis": _RedisSets(set() if handed_back is None else handed_back),
            },
        )()

    def count(self, name: str, amount: int = 1) -> None:
        self.counters[name] += amount

    def drop(self, counter: str, reason: str) -> None:
        self.count(counter)

    def ledger_add(self, field: str, amount: int) -> None:
        self.ledger[field] += amount

    def ledger_high(self, field: str, value: int) -> None:
        self.highs[field] = max(self.highs.get(field, -1), value)

    def flush(self) -> None:
        self.flushes += 1

    def counting_together(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _accounting(role: FakeTrainer) -> ChunkAccounting:
    return ChunkAccounting(role, flush_counters=role.flush)  # type: ignore[arg-type]


def numbered(chunk_id: int, producer: str = "0/0#x", versions: list[int] | None = None):
    return msgspec.structs.replace(ungrouped(versions or [1], producer), chunk_id=chunk_id)


def test_each_fate_of_a_chunk_is_counted() -> None:
    role = FakeTrainer()
    accounting = _accounting(role)
    buffered = buffered_field("trainer/0")
    assert accounting.receive(b"not a chunk") is None and role.counters["bad_frames"] == 1
    chunks = [accounting.receive(numbered(i, versions=[1, 1])) for i in range(4)]
    assert all(c is not None for c in chunks) and role.counters["chunks_received"] == 4
    assert role.ledger[buffered] == 4  # received and not settled
    first, second, third, fourth = chunks
    accounting.refuse(first, "obs: not finite")
    assert role.counters["bad_chunks"] == 1 and role.counters["samples_dropped"] == 2
    accounting.record(second)
    assert role.highs[received_field("0/0#x", "trainer/0")] == 1
    accounting.drop_received(second, "too stale")
    assert role.counters["chunks_dropped"] == 2 and role.counters["samples_dropped"] == 4
    accounting.drop_held([third], "incomplete group")
    assert role.counters["chunks_dropped"] == 3 and role.ledger[buffered] == 1
    accounting.trained([fourth], samples=1, left_out=1, lags=np.array([0, 1, 3, 7]))
    assert role.ledger[buffered] == 0 and role.highs[settled_field("0/0#x")] == 4
    assert role.counters["chunks_consumed"] == 1 and role.counters["samples_consumed"] == 1
    assert role.counters["samples_dropped"] == 7
    staleness = {k: v for k, v in role.counters.items() if k.startswith("trained_staleness")}
    assert staleness == {
        "trained_staleness_0": 1,
        "trained_staleness_1": 1,
        "trained_staleness_3plus": 2,
    }


def test_a_refused_chunk_is_produced_once_whoever_its_producer_is() -> None:
    """A refused chunk of a known producer is produced by its producer's record, as any
    other; one whose producer cannot go into the ledger is produced by its own count: the
    balance loses neither and counts neither twice."""
    from rlvla3.runtime.chunk_ledger import balance, pushed_field

    role = FakeTrainer()
    accounting = _accounting(role)
    chunks = [accounting.receive(numbered(i)) for i in range(3)]
    accounting.refuse(chunks[0], "obs: not finite")
    # refused as it arrives: its producer cannot go into the ledger
    assert accounting.receive(numbered(0, producer="no producer id")) is None
    for kept in chunks[1:]:
        accounting.record(kept)
    accounting.trained(chunks[1:], samples=2, left_out=0, lags=np.array([0]))
    role.flush()
    ledger = {**role.ledger, **role.highs, pushed_field("0/0#x"): 2}  # the worker pushed 0..2
    result = balance(ledger, role.counters)
    assert role.counters["bad_chunks"] == 2 and role.counters["bad_chunks_unattributed"] == 1
    assert (result.produced, result.consumed, result.dropped) == (4, 2, 2)
    assert result.lost == 0 and result.balanced, result
    # a refused chunk naming a producer no env worker recorded (forged): produced by itself
    stranger = accounting.receive(numbered(0, producer="9/9#forged"))
    assert stranger is not None
    accounting.refuse(stranger, "rewards: 33 steps, over env.chunk_len=32")
    role.flush()
    result = balance({**role.ledger, **role.highs, pushed_field("0/0#x"): 2}, role.counters)
    assert (result.produced, result.dropped, result.lost) == (5, 3, 0) and result.balanced


def test_a_chunk_settled_ahead_is_counted_once_the_mark_passes_it() -> None:
    role = FakeTrainer()
    accounting = _accounting(role)
    early, late = (accounting.receive(numbered(i)) for i in range(2))
    assert early is not None and late is not None
    accounting.drop_received(late, "too stale")  # chunk 0 still held: 1 waits for it
    assert role.counters["chunks_dropped"] == 0 and settled_field("0/0#x") not in role.highs
    assert role.ledger[buffered_field("trainer/0")] == 2  # a successor gets both resent
    accounting.trained([early], samples=1, left_out=0, lags=np.array([0]))
    assert role.counters["chunks_dropped"] == 1 and role.counters["chunks_consumed"] == 1
    assert role.highs[settled_field("0/0#x")] == 2 and role.ledger[buffered_field("trainer/0")] == 0


def test_a_resent_chunk_already_received_or_settled_is_a_duplicate_once_each() -> None:
    role = FakeTrainer(ledger={settled_field("0/0#x"): 3})  # a predecessor settled 0, 1, 2
    accounting = _accounting(role)
    for chunk_id in (1, 2):
        assert accounting.receive(numbered(chunk_id)) is None
    held = accounting.receive(numbered(3))
    assert held is not None
    assert accounting.receive(numbered(3)) is None  # resent while held here
    assert accounting.receive(numbered(0, producer="1/0#y")) is not None  # another producer
    assert role.counters["chunks_duplicate"] == 3 and role.counters["chunks_received"] == 2
    accounting.trained([held], samples=1, left_out=0, lags=np.array([0]))
    assert accounting.receive(numbered(3)) is None and role.counters["chunks_duplicate"] == 4


def test_a_killed_trainers_buffer_goes_back_to_its_producers() -> None:
    role = FakeTrainer(ledger={buffered_field("trainer/0"): 5}, backlog=7)
    accounting = _accounting(role)
    accounting.write_off_dead_buffer()
    assert role.counters["chunks_returned"] == 5 and "chunks_lost_in_trainer" not in role.counters
    assert role.ledger[buffered_field("trainer/0")] == -5
    accounting.write_off_lost_chunks()
    assert role.counters["chunks_written_off"] == 7 and role.flushes == 2


def _successor_ledger(role: FakeTrainer) -> dict[str, int]:
    """The ledger a trainer's successor reads: its predecessor's additions and marks."""
    return {**role.ledger, **role.highs}


def test_a_failed_trainer_hands_its_buffer_back_as_a_killed_one_would() -> None:
    """Chunk 0 held, 1 trained (its fate waits for 0), 2-3 held: nothing is settled or
    counted, so the successor counts all four returned and takes them again when resent."""
    role = FakeTrainer()
    accounting = _accounting(role)
    chunks = [accounting.receive(numbered(i)) for i in range(4)]
    accounting.trained([chunks[1]], samples=1, left_out=0, lags=np.array([0]))
    accounting.hand_back()
    assert "chunks_in_flight_at_exit" not in role.counters
    assert "chunks_consumed" not in role.counters and settled_field("0/0#x") not in role.highs
    successor = FakeTrainer(ledger=_successor_ledger(role))
    following = _accounting(successor)
    following.write_off_dead_buffer()
    assert successor.counters["chunks_returned"] == 4
    assert all(following.receive(numbered(i)) is not None for i in range(4))


def test_a_chunk_handed_back_twice_is_settled_in_flight_the_second_time() -> None:
    """A chunk that two trainers held when they failed may be what fails them: the second
    settles it (and what it holds for the first time goes back)."""
    handed_back: set[str] = set()
    first = FakeTrainer(handed_back=handed_back)
    accounting = _accounting(first)
    for i in range(2):
        accounting.receive(numbered(i))
    accounting.hand_back()
    second = FakeTrainer(ledger=_successor_ledger(first), handed_back=handed_back)
    following = _accounting(second)
    following.write_off_dead_buffer()
    for i in range(3):  # 0 and 1 resent, 2 new
        assert following.receive(numbered(i)) is not None
    following.hand_back()
    assert second.counters["chunks_in_flight_at_exit"] == 2
    assert second.highs[settled_field("0/0#x")] == 2  # 2 goes back: its successor takes it
    third = _accounting(FakeTrainer(ledger=_successor_ledger(second), handed_back=handed_back))
    assert third.receive(numbered(1)) is None and third.receive(numbered(2)) is not None


def test_without_resend_buffers_a_killed_trainers_buffer_is_lost() -> None:
    role = FakeTrainer(ledger={buffered_field("trainer/0"): 5})
    ChunkAccounting(role, role.flush, resent=False).write_off_dead_buffer()  # type: ignore[arg-type]
    assert role.counters["chunks_lost_in_trainer"] == 5 and "chunks_returned" not in role.counters


def test_without_resend_buffers_a_successor_passes_the_numbers_that_died_before_it() -> None:
    """A killed trainer held chunks 3-5 and its queue 6-7 (no resend buffers: they never come
    again); its successor receives 8 onwards. The producer's mark passes the gap, so each later
    chunk is counted as it settles, not held back until exit."""
    role = FakeTrainer(ledger={settled_field("0/0#x"): 3, buffered_field("trainer/0"): 3})
    accounting = ChunkAccounting(role, role.flush, resent=False)  # type: ignore[arg-type]
    accounting.write_off_dead_buffer()
    assert role.counters["chunks_lost_in_trainer"] == 3
    refused = accounting.receive(numbered(8))
    assert refused is not None
    accounting.refuse(refused, "obs: not finite")  # settled above the gap: waits
    assert "chunks_dropped" not in role.counters
    chunks = [accounting.receive(numbered(i)) for i in (9, 10)]
    for received in chunks:
        assert received is not None
        accounting.record(received)
    assert role.highs[settled_field("0/0#x")] == 9  # 3-7 given up, 8 settled: 9 held
    assert role.counters["chunks_dropped"] == 1
    accounting.trained(chunks, samples=2, left_out=0, lags=np.array([0, 0]))
    assert role.counters["chunks_consumed"] == 2 and role.highs[settled_field("0/0#x")] == 11
    assert role.ledger[buffered_field("trainer/0")] == -3  # the write-off's; none left held
    assert accounting.receive(numbered(5)) is None  # given up: a duplicate were it to come


def test_the_mark_passes_what_a_full_resend_buffer_let_go_and_waits_for_what_it_keeps() -> None:
    """A killed trainer held chunks 3-7; the producer's buffer, full, let 3-5 go and keeps
    6 and 7 (chunk 8 says ``resend_from`` 6). The successor's mark passes 3-5 and waits for the
    resent 6 and 7."""
    role = FakeTrainer(ledger={settled_field("0/0#x"): 3})
    accounting = _accounting(role)
    newest = accounting.receive(msgspec.structs.replace(numbered(8), resend_from=6))
    assert newest is not None
    accounting.record(newest)
    assert role.highs[settled_field("0/0#x")] == 6
    resent = [
        accounting.receive(msgspec.structs.replace(numbered(i), resend_from=6)) for i in (6, 7)
    ]
    for again in resent:
        assert again is not None
        accounting.record(again)
    accounting.trained([newest, *resent], samples=3, left_out=0, lags=np.array([0]))
    assert role.highs[settled_field("0/0#x")] == 9 and role.counters["chunks_consumed"] == 3
    assert accounting.receive(numbered(4)) is None  # given up: a duplicate were it to come


def test_with_resend_buffers_the_mark_waits_for_a_resent_chunk() -> None:
    role = FakeTrainer(ledger={settled_field("0/0#x"): 3})
    accounting = _accounting(role)  # resent: chunks 3-7 come again
    received = accounting.receive(numbered(8))
    assert received is not None
    accounting.record(received)
    accounting.trained([received], samples=1, left_out=0, lags=np.array([0]))
    assert "chunks_consumed" not in role.counters and settled_field("0/0#x") not in role.highs
    assert accounting.receive(numbered(3)) is not None


def test_draining_counts_queued_and_held_chunks_in_flight() -> None:
    role = FakeTrainer()
    accounting = _accounting(role)
    for i in range(4):
        assert accounting.receive(numbered(i)) is not None  # held by the learner
    queue = collections.deque([numbered(4), "junk", numbered(2), ungrouped([1], ""), None])

    class Queue:
        def recv(self, timeout_s: float) -> object:
            return queue.popleft()

    accounting.drain(Queue(), held=4)  # type: ignore[arg-type]
    assert role.counters["chunks_received"] == 6 and role.counters["chunks_duplicate"] == 1
    assert role.counters["chunks_in_flight_at_exit"] == 5
    # the producerless one is refused as on arrival: produced and dropped by its own count
    assert role.counters["bad_chunks_unattributed"] == 1 and role.counters["chunks_dropped"] == 1
    assert received_field("0/0#x", "trainer/0") in role.highs  # not the producerless
    assert role.highs[settled_field("0/0#x")] == 5  # settled: not resent to a successor
    assert role.ledger[buffered_field("trainer/0")] == 0
    role.flush()
    result = balance({**role.ledger, **role.highs, pushed_field("0/0#x"): 4}, role.counters)
    assert result.lost == 0 and result.balanced, result


def test_a_chunk_drained_at_exit_gives_up_nothing_above_itself() -> None:
    """The drain records chunks no check has seen: a forged ``resend_from`` far above the
    chunk's number must not lift its producer's mark past it (a successor would take every
    later chunk of that producer for a duplicate)."""
    role = FakeTrainer()
    accounting = _accounting(role)
    queue = collections.deque([msgspec.structs.replace(numbered(4), resend_from=2**62), None])

    class Queue:
        def recv(self, timeout_s: float) -> object:
            return queue.popleft()

    accounting.drain(Queue(), held=0)  # type: ignore[arg-type]
    assert role.highs[settled_field("0/0#x")] == 5  # 0-3 given up, 4 in flight at exit


@pytest.mark.parametrize(
    ("producer", "chunk_id", "problem"),
    [
        ("0/0#x", 0, None),
        ("", 0, "producer: empty"),
        ("0/0#x", -1, "chunk_id: -1"),
        ("0/0#x" * 30, 0, "producer: 150 characters, over 128"),
        ("0/0#x\n*", 0, "producer: '0/0#x\\n*' has characters outside"),
        ("0/0 x", 0, "producer: '0/0 x' has characters outside"),
    ],
)
def test_the_ledger_takes_only_chunks_with_a_producer_and_sequence_number(
    producer: str, chunk_id: int, problem: str | None
) -> None:
    found = producer_problem(msgspec.structs.replace(ungrouped([0], producer), chunk_id=chunk_id))
    assert found is None if problem is None else problem in found


@pytest.mark.parametrize(
    ("group", "problem"),
    [("0/0#x:3", None), ("g" * 129, "group: 129 characters"), ("a\x00", "group: 'a\\x00' has")],
)
def test_a_group_name_is_bounded_in_length_and_characters(group: str, problem: str | None) -> None:
    """A group becomes part of Redis fields and log lines, like a producer."""
    found = producer_problem(grouped([0], group, "0/0#x"))
    assert found is None if problem is None else problem in found
