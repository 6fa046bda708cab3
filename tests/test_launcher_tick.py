"""The launcher's parts in a run, without starting a process: a member node follows the head's
end and gives up on a head out of reach; the head rides out a Redis outage as long as roles do."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rlvla3.config.run_config import load_config
from rlvla3.config.typed_load import ConfigError
from rlvla3.launch.cluster import find_seat
from rlvla3.launch.head import HeadPolicy
from rlvla3.launch.member import MemberPolicy
from rlvla3.launch.node_run import NodeLink, NodeRun, NodeSetup
from rlvla3.launch.rendezvous import RunStore
from rlvla3.launch.stop_reason import StopKind
from rlvla3.runtime.registry import Registry

_NODES = [
    "nodes=[{name: learner}, {name: sim}]",
    "roles.trainer.node=learner",
    "roles.env_worker.node=sim",
    "run.head_timeout_s=10",
]


def _setup(node: str, tmp_path: Path, extra: tuple[str, ...] = ()) -> NodeSetup:
    cfg = load_config(None, [*_NODES, *extra])
    return NodeSetup(
        cfg=cfg,
        seat=find_seat(cfg, node, env={}),
        run_dir=tmp_path,
        echo=lambda _line: None,
        stop_requested=threading.Event(),
        kill_requested=threading.Event(),
    )


def _run(setup: NodeSetup, registry: Registry) -> NodeRun:
    link = NodeLink(RunStore(registry.url, None), None, "127.0.0.1", registry)
    return NodeRun(setup=setup, link=link, roles=None, spawn=None, heartbeat=None, started=0.0)


def test_a_member_follows_the_heads_end_with_its_exit_code(tmp_path, registry) -> None:
    member = MemberPolicy(_setup("sim", tmp_path))
    run = _run(member.setup, registry)
    assert member.check(run, 1.0) is None  # the head was just reached (joined at 0)
    registry.end_run("stopped by signal", 130)
    reason = member.check(run, 2.0)
    assert reason.kind is StopKind.HEAD_ENDED and reason.exit_code == 130
    assert reason.text == "the head ended the run: stopped by signal"


def test_a_member_gives_up_on_a_head_out_of_reach_for_head_timeout_s(tmp_path, registry) -> None:
    member = MemberPolicy(_setup("sim", tmp_path))
    run = _run(member.setup, registry)
    assert member.unreachable(run, 9.0, ConnectionError("down")) is None
    lost = member.unreachable(run, 10.0, ConnectionError("down"))
    assert lost.kind is StopKind.HEAD_LOST and lost.exit_code == 1
    assert lost.text == "lost the head node 'learner' for 10s (run.head_timeout_s)"
    assert "head learner unreachable for 10s" in member.progress_line(_progress_run(run), 10.0)


def test_a_node_without_roles_of_its_own_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no role processes to start on node 'sim'"):
        MemberPolicy(_setup("sim", tmp_path, ("roles.env_worker.node=learner",)))


def test_the_head_rides_out_a_redis_outage_for_head_timeout_s(tmp_path, registry) -> None:
    head = HeadPolicy(_setup("learner", tmp_path))
    run = _run(head.setup, registry)
    assert head.unreachable(run, 100.0, ConnectionError("down")) is None
    assert head.unreachable(run, 109.0, ConnectionError("down")) is None
    lost = head.unreachable(run, 110.0, ConnectionError("down"))
    assert lost.kind is StopKind.REDIS_LOST and lost.exit_code == 1
    assert lost.text == f"lost the run's Redis at {registry.url} (down)"


class _Roles:
    """What a member's progress line reads of its role processes."""

    running, procs, restarts = 1, [object(), object()], 0


def _progress_run(run: NodeRun) -> NodeRun:
    return NodeRun(
        setup=run.setup, link=run.link, roles=_Roles(), spawn=None, heartbeat=None, started=0.0
    )
