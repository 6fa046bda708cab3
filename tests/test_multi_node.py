"""The pieces of a multi-node run that need no cluster: node groups, Slurm's environment,
addresses, the run secret, CURVE and Redis AUTH. Whole runs across hosts: tests/test_cluster.py."""

from __future__ import annotations

import json
import os

import pytest
import redis
import zmq

from rlvla3.config.run_config import load_config
from rlvla3.config.typed_load import ConfigError
from rlvla3.launch import netaddr
from rlvla3.launch.cluster import find_seat, own_address, redis_port
from rlvla3.launch.progress import ProgressTracker
from rlvla3.launch.redis_server import EmbeddedRedis
from rlvla3.launch.slurm import HostListError, SlurmStep, expand_host_list
from rlvla3.runtime import run_secret
from rlvla3.runtime.redis_auth import RUN_USER, RedisAuth, run_password
from rlvla3.runtime.registry import Registry
from tests.conftest import wait_until
from transport.security import CurveSecurity, run_keys

GROUPS = [
    "nodes=[{name: learner, devices: [cuda:0]}, {name: sim, count: 2}]",
    "roles.env_worker.count=3",
    "roles.env_worker.node=sim",
    "roles.trainer.count=1",
    "roles.trainer.node=learner",
]


def slurm_env(node_id: int, hosts: str = "gpu01,cpu[01-02]", job: str = "4242") -> dict:
    return {
        "SLURM_JOB_ID": job,
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": str(node_id),
        "SLURM_JOB_NODELIST": hosts,
    }


# --- node groups ---------------------------------------------------------------------------------
def test_groups_expand_in_order_and_roles_spread_over_a_group() -> None:
    cfg = load_config(None, GROUPS)
    assert [(n.name, n.group, n.rank) for n in cfg.all_nodes()] == [
        ("learner", "learner", 0),
        ("sim-0", "sim", 1),
        ("sim-1", "sim", 2),
    ]
    assert cfg.placement("env_worker") == ["sim-0", "sim-1", "sim-0"]
    assert cfg.placement("trainer") == ["learner"]
    assert cfg.node("learner").devices == ("cuda:0",)
    assert cfg.head_node().name == "learner"
    assert load_config(None, [*GROUPS, "run.head=sim"]).head_node().name == "sim-0"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["nodes=[{name: sim, count: 2, host: 10.0.0.2}]"], "nodes[0].host: group 'sim' has 2"),
        (["nodes=[{name: sim, count: 2}, {name: sim-1}]"], "the name 'sim-1' is used twice"),
        (["nodes=[{name: 'a b'}]"], "nodes[0].name"),
        (["nodes=[{name: sim, count: 0}]"], "nodes[0].count: must be >= 1"),
        ([*GROUPS, "run.head=gpu"], "run.head: no node or group named 'gpu'"),
        ([*GROUPS, "roles.trainer.node=gpu"], "roles.trainer.node: no node or group named 'gpu'"),
    ],
)
def test_bad_node_groups_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, overrides)


# --- Slurm ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-3,7]", ["node1", "node2", "node3", "node7"]),
        ("gpu[08-10],login", ["gpu08", "gpu09", "gpu10", "login"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ],
)
def test_slurm_host_lists_expand(text: str, hosts: list[str]) -> None:
    assert expand_host_list(text) == hosts


@pytest.mark.parametrize("text", ["", "node[1-3", "node[3-1]", "node[a-b]", "n[1-[2]]"])
def test_bad_slurm_host_lists_are_refused(text: str) -> None:
    with pytest.raises(HostListError):
        expand_host_list(text)


def test_the_job_hosts_fill_the_groups_in_order() -> None:
    cfg = load_config(None, GROUPS)
    seats = [find_seat(cfg, None, slurm_env(i)) for i in range(3)]
    assert [s.node.name for s in seats] == ["learner", "sim-0", "sim-1"]
    assert [s.is_head for s in seats] == [True, False, False]
    assert all(s.multi_host and s.slurm.hosts == ("gpu01", "cpu01", "cpu02") for s in seats)
    assert redis_port(cfg, seats[1]) == SlurmStep.from_env(slurm_env(1)).redis_port()
    assert redis_port(load_config(None, [*GROUPS, "run.redis_port=7000"]), seats[1]) == 7000


def test_an_allocation_that_does_not_fit_is_one_line_naming_the_nodes() -> None:
    cfg = load_config(None, GROUPS)
    with pytest.raises(
        ConfigError,
        match=r"has 2 hosts .* are 3 \(learner, sim-0, sim-1\); "
        r"submit with sbatch --nodes=3",
    ):
        find_seat(cfg, None, slurm_env(0, hosts="cpu[01-02]"))


def test_a_one_host_step_runs_everything_here_and_node_overrides_slurm() -> None:
    one_host_step = slurm_env(0, hosts="cpu01")  # an salloc shell, srun --pty
    cfg = load_config(None, GROUPS)
    assert find_seat(cfg, None, one_host_step).node is None
    assert find_seat(load_config(None, ["roles.trainer.count=1"]), None, one_host_step).node is None
    assert find_seat(cfg, "sim-1", slurm_env(0)).node.name == "sim-1"
    assert find_seat(cfg, None, {}).node is None  # no Slurm, no --node: all on this host


def test_a_one_node_yaml_on_several_hosts_and_two_tasks_per_node_are_refused() -> None:
    one_node = load_config(None, ["roles.trainer.count=1"])
    with pytest.raises(
        ConfigError,
        match=r"has 3 hosts .* are 1 \(local\); submit with "
        r"sbatch --nodes=1",
    ):
        find_seat(one_node, None, slurm_env(0))
    with pytest.raises(ConfigError, match="one launcher per node"):
        find_seat(load_config(None, GROUPS), None, {**slurm_env(0), "SLURM_STEP_NUM_TASKS": "6"})


@pytest.mark.parametrize("hosts", ["cpu01", "gpu01,cpu01,cpu02"])
def test_a_second_task_on_a_host_stops_and_the_first_runs(hosts: str) -> None:
    """`srun -n 2` on one host: local task 1 would be a second launcher of the whole run (a
    second head, the same run dir); it is refused, task 0 runs."""
    cfg = load_config(None, GROUPS)
    with pytest.raises(ConfigError, match=r"task 1 of this host's step.*--ntasks-per-node=1"):
        find_seat(cfg, None, {**slurm_env(0, hosts=hosts), "SLURM_LOCALID": "1"})
    assert find_seat(cfg, None, {**slurm_env(0, hosts="cpu01"), "SLURM_LOCALID": "0"}).is_head
    assert find_seat(cfg, None, {"SLURM_LOCALID": "1"}).node is None  # not in a step: no Slurm
    # `rlvla3 eval`: several evaluations of one step may share a host, each its own --out
    second_eval = {**slurm_env(0, hosts="cpu01"), "SLURM_LOCALID": "1"}
    assert find_seat(cfg, None, second_eval, alone_on_host=False).node is None


# --- addresses -----------------------------------------------------------------------------------
def test_loopback_is_refused_in_a_multi_node_run_naming_the_node() -> None:
    cfg = load_config(
        None, ["nodes=[{name: a, host: 127.0.0.1}, {name: b}]", "roles.trainer.count=1"]
    )
    seat = find_seat(cfg, "a")
    with pytest.raises(
        netaddr.AddressError,
        match="node 'a': nodes\\[\\].host '127.0.0.1' gives "
        "127.0.0.1, which other nodes cannot reach",
    ):
        own_address(seat, None)
    one_host = find_seat(cfg, None)  # every node on this host: loopback is right
    assert not one_host.multi_host and own_address(one_host, None) == "127.0.0.1"


def test_addresses_come_from_the_routing_table() -> None:
    assert netaddr.route_address("127.0.0.1") == "127.0.0.1"
    assert netaddr.interface_of("127.0.0.1") == "lo"
    assert netaddr.is_loopback(netaddr.resolve("localhost"))
    with pytest.raises(netaddr.AddressError, match="does not resolve"):
        netaddr.resolve("no-such-host.invalid")


# --- the run secret -------------------------------------------------------------------------------
def test_the_secret_is_stored_0600_and_a_readable_one_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(run_secret.SECRET_ENV, raising=False)
    assert run_secret.load(tmp_path) is None
    secret = run_secret.new_secret()
    path = run_secret.write(tmp_path, secret)
    assert path.stat().st_mode & 0o777 == 0o600 and run_secret.load(tmp_path) == secret
    os.chmod(path, 0o644)
    with pytest.raises(run_secret.SecretError, match="readable by others"):
        run_secret.read(tmp_path)
    monkeypatch.setenv(run_secret.SECRET_ENV, "short")
    with pytest.raises(run_secret.SecretError, match="RLVLA3_RUN_SECRET: a run secret must be"):
        run_secret.load(tmp_path)


def test_the_private_redis_of_a_multi_node_run_wants_the_run_users_credentials(tmp_path) -> None:
    """Without TLS (an ``EmbeddedRedis`` given a password alone) the ACL still applies: the
    default user is off. The head's TLS and the ACL's commands: tests/test_redis_auth.py."""
    secret = run_secret.new_secret()
    with EmbeddedRedis(host="127.0.0.1", password=run_password(secret)) as server:
        assert server.url.startswith("redis://127.0.0.1:")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            Registry(server.url, "r", secret).counters()  # the secret itself is no password
        assert Registry(server.url, "r", RedisAuth(run_password(secret), RUN_USER)).counters() == {}
        assert not (server.directory / "redis.conf").exists()  # read at start, then removed
        cmdline = open(f"/proc/{server.process.pid}/cmdline", "rb").read()
        assert run_password(secret).encode() not in cmdline  # not in `ps`


# --- CURVE ---------------------------------------------------------------------------------------
def test_curve_serves_the_runs_peers_and_refuses_and_counts_strangers() -> None:
    secret = run_secret.new_secret()
    server_ctx, peer_ctx = zmq.Context(), zmq.Context()  # two processes, in effect
    refused: list[str] = []
    security = CurveSecurity(secret, server_ctx, refused.append)
    try:
        server = server_ctx.socket(zmq.ROUTER)
        security.server(server)
        endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
        keys = run_keys(secret)
        stranger_public, stranger_secret = zmq.curve_keypair()
        peers = {
            "run": (keys.server_public, keys.client_public, keys.client_secret),
            "wrong_key": (keys.server_public, stranger_public, stranger_secret),
            "plain": None,
        }
        sockets = []  # kept referenced: a collected socket closes and drops what it queued
        for name, key in peers.items():
            sock = peer_ctx.socket(zmq.DEALER)
            sockets.append(sock)
            sock.linger = 0
            if key is not None:
                sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = key
            sock.connect(endpoint)
            sock.send(name.encode())
        received = []
        while server.poll(2000):
            received.append(server.recv_multipart()[-1])
        assert received == [b"run"]
        # the wrong key fails at ZAP ("auth", once: libzmq does not retry it), the plain peer
        # during the handshake ("protocol" or "no_detail", as it happens to be cut off)
        wait_until(
            lambda: any("auth" in r for r in refused) and any("auth" not in r for r in refused),
            10,
            "both strangers counted",
        )
    finally:
        security.close()
        peer_ctx.destroy(linger=0)
        server_ctx.destroy(linger=0)


def test_keys_differ_per_secret_and_match_across_processes() -> None:
    a, b = run_keys("a" * 32), run_keys("b" * 32)
    assert a == run_keys("a" * 32) and a.client_public != b.client_public
    assert a.server_public != a.client_public


# --- progress ------------------------------------------------------------------------------------
def test_the_progress_line_says_when_nothing_moves(registry) -> None:
    cfg = load_config(None, ["roles.trainer.count=1"])
    tracker = ProgressTracker(cfg)
    assert "NO PROGRESS" not in tracker.line(registry, 5.0, 0)
    line = tracker.line(registry, 30.0, 0)
    assert "(0/s)" in line and "NO PROGRESS for 25s: no weights have reached" in line
    registry.incr("env_steps", 500)
    registry.set_weight_version(3)
    line = tracker.line(registry, 35.0, 0)
    assert "NO PROGRESS" not in line and "env_steps=500 (100/s)" in line
    assert "NO PROGRESS for 20s: env steps, SFT samples and weight version" in tracker.line(
        registry, 55.0, 0
    )
    registry.incr("sft_samples", 64)  # an SFT run trains while its live evaluation waits
    assert "NO PROGRESS" not in tracker.line(registry, 60.0, 0)
    assert "NO PROGRESS for 20s" in tracker.line(registry, 80.0, 0)


def test_a_redis_url_brackets_an_ipv6_host() -> None:
    from rlvla3.launch.redis_server import url_host

    assert url_host("fd00::2") == "[fd00::2]" and url_host("127.0.0.1") == "127.0.0.1"
    assert f"redis://{url_host('::1')}:6379/0" == "redis://[::1]:6379/0"


@pytest.mark.parametrize("resume", [False, True])
def test_a_member_keeps_its_own_run_dirs_checkpoints_only_on_resume(
    tmp_path, monkeypatch, resume
) -> None:
    """A member node's own run dir (no shared file system) holding an earlier launch: a fresh
    launch moves it aside, ``--resume`` keeps its checkpoints where a trainer rank resumes."""
    from types import SimpleNamespace

    from rlvla3.launch import run_dir as run_dir_module

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "ckpt_00000007.pt").write_bytes(b"x")
    (run / "run.json").write_text(json.dumps({"launch_id": "earlier"}))
    written: list[str] = []
    monkeypatch.setattr(run_dir_module, "write_run_info", lambda *a: written.append("run.json"))
    monkeypatch.setattr(run_dir_module, "write_config", lambda *a: written.append("config"))
    joined = SimpleNamespace(store=None, secret="s", launch_id="now")
    seat = SimpleNamespace(label="node-1")
    said: list[str] = []
    run_dir_module.claim_member_run_dir(run, None, seat, joined, said.append, resume)
    assert (run / "checkpoints" / "ckpt_00000007.pt").exists() == resume
    assert bool(said) != resume and written == ["run.json", "config"]


def test_a_multi_node_launch_does_not_ground_a_preset(tmp_path) -> None:
    """Grounding trains: each node would make another base model (or clash in a shared
    folder), so a launch of one node of several asks for the grounded model first."""
    from types import SimpleNamespace

    from rlvla3.launch import command

    keys = [
        "env.id=rlvla3/TableTopEasy-v0",
        "policy.kind=token_vla",
        f"policy.token_vla.path={tmp_path / 'model'}",
        "policy.token_vla.preset=llava-test",
        "policy.token_vla.preset_grounding={vision_steps: 2, text_steps: 2}",
    ]
    one_of_several = SimpleNamespace(node=object(), multi_host=False, single_node=False)
    with pytest.raises(ConfigError, match="preset_grounding: a multi-node launch does not ground"):
        command._check_multi_node(load_config(None, keys), one_of_several)
    the_only_node = SimpleNamespace(node=object(), multi_host=False, single_node=True)
    command._check_multi_node(load_config(None, keys), the_only_node)  # --node of a 1-node YAML
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # grounded on one host first
    command._check_multi_node(load_config(None, keys), one_of_several)
