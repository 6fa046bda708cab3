"""How a learner role ends: ``Role.failed`` tells a failure from a stop (also a failure after a
stop was asked), and the RL leader's last checkpoint and ``stop`` come in the order that keeps
no rank waiting on its disk."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from rlvla3.config.run_config import load_config
from rlvla3.runtime.role import Role
from roles.trainer import Trainer


class _Probe(Role):
    """A role whose first step is asked to stop, then (``fail``) raises."""

    name = "trainer"

    def __init__(self, *args, fail: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail = fail
        self.failed_at_shutdown: bool | None = None

    def step(self) -> None:
        self.stop_event.set()  # as SIGTERM does
        if self.fail:
            raise RuntimeError("a peer died mid-collective")

    def shutdown(self) -> None:
        self.failed_at_shutdown = self.failed


@pytest.mark.parametrize("fail", [False, True], ids=["stopped", "failed_after_a_stop"])
def test_shutdown_knows_a_failure_from_a_stop(tmp_path, redis_url, fail: bool) -> None:
    cfg = load_config(None, ["roles.trainer.count=1", f"run.redis_url={redis_url}"])
    role = _Probe(cfg, 0, node="local", run_dir=tmp_path, fail=fail)
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(role.run()))  # (no signal handlers)
    runner.start()
    runner.join(timeout=60)
    assert codes == [int(fail)]
    assert role.failed_at_shutdown is fail


def _leader(calls: list[str], *, sharded: bool, failed: bool) -> Trainer:
    """A leader at its shutdown, its group and checkpoint writer recording what they do."""
    trainer = Trainer.__new__(Trainer)  # (only what the last checkpoint and stop read)

    def whole(optimizer: bool = False) -> tuple[str, str]:
        calls.append("gather" if sharded else "whole")
        return "module", "optimizer"

    trainer.updates, trainer.failed = 3, failed
    trainer.group_updates = SimpleNamespace(sharded=sharded, whole=whole)
    trainer.group = SimpleNamespace(say_stop=lambda timeout_s: calls.append("stop") or True)
    trainer._save = lambda module, optimizer: calls.append(f"save {module} {optimizer}")
    trainer.cfg = SimpleNamespace(run=SimpleNamespace(heartbeat_ttl_s=5.0))
    trainer.log = logging.getLogger("trainer/0")
    return trainer


@pytest.mark.parametrize(
    "sharded, failed, expected",
    [
        # sharded: every rank gathers, then each may leave while the leader writes
        (True, False, ["gather", "stop", "save module optimizer"]),
        # replicated: nothing to wait for, the followers leave first
        (False, False, ["whole", "stop", "save module optimizer"]),
        # a failed sharded leader gathers nothing (peers may be gone) and says nothing
        (True, True, []),
        (False, True, ["whole", "save module optimizer"]),
    ],
)
def test_the_leader_says_stop_before_its_last_write(sharded, failed, expected) -> None:
    calls: list[str] = []
    trainer = _leader(calls, sharded=sharded, failed=failed)
    trainer._last_checkpoint_and_stop(clean=not trainer.failed)
    assert calls == expected
