"""Hostile configs and peers (issue 33, items 6 and 8): wildcard and unauthenticated binds, a
Redis password in the run dir and logs, a live run wiped by a namesake, forged log lines, two
learners."""

from __future__ import annotations

import logging

import pytest
import yaml

from rlvla3.config import redis_url as redis_urls
from rlvla3.config.run_config import load_config
from rlvla3.config.typed_load import ConfigError
from rlvla3.launch.cluster import Seat, needs_secret
from rlvla3.launch.command import launch
from rlvla3.launch.node_run import redis_lost
from rlvla3.launch.redis_server import EmbeddedRedis
from rlvla3.launch.rendezvous import configured_store, read_run_info, write_run_info
from rlvla3.launch.run_dir import config_path, write_config
from rlvla3.runtime import run_secret
from rlvla3.runtime.log_text import loggable
from rlvla3.runtime.redis_auth import RUN_USER
from rlvla3.runtime.registry import Registry, RunInUse
from rlvla3.runtime.role_redis import run_redis
from transport.bind_policy import BindRefused, check_bind
from transport.sockets import pull


# --- item 6: wildcard and unauthenticated binds ---------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "*", "0:0:0:0:0:0:0:0"])
def test_a_wildcard_node_host_is_refused_naming_the_field(tmp_path, host) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"nodes": [{"name": "a"}, {"name": "b", "host": host}]}))
    with pytest.raises(ConfigError, match=r"^nodes\[1\]\.host: .* is a wildcard address"):
        load_config(path)


def test_no_socket_binds_a_wildcard_or_an_open_address_without_curve() -> None:
    check_bind("127.0.0.1", curve=False)  # loopback: no other host reaches it
    check_bind("10.1.2.3", curve=True)
    with pytest.raises(BindRefused, match="without CURVE"):
        check_bind("10.1.2.3", curve=False)
    for host in ("0.0.0.0", "*", "::"):
        with pytest.raises(BindRefused, match="wildcard"):
            check_bind(host, curve=True)
    sock = pull()
    try:
        with pytest.raises(BindRefused, match="wildcard"):
            sock.bind(host="0.0.0.0")
        assert sock.addresses == []
    finally:
        sock.close()


def test_a_one_host_run_on_a_lan_address_authenticates() -> None:
    cfg = load_config(None, ["roles.trainer.count=1"])
    one_host = Seat(node=None, multi_host=False, head=cfg.head_node(), single_node=True)
    assert not needs_secret(one_host, "127.0.0.1")
    assert needs_secret(one_host, "192.168.1.5")  # reachable from the LAN: CURVE
    across = Seat(node=cfg.head_node(), multi_host=True, head=cfg.head_node())
    assert needs_secret(across, "10.0.0.1")


# (item 7, the secret out of roles and their environments: tests/test_role_keys.py)


# --- item 8: a Redis password, live namesakes, forged log lines, two learners ------------------
def test_a_redis_password_stays_out_of_the_run_dir_files_and_messages(tmp_path) -> None:
    password = "hunter2-" + run_secret.new_secret()[:12]
    with EmbeddedRedis(host="127.0.0.1", password=password) as server:
        # (a user's Redis with a named user, as the embedded one's ACL has)
        url = server.url.replace("redis://", f"redis://{RUN_USER}:{password}@")
        cfg = load_config(None, ["roles.trainer.count=1", f"run.redis_url={url}"])
        shown = write_config(tmp_path, cfg)
        assert password not in config_path(tmp_path).read_text()
        assert shown.run.redis_url == redis_urls.redacted(url)
        assert ":***@127.0.0.1:" in shown.run.redis_url
        secret_file = tmp_path / run_secret.REDIS_PASSWORD_FILE
        assert secret_file.stat().st_mode & 0o777 == 0o600
        store = configured_store(url)
        head = Seat(node=None, multi_host=False, head=cfg.head_node(), single_node=True)
        write_run_info(tmp_path, cfg, head, store, "launch-1")
        assert password not in (tmp_path / "run.json").read_text()
        assert password not in redis_lost(store, OSError("gone")).text
        # a role reads config.yaml and finds the password in the run dir's 0600 file
        role_cfg, role_password = run_redis(load_config(config_path(tmp_path)), tmp_path, None)
        assert role_password == password
        registry = Registry(role_cfg.run.redis_url, "r", role_password)
        assert registry.counters() == {} and password not in registry.url
        registry.close()
        by_url = Registry(url, "r")  # the password in the URL itself
        assert by_url.counters() == {} and by_url.url == redis_urls.redacted(url)
        by_url.close()
        assert read_run_info(tmp_path)["redis_url"] == redis_urls.redacted(url)


def test_a_live_run_of_the_same_name_is_not_wiped(registry, tmp_path) -> None:
    registry.register("env_worker", 0, node="n", host="h", pid=1)
    registry.heartbeat("env_worker", 0, 30.0, {})
    registry.incr("env_steps", 5)
    with pytest.raises(RunInUse, match=r"is live on .*env_worker/0 heartbeating"):
        registry.clear_run(refuse_live=True)
    assert registry.counters()["env_steps"] == 5
    overrides = [f"run.redis_url={registry.url}", f"run.name={registry.run_id}"]
    with pytest.raises(ConfigError, match=r"^run\.name: run .* is live"):
        launch("launch/cartpole.yaml", overrides, out=str(tmp_path / "run"), echo=lambda _: None)
    assert not (tmp_path / "run").exists()  # refused before anything was started or moved
    registry.set_status("env_worker", 0, "done")  # an ended run may be replaced
    registry.clear_run(refuse_live=True)
    assert registry.counters() == {}


def test_peer_text_in_a_log_line_is_escaped_and_cut() -> None:
    forged = "0/1\n2026-01-01 trainer/0 ERROR forged line\x1b[2J"
    line = loggable(f"request {forged}: bad")
    assert "\n" not in line and "\x1b" not in line
    assert "\\n2026-01-01" in line and "\\x1b[2J" in line
    long = loggable("x" * 10_000)
    assert long.startswith("x" * 300) and long.endswith("(9700 more characters)")
    assert loggable("plain text") == "plain text"


def test_a_role_logs_a_dropped_messages_reason_on_one_line(tmp_path, redis_url, caplog) -> None:
    from rlvla3.runtime.role import Role

    class Probe(Role):
        name = "trainer"

        def step(self) -> None:
            pass

    cfg = load_config(None, ["roles.trainer.count=1", f"run.redis_url={redis_url}"])
    role = Probe(cfg, 0, node="local", run_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        role.drop("bad_requests", "request '0/1\\nforged': bad\nrollout_server/0 INFO forged")
    (record,) = [r for r in caplog.records if "forged" in r.getMessage()]
    assert "\n" not in record.getMessage()


@pytest.mark.parametrize("role", ["trainer", "sft_trainer"])
def test_several_learners_are_one_training_group(role) -> None:
    """``count`` > 1 is one data-parallel group (rank 0 alone publishes and checkpoints)."""
    assert load_config(None, [f"roles.{role}.count=2"]).num_processes(role) == 2
