"""Registry and embedded Redis: registration, heartbeat expiry, endpoints, counters."""

from __future__ import annotations

import os
from pathlib import Path

import redis

from rlvla3.launch.redis_server import EmbeddedRedis, find_redis_server
from rlvla3.runtime import keys
from rlvla3.runtime.chunk_acks import hand_back_chunks
from tests.conftest import wait_until


def test_embedded_redis_is_started_and_removed() -> None:
    server = EmbeddedRedis().start()
    directory, pid = Path(server.directory), server.process.pid
    client = redis.Redis.from_url(server.url)
    assert client.ping()
    assert client.config_get("save")["save"] == ""  # persistence off
    client.close()
    server.stop()
    assert not directory.exists()
    wait_until(lambda: not _pid_alive(pid), 10, "redis-server process to exit")


def test_find_redis_server_returns_an_executable() -> None:
    assert os.access(find_redis_server(), os.X_OK)


def test_register_heartbeat_and_expiry(registry) -> None:
    registry.register("demo_sink", 0, node="local", host="127.0.0.1", pid=123)
    registry.heartbeat("demo_sink", 0, ttl_s=0.3, stats={"queue_depth": 4})
    rec = registry.roles()[0]
    assert (rec.role, rec.index, rec.pid, rec.status, rec.alive) == (
        "demo_sink",
        0,
        123,
        "starting",
        True,
    )
    assert rec.stats == {"queue_depth": 4.0}
    wait_until(lambda: not registry.roles()[0].alive, 10, "heartbeat TTL to expire")
    registry.publish_stats("demo_sink", 0, {"queue_depth": 0})  # a stopping role's last gauges
    rec = registry.roles()[0]
    assert rec.stats == {"queue_depth": 0.0} and not rec.alive  # no heartbeat refreshed


def test_endpoints_are_found_only_for_live_roles(registry) -> None:
    for i in range(2):
        registry.register("demo_sink", i, node="local", host="127.0.0.1", pid=i)
        registry.publish_endpoint("demo_sink", i, "queue", f"tcp://127.0.0.1:{5000 + i}")
    assert registry.endpoints("demo_sink", "queue") == []
    registry.heartbeat("demo_sink", 1, ttl_s=30, stats={})
    registry.heartbeat("demo_sink", 0, ttl_s=30, stats={})
    assert registry.endpoints("demo_sink", "queue") == [
        "tcp://127.0.0.1:5000",
        "tcp://127.0.0.1:5001",
    ]
    registry.mark_dead("demo_sink", 0)
    assert registry.endpoints("demo_sink", "queue") == ["tcp://127.0.0.1:5001"]


def test_an_unreadable_record_is_left_out_and_the_others_still_found(registry, caplog) -> None:
    """A role record no role writes (a pid that is no number, endpoints that are no map, an
    id without an index) would fail every peer scan, again after each restart: left out."""
    from rlvla3.runtime import keys

    for i in range(4):
        registry.register("demo_sink", i, node="local", host="127.0.0.1", pid=i)
        registry.publish_endpoint("demo_sink", i, "queue", f"tcp://127.0.0.1:{5000 + i}")
        registry.heartbeat("demo_sink", i, ttl_s=30, stats={})
    record = lambda i: keys.role_record(registry.run_id, "demo_sink", i)  # noqa: E731
    registry.redis.hset(record(1), "pid", "x")
    registry.redis.hset(record(2), "endpoints", '"tcp://nowhere"')
    registry.redis.sadd(keys.roles_index(registry.run_id), "no-index")
    assert registry.endpoints("demo_sink", "queue") == [
        "tcp://127.0.0.1:5000",
        "tcp://127.0.0.1:5003",
    ]
    registry.endpoints("demo_sink", "queue")
    assert caplog.text.count("left out the unreadable registry record") == 3  # each said once


def test_counters_restarts_weights_and_stop(registry) -> None:
    registry.flush({"env_steps": 5, "bad_frames": 1, "zero": 0}, flusher="w#0", number=0)
    registry.incr("env_steps", 2)
    assert registry.counters() == {"env_steps": 7, "bad_frames": 1}
    registry.register("trainer", 0, node="n", host="h", pid=1)
    assert registry.record_restart("trainer", 0) == 1
    registry.register("trainer", 0, node="n", host="h", pid=2)  # a restart keeps the count
    assert registry.roles()[0].restarts == 1
    assert registry.weight_version() == -1
    registry.set_weight_version(4)
    assert registry.weight_version() == 4
    registry.request_stop("first")
    registry.request_stop("second")
    assert registry.stop_reason() == "first"


def test_chunks_handed_back_twice_are_told_apart(registry) -> None:
    assert hand_back_chunks(registry, []) == set()
    assert hand_back_chunks(registry, [("0/0#a", 3), ("0/0#a", 4)]) == set()
    again = hand_back_chunks(registry, [("0/0#a", 4), ("0/0#a", 5), ("1/0#b", 3)])
    assert again == {("0/0#a", 4)}


def test_every_key_has_the_run_prefix(registry) -> None:
    """Under ``rlvla3:{run}:``, or ``rlvla3-guarded:{run}:`` for what env workers may only read
    (the chunks handed back here); ``clear_run`` deletes both."""
    registry.register("demo_sink", 0, node="local", host="h", pid=1)
    registry.heartbeat("demo_sink", 0, 5, {"a": 1})
    registry.incr("x")
    registry.append("episodes", [{"return": 1.0}])
    hand_back_chunks(registry, [("0/0#a", 1)])
    names = list(registry.redis.scan_iter("*"))
    prefixes = (keys.run_prefix(registry.run_id), keys.guarded_prefix(registry.run_id))
    mine = [n for n in names if n.startswith(tuple(f"{p}:" for p in prefixes))]
    assert len(mine) == 7
    assert [n for n in mine if n.startswith(f"{prefixes[1]}:")] == [
        keys.handed_back_chunks(registry.run_id)
    ]
    registry.clear_run()
    assert not [n for n in registry.redis.scan_iter("*") if n in mine]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )
