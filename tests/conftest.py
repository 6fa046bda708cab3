"""Shared fixtures: a real embedded redis-server for the session, fresh run ids, waiting helpers."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rlvla3.redis_server import EmbeddedRedis
from rlvla3.registry import Registry

_run_ids = itertools.count()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a private redis-server started for this test session (the launcher's mechanism)."""
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def registry(redis_url: str) -> Iterator[Registry]:
    """A registry on a run id no other test uses."""
    reg = Registry(redis_url, f"test{next(_run_ids)}")
    yield reg
    reg.clear_run()
    reg.close()


def wait_until(
    predicate: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition"
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        tick.wait(0.05)
