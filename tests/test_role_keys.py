"""Roles hold only the keys their role needs, never the run secret, and nothing secret in their
environment (issue 33, item 7): the role table's keys, the bundle a launcher hands over, a role
without a key it is asked to use, and a run bound beyond loopback end to end."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import zmq

from rlvla3.config.role_table import ROLES, RunKey
from rlvla3.config.run_config import load_config
from rlvla3.launch import netaddr, processes
from rlvla3.launch.processes import RoleProcess, SpawnContext
from rlvla3.runtime import role_keys, run_secret
from rlvla3.runtime.redis_auth import ENV_USER, RUN_USER, env_password, run_password
from rlvla3.runtime.redis_tls import redis_tls_identity
from rlvla3.runtime.registry import Registry
from rlvla3.runtime.role import Role
from tests.conftest import wait_until
from tests.launching import REPO, launcher_output, start_launcher, write_yaml
from tests.test_rl_loop import cartpole_config
from transport.chunk_auth import chunk_check_key, producer_key
from transport.derived_keys import MissingKeyError
from transport.security import CurveSecurity, run_keys
from transport.weight_auth import VersionGate, weights_key


def secret_texts(secret: str) -> dict[str, str]:
    """The secret and every key derived from it, as text would carry them."""
    curve = run_keys(secret)
    tls_key = redis_tls_identity(secret).key_pem.splitlines()[1]  # (the key's base64 line)
    return {
        "the run secret": secret,
        "the Redis password": run_password(secret),
        "the env workers' Redis password": env_password(secret),
        "the Redis TLS key": tls_key,
        "the weights key": weights_key(secret).hex(),
        "the CURVE server secret key": curve.server_secret.decode(),
        "the CURVE client secret key": curve.client_secret.decode(),
        "the chunk check key": chunk_check_key(secret).hex(),
        "env worker 0's chunk-tag key": producer_key(chunk_check_key(secret), 0).hex(),
    }


def assert_holds_none(text: str, secret: str, where: str, but: tuple[str, ...] = ()) -> None:
    found = [name for name, value in secret_texts(secret).items() if value in text]
    assert sorted(found) == sorted(but), f"{where} holds {found}"


# --- the table and the bundle --------------------------------------------------------------------
def test_each_role_is_handed_the_keys_its_row_names_and_no_other() -> None:
    secret = run_secret.new_secret()
    for spec in ROLES:
        keys = role_keys.keys_for(spec.name, secret, index=0)
        assert keys.names() == spec.keys, spec.name
        assert role_keys.from_text(keys.to_text(), "test") == keys
        assert secret not in keys.to_text()
    env = role_keys.keys_for("env_worker", secret, index=0)
    assert env.names() == {RunKey.REDIS_ENV, RunKey.CURVE_CLIENT, RunKey.CHUNK_SIGN}
    assert env.redis_auth().username == ENV_USER
    assert env.weights is None and env.curve.server_secret is None and env.chunk_check is None
    assert_holds_none(
        env.to_text(),
        secret,
        "an env worker's bundle",
        but=(
            "the env workers' Redis password",
            "the CURVE client secret key",
            "env worker 0's chunk-tag key",
        ),
    )
    # another env worker's bundle: its own chunk-tag key, not worker 0's
    other = role_keys.keys_for("env_worker", secret, index=1)
    assert other.chunk_sign == producer_key(chunk_check_key(secret), 1) != env.chunk_sign
    assert_holds_none(
        other.to_text(),
        secret,
        "env worker 1's bundle",
        but=("the env workers' Redis password", "the CURVE client secret key"),
    )
    assert (
        role_keys.keys_for("eval_env_worker", secret, index=0).chunk_sign is None
    )  # sends no chunks
    server = role_keys.keys_for("rollout_server", secret, index=0)
    assert server.curve.client_secret is None  # it connects to nothing
    trainer = role_keys.keys_for("trainer", secret, index=0)
    assert trainer.names() == set(RunKey) - {RunKey.CHUNK_SIGN, RunKey.REDIS_ENV}
    assert trainer.redis_auth().username == RUN_USER
    assert trainer.chunk_check == chunk_check_key(secret)


def test_what_is_no_bundle_is_refused_naming_the_pipe() -> None:
    secret = run_secret.new_secret()
    good = json.loads(role_keys.keys_for("env_worker", secret, index=0).to_text())
    for text in (
        secret,  # the secret itself, as an older launcher handed it
        json.dumps({**good, "server_public": None}),
        json.dumps({**good, "client_secret": "short"}),
        json.dumps({**good, "weights": "not hex"}),
        json.dumps({**good, "chunk_sign": 7}),
        json.dumps({**good, "chunk_sign": ""}),  # (b"" would turn the tags off)
        json.dumps([1, 2]),
    ):
        with pytest.raises(run_secret.SecretError, match=r"^--secret-fd 7: not a key bundle"):
            role_keys.from_text(text, "--secret-fd 7")


def test_a_role_started_by_hand_derives_its_keys_and_keeps_no_secret(monkeypatch) -> None:
    secret = run_secret.new_secret()
    monkeypatch.setattr(run_secret, "_taken", None)
    monkeypatch.setenv(run_secret.SECRET_ENV, secret)
    keys = role_keys.take(None, "env_worker", 3)
    assert keys == role_keys.keys_for("env_worker", secret, index=3)
    assert run_secret.SECRET_ENV not in os.environ  # processes it starts do not inherit it
    assert run_secret.from_env() is None  # and this process does not keep it


def test_a_launcher_takes_the_secret_out_of_its_environment_and_keeps_it(monkeypatch) -> None:
    secret = run_secret.new_secret()
    monkeypatch.setattr(run_secret, "_taken", None)
    monkeypatch.setenv(run_secret.SECRET_ENV, secret)
    assert run_secret.take() == secret
    assert run_secret.SECRET_ENV not in os.environ  # redis-server and roles do not inherit it
    assert run_secret.from_env() == secret  # the launcher derives each role's keys from it


def test_an_unusable_secret_in_the_environment_is_a_config_error(monkeypatch, capsys) -> None:
    from rlvla3 import cli

    monkeypatch.setattr(run_secret, "_taken", None)
    monkeypatch.setenv(run_secret.SECRET_ENV, "short")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["launch", "launch/cartpole.yaml"])
    assert exit_info.value.code == 2
    assert "config error" in capsys.readouterr().err


# --- a role without a key ------------------------------------------------------------------------
@contextlib.contextmanager
def curve_guard(keys: role_keys.RoleKeys) -> Iterator[tuple[CurveSecurity, zmq.Context]]:
    """CURVE with ``keys`` on a context of its own (the ZAP endpoint is one per context)."""
    context = zmq.Context()
    guard = CurveSecurity(keys.curve, context)
    try:
        yield guard, context
    finally:
        guard.close()
        context.destroy(linger=0)


def test_keys_a_role_was_not_handed_fail_naming_the_key(tmp_path, redis_url) -> None:
    secret = run_secret.new_secret()
    env = role_keys.keys_for("env_worker", secret, index=0)
    with curve_guard(env) as (guard, context):
        with pytest.raises(MissingKeyError, match="no CURVE server secret key"):
            guard.server(context.socket(zmq.ROUTER))
        guard.client(context.socket(zmq.DEALER))  # what it holds works
    with curve_guard(role_keys.keys_for("rollout_server", secret, index=0)) as (guard, context):
        with pytest.raises(MissingKeyError, match="no CURVE client secret key"):
            guard.client(context.socket(zmq.DEALER))
        guard.server(context.socket(zmq.ROUTER))
    with pytest.raises(MissingKeyError, match="^env_worker holds no redis_env key"):
        replace(env, redis_password=None).redis_auth()

    class Probe(Role):
        name = "weight_broadcaster"

        def step(self) -> None:
            pass

    cfg = load_config(None, ["roles.trainer.count=1", f"run.redis_url={redis_url}"])
    role = Probe(cfg, 0, node="local", run_dir=tmp_path)
    assert role.weights_key == b""  # a one-host run's
    role.weights_key = env.weights  # (None: what main sets from an env worker's keys)
    with pytest.raises(MissingKeyError, match="^weight_broadcaster holds no weights key"):
        VersionGate(role.weights_key)


def test_a_role_process_handed_too_few_keys_exits_naming_the_missing_key(
    tmp_path, redis_url
) -> None:
    """A weight broadcaster handed an env worker's keys: it cannot bind its sockets, and says
    so in one line naming the key, instead of serving without authentication."""
    config = write_yaml(
        tmp_path / "config.yaml",
        {
            "run": {"name": "few_keys", "redis_url": redis_url, "stall_timeout_s": 30},
            "roles": {"trainer": {"count": 1}, "weight_broadcaster": {"count": 1}},
        },
    )
    bundle = role_keys.keys_for("env_worker", run_secret.new_secret(), index=0).to_text()
    fd = run_secret.hand_over(bundle)
    try:
        role = subprocess.run(
            [sys.executable, "-m", "roles.weight_broadcaster", "--config", str(config)]
            + ["--address", "127.0.0.1", "--secret-fd", str(fd)],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
    finally:
        os.close(fd)
    assert role.returncode != 0
    assert "MissingKeyError: no CURVE server secret key" in role.stderr, role.stderr[-3000:]


# --- what a role's environment shows -------------------------------------------------------------
def test_a_role_gets_its_keys_through_a_pipe_and_its_environment_holds_none(
    tmp_path, monkeypatch
) -> None:
    """The launcher's spawn path with a stand-in env worker: its keys arrive, and neither its
    environment (``os.environ`` and the kernel's ``/proc/PID/environ``), its command line, nor
    a process it starts (a simulator) carries the secret or any key; the pipe is closed after
    reading. The bundle holds no weights key and no CURVE server secret key."""
    secret = run_secret.new_secret()
    monkeypatch.setenv(run_secret.SECRET_ENV, secret)  # the launcher's own, as under srun
    monkeypatch.setattr(
        processes, "role_spec", lambda role: types.SimpleNamespace(module="tests.secret_probe")
    )
    proc = RoleProcess("env_worker", 0, "local", tmp_path / "probe.log")
    ctx = SpawnContext(
        config_path=tmp_path / "config.yaml", run_dir=tmp_path, address="127.0.0.1", secret=secret
    )
    processes.spawn(proc, ctx)
    assert proc.popen.wait(timeout=60) == 0, (tmp_path / "probe.log").read_text()
    report = json.loads((tmp_path / "probe.json").read_text())
    assert report["keys"] == ["chunk_sign", "curve_client", "redis_env"]
    assert report["bundle"] == role_keys.keys_for("env_worker", secret, index=0).to_text()
    for where in ("os_environ", "proc_environ", "cmdline", "child_environ"):
        assert_holds_none(report[where], secret, where)
    assert not report["secret_fd_still_open"]


def _routable_address() -> str | None:
    try:
        address = netaddr.route_address("192.0.2.1")  # (the routing table only: nothing sent)
    except (OSError, netaddr.AddressError):
        return None
    return None if netaddr.is_loopback(address) else address


@pytest.mark.slow
def test_a_run_bound_beyond_loopback_trains_with_each_role_holding_only_its_keys(
    tmp_path, redis_url, monkeypatch
) -> None:
    """One host on its LAN address: CURVE on every socket, each role holding only its own keys
    (env workers connect with the client key alone, rollout servers and the trainer bind with
    the server key, weights are signed and checked), and no running role's
    ``/proc/PID/environ`` holds the secret or a key."""
    address = _routable_address()
    if address is None:
        pytest.skip("this host has no address beyond loopback")
    secret = run_secret.new_secret()
    cfg = cartpole_config("lan_keys", redis_url, "async")
    cfg["nodes"] = [{"name": "lan", "host": address}]
    cfg["run"]["stop"]["max_env_steps"] = 8000  # (a few seconds: time to look at each role)
    processes_count = sum(role["count"] for role in cfg["roles"].values())
    run_dir = tmp_path / "run"
    config = write_yaml(tmp_path / "cfg.yaml", cfg)
    launcher = _start_with_secret(config, run_dir, secret, monkeypatch)
    try:
        registry = Registry(redis_url, "lan_keys")
        roles = wait_until(
            lambda: _all_running(registry, processes_count), 120, "every role running"
        )
        for role in roles:
            environ = Path(f"/proc/{role.pid}/environ").read_bytes().decode(errors="replace")
            assert_holds_none(environ, secret, f"{role.role}'s /proc/PID/environ")
        code = launcher.wait(timeout=240)
        assert code == 0, launcher_output(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert {r.status for r in registry.roles()} == {"done"}
    assert {r.host for r in registry.roles()} == {address}  # every socket beyond loopback
    counters = registry.counters()
    assert counters["updates"] >= 2 and counters.get("auth_refused", 0) == 0
    # every chunk carried its env worker's tag and passed the trainer's check
    assert counters["chunks_consumed"] > 0 and counters.get("bad_chunks", 0) == 0, counters
    assert registry.weight_version() >= 2
    registry.close()


def _start_with_secret(
    config: Path, run_dir: Path, secret: str, monkeypatch: pytest.MonkeyPatch
) -> subprocess.Popen:
    """``start_launcher`` with ``RLVLA3_RUN_SECRET`` set, as Slurm's batch script sets it."""
    with monkeypatch.context() as patch:
        patch.setenv(run_secret.SECRET_ENV, secret)
        return start_launcher(config, run_dir)


def _all_running(registry: Registry, count: int) -> list | None:
    roles = [r for r in registry.roles() if r.status == "running"]
    return roles if len(roles) == count else None
