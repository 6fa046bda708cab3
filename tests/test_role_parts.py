"""The parts a role is built from: its liveness deadline, its Redis outage clock, its counter
batch and its drop reports."""

from __future__ import annotations

import logging
import time

from rlvla3.runtime.counter_batch import CounterBatch, DropReports
from rlvla3.runtime.heartbeat import Liveness, RedisOutage


def test_the_deadline_follows_progress_busy_work_and_stuck_work() -> None:
    live = Liveness(stall_timeout_s=10.0, busy_timeout_s=100.0)
    assert live.deadline(lambda: None) == (0.0, "")  # not running: never stalled
    live.progress()
    at, what = live.deadline(lambda: None)
    assert what == "" and abs(at - (time.time() + 10.0)) < 1.0
    with live.busy("PPO update"):
        at, what = live.deadline(lambda: None)
        assert what == "PPO update" and at > time.time() + 90.0
    stuck_since = time.time() - 8.0
    at, what = live.deadline(lambda: (stuck_since, "env 3"))
    assert what == "env 3" and at == stuck_since + 10.0
    live.stopping()
    assert live.deadline(lambda: (stuck_since, "env 3")) == (0.0, "")


def test_an_outage_starts_once_and_ends_when_redis_answers() -> None:
    outage = RedisOutage(limit_s=0.0)
    assert outage.duration_s() == 0.0
    assert outage.mark_lost(time.monotonic()) and not outage.mark_lost(time.monotonic())
    assert outage.gone_for_good()
    outage.clear()
    assert outage.duration_s() == 0.0


class _Registry:
    """Applies each flush number once, as ``rlvla3/runtime/flush_once.py`` does; ``fail``: the next call raises,
    ``lose_reply``: the next call applies the flush and then raises (its reply lost)."""

    def __init__(self) -> None:
        self.fail = self.lose_reply = False
        self.flushed: list[tuple[dict, dict, dict]] = []
        self.last_number = -1

    def flush(self, amounts, highs, ledger, *, flusher: str, number: int) -> bool:
        assert flusher == "trainer/0#ab"
        if self.fail:
            raise ConnectionError("down")
        applied = number > self.last_number
        if applied:
            self.flushed.append((amounts, highs, ledger))
            self.last_number = number
        if self.lose_reply:
            self.lose_reply = False
            raise ConnectionError("connection closed by server")
        return applied


def test_a_failed_flush_is_sent_again_before_anything_newer() -> None:
    batch, log, registry = CounterBatch("trainer/0#ab"), logging.getLogger("test"), _Registry()
    batch.add("env_steps", 3)
    batch.raise_high("pushed", 5)
    batch.raise_high("pushed", 4)  # a high-water mark never falls
    batch.add_to_ledger("buffered", 2)
    registry.fail = True
    batch.flush(registry, log)  # type: ignore[arg-type]
    batch.add("env_steps", 1)
    batch.flush(registry, log)  # type: ignore[arg-type]  (still down)
    registry.fail = False
    batch.flush(registry, log)  # type: ignore[arg-type]
    batch.flush(registry, log)  # type: ignore[arg-type]  (nothing new: no write)
    assert registry.flushed == [
        ({"env_steps": 3}, {"pushed": 5}, {"buffered": 2}),
        ({"env_steps": 1}, {}, {}),
    ]


def test_a_flush_whose_reply_was_lost_is_not_counted_twice() -> None:
    batch, log, registry = CounterBatch("trainer/0#ab"), logging.getLogger("test"), _Registry()
    batch.add("chunks_received", 4)
    registry.lose_reply = True
    batch.flush(registry, log)  # type: ignore[arg-type]  (applied; the role cannot know)
    batch.add("chunks_received", 1)
    batch.flush(registry, log)  # type: ignore[arg-type]  (the retry is skipped, then the 1)
    assert registry.flushed == [({"chunks_received": 4}, {}, {}), ({"chunks_received": 1}, {}, {})]


def test_drops_are_reported_at_most_once_per_period() -> None:
    now = [100.0]
    reports = DropReports(every_s=0.5, clock=lambda: now[0])
    assert reports.due("bad_frames") == 0
    assert reports.due("bad_frames") is None and reports.due("bad_frames") is None
    assert reports.due("bad_chunks") == 0  # each counter on its own
    now[0] += 0.4
    assert reports.due("bad_frames") is None  # still inside the period
    now[0] += 0.2
    assert reports.due("bad_frames") == 3


def test_what_is_counted_together_lands_in_one_flush() -> None:
    """A chunk's fate and the settled mark that releases it are counted in one ``together``
    block: a flush from another thread (the heartbeat's) never takes one without the other."""
    import threading

    batch, log, registry = CounterBatch("trainer/0#ab"), logging.getLogger("test"), _Registry()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.is_set():
            batch.flush(registry, log)  # type: ignore[arg-type]

    flusher = threading.Thread(target=heartbeat)
    flusher.start()
    try:
        for settled in range(1, 30_001):
            with batch.together():
                batch.add("chunks_consumed", 1)
                batch.raise_high("settled|p", settled)
    finally:
        done.set()
        flusher.join()
    batch.flush(registry, log)  # type: ignore[arg-type]
    consumed = 0
    for counts, highs, _ in registry.flushed:
        consumed += counts.get("chunks_consumed", 0)
        assert highs.get("settled|p") == consumed  # every flush: counts and mark agree
    assert consumed == 30_000 and len(registry.flushed) > 1
