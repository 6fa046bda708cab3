"""``rlvla3 monitor --prometheus PORT``: every counter and gauge of a run for Prometheus.

Each scrape reads the run's Redis once (``rlvla3.monitor.live.snapshot``) and serves, in the text
format of the standard client library (``prometheus_client``):

- run-wide counters as ``rlvla3_<name>_total{run}`` (``rlvla3/runtime/metric_names.py``; totals kept
  in µs are served in seconds: ``action_wait_us`` -> ``rlvla3_action_wait_seconds_total``);
- each role instance's own gauges as ``rlvla3_role_<name>{run,role,index,node}`` (ms served
  in seconds) and its share of the counters as ``rlvla3_role_<name>_total{...}``;
- ``rlvla3_role_up``, ``rlvla3_role_stalled``, ``rlvla3_role_process_restarts_total`` per
  role instance;
- ``rlvla3_weight_version``, ``rlvla3_chunks_in_flight`` and ``rlvla3_run_up{run}`` (0 once the
  run's Redis is gone);
- whether it learns: ``rlvla3_mean_return`` and ``rlvla3_success_rate`` of the last 20 training
  episodes, ``rlvla3_eval_success_rate``, ``rlvla3_eval_mean_return`` and
  ``rlvla3_eval_version`` of the newest periodic evaluation.

It binds loopback unless told otherwise: the figures are the run's, not the world's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rlvla3.monitor.live import snapshot
from rlvla3.monitor.rates import role_status
from rlvla3.runtime.metric_names import COUNTERS, GAUGES
from rlvla3.runtime.registry import Registry

ROLE_LABELS = ["run", "role", "index", "node"]


def metric_name(name: str) -> tuple[str, float]:
    """Our counter or gauge name -> (Prometheus base name, factor to its base unit)."""
    if name.endswith("_us"):
        return name[:-3] + "_seconds", 1e-6
    if name.endswith("_ms"):
        return name[:-3] + "_seconds", 1e-3
    return name, 1.0


class RunCollector:
    """A ``prometheus_client`` collector of one run, read from its Redis at every scrape."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.lock = threading.Lock()  # scrapes may overlap; one Redis connection pool serves

    def collect(self) -> Iterator[Metric]:
        run = self.registry.run_id
        up = GaugeMetricFamily("rlvla3_run_up", "1 while the run's Redis answers", labels=["run"])
        try:
            with self.lock:
                snap = snapshot(self.registry)
        except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
            up.add_metric([run], 0.0)
            yield up
            return
        up.add_metric([run], 1.0)
        yield up
        yield from self._run_metrics(run, snap)
        yield from self._role_metrics(run, snap["roles"])

    def _run_metrics(self, run: str, snap: dict[str, Any]) -> Iterator[Metric]:
        for name, doc in COUNTERS.items():
            base, factor = metric_name(name)
            family = CounterMetricFamily(f"rlvla3_{base}", doc, labels=["run"])
            family.add_metric([run], snap["counters"].get(name, 0) * factor)
            yield family
        version = GaugeMetricFamily(
            "rlvla3_weight_version", "the newest weight version broadcast", labels=["run"]
        )
        version.add_metric([run], snap["weight_version"])
        yield version
        in_flight = GaugeMetricFamily(
            "rlvla3_chunks_in_flight",
            "chunks produced and not yet consumed, dropped or lost",
            labels=["run"],
        )
        in_flight.add_metric([run], snap["chunks_in_flight"])
        yield in_flight
        yield from _learning(run, snap)

    def _role_metrics(self, run: str, roles: list[dict[str, Any]]) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "rlvla3_role_up", "1 while the role's heartbeat is fresh", labels=ROLE_LABELS
        )
        stalled = GaugeMetricFamily(
            "rlvla3_role_stalled",
            "1 while the role finished no step by its deadline (run.stall_timeout_s)",
            labels=ROLE_LABELS,
        )
        restarts = CounterMetricFamily(
            "rlvla3_role_process_restarts",
            "restarts of this role instance by its launcher",
            labels=ROLE_LABELS,
        )
        gauges = {
            name: GaugeMetricFamily(f"rlvla3_role_{metric_name(name)[0]}", doc, labels=ROLE_LABELS)
            for name, doc in GAUGES.items()
        }
        counters = {
            name: CounterMetricFamily(
                f"rlvla3_role_{metric_name(name)[0]}",
                f"this role's share: {doc}",
                labels=ROLE_LABELS,
            )
            for name, doc in COUNTERS.items()
            if name not in GAUGES
        }
        for role in roles:
            labels = [run, role["role"], str(role["index"]), role["node"]]
            up.add_metric(labels, float(role["alive"]))
            stalled.add_metric(labels, float(role_status(role) == "STALLED"))
            restarts.add_metric(labels, float(role["restarts"]))
            for name, value in role["stats"].items():
                factor = metric_name(name)[1]
                if name in gauges:
                    gauges[name].add_metric(labels, value * factor)
                elif name in counters:
                    counters[name].add_metric(labels, value * factor)
        yield up
        yield stalled
        yield restarts
        yield from (g for g in gauges.values() if g.samples)
        yield from (c for c in counters.values() if c.samples)


def _learning(run: str, snap: dict[str, Any]) -> Iterator[Metric]:
    """Whether the run learns: the recent training episodes and the newest evaluation."""
    recent = snap.get("recent_episodes") or []
    figures: list[tuple[str, str, float | None]] = [
        (
            "mean_return",
            "mean return of the last 20 training episodes",
            snap["mean_return_last_20"],
        ),
    ]
    last = recent[-20:]
    if last and all("success" in e for e in last):
        rate = sum(bool(e["success"]) for e in last) / len(last)
        figures.append(("success_rate", "success rate of the last 20 training episodes", rate))
    evaluations = snap.get("evaluations") or []
    if evaluations:
        e = evaluations[-1]
        figures.append(
            ("eval_version", "the weight version last evaluated (run.eval)", e["version"])
        )
        figures.append(
            ("eval_mean_return", "its mean return on the held-out episodes", e["mean_return"])
        )
        if "success_rate" in e:
            figures.append(
                (
                    "eval_success_rate",
                    "its greedy success rate on the held-out episodes",
                    e["success_rate"],
                )
            )
    for name, doc, value in figures:
        if value is not None:
            family = GaugeMetricFamily(f"rlvla3_{name}", doc, labels=["run"])
            family.add_metric([run], float(value))
            yield family


def serve(registry: Registry, port: int, host: str = "127.0.0.1") -> tuple[Any, int]:
    """Serve ``registry``'s run at ``http://host:port/metrics`` on a background thread;
    returns the server and the port it bound (``port`` 0 picks a free one)."""
    collectors = CollectorRegistry(auto_describe=False)
    collectors.register(RunCollector(registry))
    server, _thread = start_http_server(port, addr=host, registry=collectors)
    return server, server.server_port
