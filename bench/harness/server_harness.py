"""Real rollout servers under measurement: ``roles.rollout_server``'s ``RolloutServer`` in child
processes, this process their weight broadcaster.

``ServerHarness`` runs the real role (``Role.run()``: Redis registration, heartbeats, ``setup()``,
the ``step()`` loop with dynamic batching, the weights thread) against a private embedded Redis,
with a real ``Broadcaster`` and ``WeightLink``. The only instrumentation wraps ``_serve`` (and
``_receive_into_standby``) to record when each batch ran, how big it was and which weight
version served it. ``bench/rollout_server.py`` and ``bench/weight_sync.py`` measure with it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlvla3.config.run_config import config_from_dict
from rlvla3.launch.redis_server import EmbeddedRedis
from rlvla3.runtime.registry import Registry
from roles.rollout_server import RolloutServer  # (imported once, in the forkserver)
from transport.weight_auth import weights_key, weights_tag
from transport.weight_fanout import Broadcaster
from transport.weights import FlatLayout, start_store

from . import one_blas_thread  # noqa: F401  (the servers compute on one BLAS thread, as roles do)
from .wire_messages import HOST

_CTX = mp.get_context("forkserver")  # children fork from one process that imported torch


def _timed(fn: Any, calls: list[tuple[float, float]]) -> Any:
    """``fn``, appending ``(start, end)`` of every call to ``calls``."""

    def timed(*args: Any) -> Any:
        started = time.monotonic()
        try:
            return fn(*args)
        finally:
            calls.append((started, time.monotonic()))

    return timed


def _instrument(role: Any) -> dict[str, list[tuple]]:
    """Record, in the server: ``batches`` ``(start, end, batch size, version)`` per ``_serve``,
    ``loads`` ``(start, end)`` per weights receive into the standby copy (start: the version's
    header arrived; end: every weight is in place)."""
    records: dict[str, list[tuple]] = {"batches": [], "loads": []}
    serve, setup = role._serve, role.setup

    def timed_serve(batch: list) -> int:
        started = time.monotonic()
        served = serve(batch)  # how many were answered: the role counts them
        records["batches"].append((started, time.monotonic(), len(batch), role.version))
        return served

    def timed_setup() -> None:
        setup()  # returns once the first weights are in; later receives are timed
        role._receive_into_standby = _timed(role._receive_into_standby, records["loads"])

    role._serve, role.setup = timed_serve, timed_setup
    return records


def _skip_weight_init() -> None:
    """Make parameter init free: the first broadcast overwrites every weight before serving.

    (Orthogonal init of a 100M-parameter MLP takes about a minute on one thread.)
    """
    for name in ("kaiming_uniform_", "uniform_", "orthogonal_", "normal_", "zeros_"):
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)


def _server_main(raw_cfg: dict, index: int, run_dir: str, results: Any, skip_init: bool) -> None:
    """Process entry: run one real ``RolloutServer`` until SIGTERM, then report its records."""
    torch.set_num_threads(1)
    if skip_init:
        _skip_weight_init()
    logging.basicConfig(level=logging.WARNING, filename=f"{run_dir}/rollout_server-{index}.log")
    role = RolloutServer(config_from_dict(raw_cfg), index, node="local", run_dir=Path(run_dir))
    records = _instrument(role)
    code = role.run()
    width = {"batches": 4, "loads": 2}
    results.put(
        (index, code, {k: np.array(v, float).reshape(-1, width[k]) for k, v in records.items()})
    )


def server_config(
    name: str,
    redis_url: str,
    count: int,
    hidden: tuple,
    settings: dict,
    sections: dict | None = None,
) -> dict:
    """The run config the rollout servers load: CartPole spaces and an MLP of ``hidden`` sizes,
    or the run config ``sections`` (``env``, ``policy``...) in their place."""
    return {
        "run": {"name": name, "mode": "async", "redis_url": redis_url},
        # (this process plays the weight broadcaster: the servers link to it for their weights)
        "roles": {
            "rollout_server": {"count": count, "settings": settings},
            "weight_broadcaster": {"count": 1},
        },
        **(
            sections
            or {
                "env": {"id": "CartPole-v1"},
                "policy": {"kind": "mlp", "hidden_sizes": list(hidden)},
            }
        ),
    }


def policy_numel(raw_cfg: dict) -> int:
    """Length of the servers' flat weight buffer (the policy is built on the meta device)."""
    from rlvla3.policy.factory import build_policy

    with torch.device("meta"):
        return FlatLayout.of(build_policy(config_from_dict(raw_cfg))).numel


class ServerHarness:
    """``count`` real rollout servers, this process their weight broadcaster.

    Use as a context manager. Inside: ``addresses`` (each server's request endpoint, by index),
    ``publish(version)`` (a timed sync of ``flat``), and after exit ``records`` (index -> name ->
    array, see ``_instrument``).

    ``sections``: run config sections that replace the CartPole MLP of ``hidden`` (any policy
    and env), then ``numel`` is the length of their flat weight buffer (``FlatLayout.of`` the
    policy: a pretrained model cannot be sized on the meta device). The broadcaster's weights
    live on the servers' ``device`` setting.
    """

    def __init__(
        self,
        name: str,
        count: int,
        hidden: tuple = (),
        settings: dict | None = None,
        skip_init: bool = False,
        *,
        sections: dict | None = None,
        numel: int | None = None,
    ) -> None:
        self.name, self.count, self.hidden = name, count, hidden
        self.settings, self.skip_init = settings or {}, skip_init
        self.sections, self.numel = sections, numel
        self.records: dict[int, dict[str, np.ndarray]] = {}
        self.procs: list[Any] = []

    def __enter__(self) -> ServerHarness:
        self._redis = EmbeddedRedis().start()
        self._tmp = tempfile.TemporaryDirectory(prefix="rlvla3-bench-")
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        raw_cfg = server_config(
            self.name, self._redis.url, self.count, self.hidden, self.settings, self.sections
        )
        self.registry = Registry(self._redis.url, self.name)
        self.store = start_store(HOST)
        device = self.settings.get("device", "cpu")
        self.broadcaster = Broadcaster(self.store, device)
        self.registry.register("weight_broadcaster", 0, node="local", host=HOST, pid=os.getpid())
        self.registry.heartbeat("weight_broadcaster", 0, 24 * 3600.0, {})
        self.registry.publish_endpoint(
            "weight_broadcaster", 0, "store", f"{HOST}:{self.store.port}"
        )
        self._results = _CTX.Queue()
        for i in range(self.count):
            args = (raw_cfg, i, self._tmp.name, self._results, self.skip_init)
            proc = _CTX.Process(target=_server_main, args=args, daemon=True)
            proc.start()
            self.procs.append(proc)
        numel = policy_numel(raw_cfg) if self.numel is None else self.numel
        self.flat = torch.empty(numel, device=device).uniform_(-0.05, 0.05)
        for link_id in self._wait_endpoints("weights_link"):
            self.broadcaster.add(link_id)
        self.publish(0)
        self.addresses = self._wait_endpoints("requests")

    def _wait_endpoints(self, endpoint: str, timeout_s: float = 180.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while len(found := self.registry.endpoints("rollout_server", endpoint)) < self.count:
            if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs):
                raise RuntimeError(f"rollout servers did not start; logs in {self._tmp.name}")
            time.sleep(0.05)  # polling Redis for other processes' registrations
        return found

    def publish(self, version: int) -> tuple[float, float]:
        """Broadcast ``flat`` as ``version`` to every server; returns (start, end) monotonic."""
        self.flat[0] = version * 1e-6  # a new version differs in content, as a real one would
        # as the trainer does: record the version, sign it (the servers' key: a one-host run's)
        self.registry.set_trained_version(version)
        tag = weights_tag(weights_key(None), version, self.flat)
        started = time.monotonic()
        failed = self.broadcaster.publish(version, self.flat, tag=tag)
        ended = time.monotonic()
        if failed:
            raise RuntimeError(f"weight links failed: {failed}")
        return started, ended

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()  # SIGTERM: the role stops after its current step
        for _ in self.procs:
            try:
                index, _code, records = self._results.get(timeout=30)
                self.records[index] = records
            except Exception:
                break
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._redis.stop()
        self._tmp.cleanup()


def in_windows(records: np.ndarray, windows: list[tuple[float, float]]) -> np.ndarray:
    """The ``(start, end, ...)`` records that started and ended inside one of the ``windows``."""
    inside = np.zeros(len(records), bool)
    for start, end in windows:
        inside |= (records[:, 0] >= start) & (records[:, 1] <= end)
    return records[inside]
