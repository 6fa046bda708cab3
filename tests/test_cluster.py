"""Multi-node runs on a real cluster: Linux network namespaces with their own 10.x addresses
on a bridge, and a real Slurm (slurmctld, three slurmd, munge) from the Debian packages.

Needs root, working ``ip netns`` and, for the Slurm tests, ``slurmctld slurmd slurm-client
munge``; skips with the reason otherwise (``.ci/run`` installs them where it can). Every test
tears its cluster down, namespaces and daemons included, even when it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.rehearsal import Cluster, unavailable
from rlvla3.launch.rendezvous import read_run_info
from rlvla3.runtime import run_secret
from tests.conftest import wait_until
from tests.launching import write_yaml
from transport.security import run_keys

pytestmark = pytest.mark.cluster

CARTPOLE_3NODES = "launch/cartpole_3nodes.yaml"
RANDOM_RETURN = 25  # CartPole-v1's mean return under a random policy is about 22


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory) -> Cluster:
    reason = unavailable(slurm=True)
    if reason:
        pytest.skip(f"no rehearsal Slurm cluster: {reason}")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"), slurm=True)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()


@pytest.fixture
def plain_cluster(tmp_path) -> Cluster:
    reason = unavailable(slurm=False)
    if reason:
        pytest.skip(f"no rehearsal network: {reason}")
    cluster = Cluster(tmp_path / "cluster", slurm=False)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()


def wait_for_job(cluster: Cluster, job_id: int, timeout_s: float) -> dict[str, str]:
    return wait_until(lambda: cluster.job_done(job_id), timeout_s, f"Slurm job {job_id} to end")


def assert_no_role_processes(cluster: Cluster) -> None:
    for node in range(1, cluster.nodes + 1):
        left = [p for p in cluster.processes(node) if not p.endswith(" slurmd")]
        assert not left, f"processes left on node{node}: {left}"


def sbatch_cartpole(cluster: Cluster, tmp_path: Path, *overrides: str) -> tuple[Path, str, dict]:
    """``sbatch --nodes=3 launch/slurm.sbatch launch/cartpole_3nodes.yaml`` with ``--set``
    ``overrides``, to its end (which must be COMPLETED, exit 0); the run dir, the job's output
    and ``summary.json``."""
    run_dir = tmp_path / "run"
    sets = [a for o in ("run.stop.max_wall_s=240", *overrides) for a in ("--set", o)]
    job = cluster.sbatch(
        "--nodes=3",
        f"--output={tmp_path / 'job.out'}",
        "launch/slurm.sbatch",
        CARTPOLE_3NODES,
        "--out",
        str(run_dir),
        *sets,
    )
    fields = wait_for_job(cluster, job, 360)
    output = (tmp_path / "job.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output
    return run_dir, output, json.loads((run_dir / "summary.json").read_text())


def test_sbatch_runs_cartpole_on_three_nodes(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """``sbatch --nodes=3 launch/slurm.sbatch launch/cartpole_3nodes.yaml``: every role
    registers from its node's address, weights reach a rollout server on another node (gloo
    over the network), env workers on both sim nodes feed the trainer, CartPole learns, and
    every node's launcher exits 0 leaving nothing behind."""
    run_dir, output, summary = sbatch_cartpole(
        slurm_cluster,
        tmp_path,
        # a second rollout server on a sim node: its weights cross hosts
        "roles.rollout_server.count=2",
        "roles.rollout_server.node=[learner, sim-1]",
    )
    address = {n["node"]: n["address"] for n in summary["nodes"]}
    assert address == {
        "learner": slurm_cluster.address(1),
        "sim-0": slurm_cluster.address(2),
        "sim-1": slurm_cluster.address(3),
    }
    assert {n["status"] for n in summary["nodes"]} == {"done"}
    roles = summary["roles"]
    assert all(r["host"] == address[r["node"]] and r["status"] == "done" for r in roles), roles
    servers = {
        r["node"]: r["stats"].get("policy_version", -1)
        for r in roles
        if r["role"] == "rollout_server"
    }
    assert set(servers) == {"learner", "sim-1"} and min(servers.values()) >= 5, servers
    producers = {
        r["node"]: r["stats"].get("chunks_produced", 0) for r in roles if r["role"] == "env_worker"
    }
    assert set(producers) == {"sim-0", "sim-1"} and min(producers.values()) > 10, producers
    assert summary["final_mean_return"] > 8 * RANDOM_RETURN, summary["stop_reason"]
    c = summary["counters"]
    assert (
        c["chunks_produced"]
        == c["chunks_received"]
        == (
            c["chunks_consumed"] + c.get("chunks_dropped", 0) + c.get("chunks_in_flight_at_exit", 0)
        )
    )
    assert not c.get("auth_refused")
    for node in ("sim-0", "sim-1"):
        assert f"node {node}: run cartpole_3nodes ended: the head ended the run" in output
    secret_file = run_dir / "secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    secret = secret_file.read_text().strip()
    for log in [tmp_path / "job.out", *(run_dir / "logs").iterdir()]:
        assert secret not in log.read_text(errors="replace"), f"the run secret is in {log}"
    assert_no_role_processes(slurm_cluster)


def test_a_trainer_group_across_two_nodes_solves_cartpole(
    slurm_cluster: Cluster, tmp_path: Path
) -> None:
    """``trainer.count: 2`` with rank 0 on the learner node and rank 1 on a sim node: the ranks
    meet at rank 0's store across hosts, form a gloo group bound to their node addresses, train
    every update together, and CartPole learns."""
    run_dir, _, summary = sbatch_cartpole(
        slurm_cluster, tmp_path, "roles.trainer.count=2", "roles.trainer.node=[learner, sim-0]"
    )
    ranks = {r["index"]: r for r in summary["roles"] if r["role"] == "trainer"}
    assert {i: r["node"] for i, r in ranks.items()} == {0: "learner", 1: "sim-0"}
    assert all(r["status"] == "done" for r in ranks.values()), ranks
    follower = (run_dir / "logs" / "trainer-1.log").read_text()
    assert "rank 1 of 2 (gloo)" in follower
    assert summary["final_mean_return"] > 8 * RANDOM_RETURN, summary["stop_reason"]
    assert_no_role_processes(slurm_cluster)


def test_an_allocation_that_does_not_fit_fails_every_node_at_once(
    slurm_cluster: Cluster, tmp_path: Path
) -> None:
    job = slurm_cluster.sbatch(
        "--nodes=2",
        f"--output={tmp_path / 'job.out'}",
        "launch/slurm.sbatch",
        CARTPOLE_3NODES,
        "--out",
        str(tmp_path / "run"),
    )
    fields = wait_for_job(slurm_cluster, job, 120)
    output = (tmp_path / "job.out").read_text()
    assert fields["JobState"] == "FAILED", output
    errors = [line for line in output.splitlines() if "config error" in line]
    assert len(errors) == 2 and all(
        "allocation has 2 hosts" in e and "learner, sim-0, sim-1" in e for e in errors
    ), output
    assert not (tmp_path / "run" / "logs").exists()  # nothing started
    assert_no_role_processes(slurm_cluster)


def test_a_node_cut_off_mid_run_is_lost_then_rejoins(slurm_cluster: Cluster, tmp_path) -> None:
    """Node sim-1 loses its link for a while: its env worker shows LOST within the heartbeat
    TTL, the run goes on with sim-0, and once the link is back the worker is part of the run
    again; the chunk accounting balances and every launcher exits 0."""
    run_dir = tmp_path / "run"
    ttl = 3.0
    job = slurm_cluster.sbatch(
        "--nodes=3",
        f"--output={tmp_path / 'job.out'}",
        "launch/slurm.sbatch",
        CARTPOLE_3NODES,
        "--out",
        str(run_dir),
        "--set",
        "run.stop.target_mean_return=null",
        "--set",
        "run.stop.max_wall_s=75",
        "--set",
        f"run.heartbeat_ttl_s={ttl}",
        "--set",
        "run.head_timeout_s=60",
    )

    def sim1_worker(snap: dict) -> dict | None:
        return next((r for r in snap["roles"] if r["node"] == "sim-1"), None)

    def flowing() -> dict | None:
        if not (run_dir / "run.json").exists():
            return None
        snap = slurm_cluster.monitor(1, run_dir)
        worker = sim1_worker(snap)
        ok = worker and worker["alive"] and snap["counters"].get("env_steps", 0) > 2000
        return snap if ok else None

    wait_until(flowing, 120, "env steps from both sim nodes")
    slurm_cluster.cut(3)
    try:
        lost = wait_until(
            lambda: (lambda s: s if not sim1_worker(s)["alive"] else None)(
                slurm_cluster.monitor(1, run_dir)
            ),
            ttl + 10,
            "sim-1's env worker shown LOST",
        )
        steps_at_loss = lost["counters"]["env_steps"]
        # the run goes on without it (monitor from a sim node this time: any node works)
        wait_until(
            lambda: (
                slurm_cluster.monitor(2, run_dir)["counters"]["env_steps"] > steps_at_loss + 2000
            ),
            60,
            "env steps from sim-0 alone",
        )
    finally:
        slurm_cluster.heal(3)
    back = wait_until(
        lambda: (lambda s: s if sim1_worker(s)["alive"] else None)(
            slurm_cluster.monitor(1, run_dir)
        ),
        30,
        "sim-1's env worker back",
    )
    produced_at_return = sim1_worker(back)["stats"].get("chunks_produced", 0)
    fields = wait_for_job(slurm_cluster, job, 180)
    output = (tmp_path / "job.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output
    summary = json.loads((run_dir / "summary.json").read_text())
    worker = next(r for r in summary["roles"] if r["node"] == "sim-1")
    assert worker["status"] == "done" and worker["restarts"] == 0
    assert worker["stats"]["chunks_produced"] > produced_at_return  # it worked after rejoining
    c = summary["counters"]
    assert c["chunks_produced"] == (
        c["chunks_consumed"]
        + c.get("chunks_dropped", 0)
        + c.get("chunks_in_flight_at_exit", 0)
        + summary["chunks_lost"]
    )
    assert summary["chunk_accounting"]["balanced"], summary["chunk_accounting"]
    assert "rejoined the run" in (run_dir / "logs" / "env_worker-1.log").read_text()
    assert_no_role_processes(slurm_cluster)


def test_plain_hosts_refuse_strangers_and_stop_when_the_head_dies(
    plain_cluster: Cluster, tmp_path: Path
) -> None:
    """``rlvla3 launch --node NAME`` on each host, as docs/multi-node.md shows it: no Slurm, a
    fixed Redis port, the secret in the environment, and a run dir per host (no shared file
    system; one still holds an earlier run, which is moved aside). A peer without the secret
    gets nothing from Redis or a role socket and is counted; when the head's launcher is
    killed, every other node stops its roles and exits non-zero, and no process is left."""
    c = plain_cluster
    cfg = {
        "run": {
            "name": "plain",
            "heartbeat_ttl_s": 3,
            "head_timeout_s": 10,
            "redis_port": 16379,
            "stop": {"max_wall_s": 300},
        },
        "nodes": [
            {"name": "learner", "host": c.address(1)},
            {"name": "simA", "host": c.address(2)},
            {"name": "simB", "host": c.address(3)},
        ],
        "roles": {
            "env_worker": {"count": 2, "node": ["simA", "simB"]},
            "rollout_server": {"count": 2, "node": ["learner", "simB"]},
            "trainer": {"node": "learner"},
            "weight_broadcaster": {"node": "learner"},
        },
        "env": {"num_envs_per_worker": 2, "chunk_len": 16},
    }
    config = write_yaml(tmp_path / "plain.yaml", cfg)
    secret = run_secret.new_secret()
    stale = tmp_path / "simA"
    stale.mkdir()
    (stale / "run.json").write_text(
        json.dumps({"run_id": "plain", "launch_id": "old", "redis_url": "redis://10.77.0.99:1/0"})
    )
    launchers = {}
    for i, node in enumerate(("learner", "simA", "simB"), start=1):
        log = open(tmp_path / f"{node}.log", "wb")
        launchers[node] = c.exec(
            i,
            sys.executable,
            "-m",
            "rlvla3.cli",
            "launch",
            str(config),
            "--node",
            node,
            "--out",
            str(tmp_path / node),
            env={run_secret.SECRET_ENV: secret},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def servers_updated() -> dict | None:
            info = read_run_info(stale)  # (None between moving the old one aside and joining)
            if info is None or info.get("launch_id") == "old":
                return None
            snap = c.monitor(2, stale)  # node simA, from its own run dir
            versions = [
                r["stats"].get("policy_version", -1)
                for r in snap["roles"]
                if r["role"] == "rollout_server"
            ]
            return snap if len(versions) == 2 and min(versions) >= 3 else None

        snap = wait_until(servers_updated, 180, "weights on both rollout servers")
        assert list(tmp_path.glob("simA-*/run.json")), "the earlier run was not moved aside"
        assert {n["node"] for n in snap["nodes"]} == {"learner", "simA", "simB"}
        server = next(r for r in snap["roles"] if r["role"] == "rollout_server" and r["index"] == 0)
        probe = json.loads(
            c.run(
                2,
                sys.executable,
                "-m",
                "tests.cluster_probe",
                f"redis://{c.address(1)}:16379/0",
                server["endpoints"]["requests"],
                run_keys(secret).server_public.decode(),
            )
        )
        assert probe == {
            "redis": "refused",
            "redis_tls": "refused",
            "zmq_plain": "no reply",
            "zmq_wrong_key": "no reply",
        }
        wait_until(
            lambda: c.monitor(3, tmp_path / "simB")["counters"].get("auth_refused", 0) >= 2,
            30,
            "the refused peers counted",
        )

        os.kill(launchers["learner"].pid, signal.SIGKILL)
        for node in ("simA", "simB"):
            code = launchers[node].wait(timeout=10 + 60)  # head_timeout_s + stopping its roles
            out = (tmp_path / f"{node}.log").read_text()
            assert code == 1 and "lost the head node 'learner'" in out, out
        wait_until(
            lambda: not any(c.processes(i) for i in (1, 2, 3)),
            30,
            "every process on every node gone",
        )
        for log in [*tmp_path.glob("*.log"), *tmp_path.glob("*/logs/*.log")]:
            assert secret not in log.read_text(errors="replace"), f"the run secret is in {log}"
    except BaseException:
        _print_log_tails(tmp_path, secret)  # pytest shows it with the failure
        raise
    finally:
        for proc in launchers.values():
            if proc.poll() is None:
                proc.kill()
        for proc in launchers.values():  # reap the killed ones before the namespaces go
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def _print_log_tails(run_root: Path, secret: str, lines: int = 15) -> None:
    """The end of every launcher's and role's log under ``run_root``, the secret blanked."""
    for log in sorted([*run_root.glob("*.log"), *run_root.glob("*/logs/*.log")]):
        text = log.read_text(errors="replace").replace(secret, "<secret>")
        tail = text.splitlines()[-lines:]
        print(f"--- {log.relative_to(run_root)}", *tail, sep="\n")
