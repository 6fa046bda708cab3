"""The role base class: every process of a run (env worker, rollout server, trainer...) is one.

A role implements ``setup()``, ``step()`` (one bounded unit of work) and ``shutdown()``; what
``setup()`` opens it hands to ``own()``, and the base closes it at exit (also when ``setup()``
failed half-way), so ``shutdown()`` runs only after a complete setup. The base alone owns the
loop, Redis registration, heartbeats (``rlvla3/runtime/heartbeat.py``), counters
(``rlvla3/runtime/counter_batch.py``), status transitions
(``starting → running → stopping → done | error``) and signals: the first SIGINT/SIGTERM stops
gracefully after the current step, the second exits at once.

Liveness is progress (``rlvla3/runtime/heartbeat.py``): a role whose loop hangs keeps its
heartbeat thread going but misses its step deadline; its launcher then has every thread's stack
written to the role's log (SIGUSR1, ``faulthandler``), kills it and restarts it. Work that is
slow by nature says so (``with self.busy("PPO update"): ...``); work done by threads beside the
loop is held to the same timeout (``stuck_work``).

Roles run as ``python -m roles.<name> --config RUN_DIR/config.yaml --index I --node NODE
--address ADDR --device DEV``, ``DEV`` being where the launcher placed the instance
(``rlvla3/config/devices.py``; it becomes the role's ``settings.device``). In a multi-host run (or on one host bound beyond loopback) the launcher hands
over the keys the role needs through a pipe (``--secret-fd``, ``rlvla3/runtime/role_keys.py``),
never the run secret: the role then authenticates to Redis with the run user's credentials (an
env worker's: the env user's, ``rlvla3/runtime/redis_auth.py``) and speaks CURVE on every socket
(``transport/security.py``). A role rides out a Redis it cannot reach (a network outage between
hosts) for ``run.head_timeout_s``, then stops with an error. A Redis that refuses the run's
secret is no outage: the role stops at once.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import ClassVar, Generic, TypeVar, cast

import redis

from rlvla3.config.role_table import RunKey, role_spec
from rlvla3.config.run_config import Config
from rlvla3.runtime import role_keys
from rlvla3.runtime.counter_batch import CounterBatch, DropReports
from rlvla3.runtime.heartbeat import Heartbeat, Liveness, RedisOutage
from rlvla3.runtime.log_text import loggable
from rlvla3.runtime.metric_names import COUNTERS, GAUGES
from rlvla3.runtime.redis_auth import RedisAuth
from rlvla3.runtime.registry import Registry
from rlvla3.runtime.signals import install_stop_signals
from transport.codec import CodecError
from transport.sockets import MessageSocket

T = TypeVar("T")
SettingsT = TypeVar("SettingsT")
_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
_OUTAGE_RETRY_S = 1.0


class Role(abc.ABC, Generic[SettingsT]):
    """Base of every role process. Subclasses set ``name`` and implement ``step()``;
    ``SettingsT`` is the dataclass of their ``roles.<name>.settings`` (``EnvWorkerSettings``...)."""

    name: ClassVar[str]
    _weights_key: bytes | None = b""  # b"": a one-host run's (none); None: not handed to us

    @property
    def weights_key(self) -> bytes:
        """The run's weights key (``transport/weight_auth.py``): signs and checks weight
        versions. ``main`` sets it from the role's keys; b"" in a one-host run, which has none.

        Raises:
            MissingKeyError: this role was not handed it (the role table's ``keys``).
        """
        if self._weights_key is None:
            raise role_keys.missing_key(self.name, RunKey.WEIGHTS)
        return self._weights_key

    @weights_key.setter
    def weights_key(self, key: bytes | None) -> None:
        self._weights_key = key

    _chunk_key: bytes | None = b""  # b"": a one-host run's (none); None: not handed to us

    @property
    def chunk_key(self) -> bytes:
        """This role's key of the chunk tags (``transport/chunk_auth.py``): a trainer's checks
        every env worker's chunks, an env worker's tags its own. ``main`` sets it from the
        role's keys; b"" in a one-host run, which tags nothing.

        Raises:
            MissingKeyError: this role was not handed one (the role table's ``keys``).
        """
        if self._chunk_key is None:
            checks = RunKey.CHUNK_CHECK in role_spec(self.name).keys
            wanted = RunKey.CHUNK_CHECK if checks else RunKey.CHUNK_SIGN
            raise role_keys.missing_key(self.name, wanted)
        return self._chunk_key

    @chunk_key.setter
    def chunk_key(self, key: bytes | None) -> None:
        self._chunk_key = key

    def __init__(
        self,
        cfg: Config,
        index: int,
        *,
        node: str,
        run_dir: Path,
        address: str | None = None,
        redis_password: RedisAuth | str | None = None,
        device: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.index = index
        self.node = cfg.node(node)
        self.address = address or self.node.host or "127.0.0.1"
        self.run_dir = run_dir
        # The role table ties ``name`` to its settings class; a type checker cannot follow a
        # name, so the subclass's declared ``SettingsT`` is taken on trust here, once.
        # ``settings.device`` is where the launcher placed this instance (``device``)
        self.settings = cast(SettingsT, cfg.placed_settings(self.name, index, device))
        self.log = logging.getLogger(f"{self.name}/{index}")
        self.stop_event = threading.Event()
        # True once setup or the loop raised: ``shutdown`` then skips what needs live peers
        # (a stop may have been asked too: the stop event says nothing of a failure)
        self.failed = False
        if cfg.run.redis_url is None:
            raise ValueError("run.redis_url: not set; roles are started by the launcher")
        self.registry = Registry(cfg.run.redis_url, cfg.run.name, redis_password)
        self._outage = RedisOutage(cfg.run.head_timeout_s)
        self._gauges: dict[str, float] = {}
        # this process start's flushes (a restarted role numbers its own from 0)
        self._counters = CounterBatch(f"{self.name}/{index}#{uuid.uuid4().hex[:8]}")
        self._drop_reports = DropReports()
        self._owned: list[Callable[[], object]] = []  # closers of what setup() opened
        self._set_up = False
        self._liveness = Liveness(cfg.run.stall_timeout_s, cfg.run.busy_timeout_s)

    # --- the interface subclasses implement ----------------------------------------------------
    def setup(self) -> None:
        """Open sockets, load models, find peers. Runs once before the first ``step()``."""

    @abc.abstractmethod
    def step(self) -> None:
        """One bounded unit of work; must return within about a second so stops are prompt."""

    def shutdown(self) -> None:
        """Final work that needs everything ``setup()`` made (drain a queue, a last checkpoint).
        Runs once after the loop ends, also after an error, but only when ``setup()`` finished;
        closing is ``own()``'s job."""

    def stats(self) -> dict[str, float]:
        """Gauges published with every heartbeat; subclasses may extend (call super)."""
        return dict(self._gauges)

    # --- helpers for subclasses -------------------------------------------------------------------
    def own(self, resource: T, close: Callable[[], object] | None = None) -> T:
        """Register something ``setup()`` opened; the base closes it at exit (``close``, else
        its ``close()``), the newest first, whether or not ``setup()`` finished."""
        self._owned.append(close if close is not None else resource.close)
        return resource

    def progress(self) -> None:
        """Note that the role is making progress (the loop does after every step; long work
        with natural milestones may call it in between)."""
        self._liveness.progress()

    def busy(self, what: str, up_to_s: float | None = None) -> AbstractContextManager[None]:
        """Say that the enclosed work is slow by nature, so the role is not taken for stalled
        while it runs, for up to ``up_to_s`` (default ``run.busy_timeout_s``)."""
        return self._liveness.busy(what, up_to_s)

    def stuck_work(self) -> tuple[float, str] | None:
        """The oldest unfinished work done beside the loop: (wall time it began, what it is), or
        None when there is none. Roles whose threads work apart from ``step()`` (the env
        worker's env threads) override it, so that a thread stuck there stalls the role too."""
        return None

    def gauge(self, name: str, value: float) -> None:
        """Set a gauge shown by the monitor (one of ``rlvla3.runtime.metric_names.GAUGES``)."""
        if name not in GAUGES:
            raise KeyError(
                f"gauge {name!r}: not in rlvla3/runtime/metric_names.py (add it with its meaning)"
            )
        self._gauges[name] = float(value)

    def count(self, name: str, amount: int = 1) -> None:
        """Add to a run-wide Redis counter (one of ``rlvla3.runtime.metric_names.COUNTERS``; batched,
        flushed every 0.5 s and at exit)."""
        if name not in COUNTERS:
            raise KeyError(
                f"counter {name!r}: not in rlvla3/runtime/metric_names.py (add it with its meaning)"
            )
        self._counters.add(name, amount)
        self._gauges[name] = self._gauges.get(name, 0.0) + amount

    def ledger_high(self, field: str, value: int) -> None:
        """Raise a chunk ledger high-water mark (``rlvla3/runtime/chunk_ledger.py``); flushed with the
        counters, in the same transaction."""
        self._counters.raise_high(field, value)

    def ledger_add(self, field: str, amount: int) -> None:
        """Add to a chunk ledger field; flushed with the counters, in the same transaction."""
        self._counters.add_to_ledger(field, amount)

    def counting_together(self) -> AbstractContextManager[None]:
        """A block whose counts and ledger changes land in one flush, whole or not at all
        (``CounterBatch.together``; never flush inside it)."""
        return self._counters.together()

    def count_bad_frame(self, err: CodecError) -> None:
        """Count and log a message that failed to decode; the role carries on."""
        self.drop("bad_frames", f"dropped a bad message: {type(err).__name__}: {err}")

    def drop(self, counter: str, reason: str) -> None:
        """Count a dropped message in ``counter`` and log why (``DropReports``: at most every
        10 s per counter, with how many were dropped since)."""
        self.count(counter)
        suppressed = self._drop_reports.due(counter)
        if suppressed is not None:
            more = f" ({suppressed} more dropped since the last report)" if suppressed else ""
            self.log.warning("%s%s", loggable(reason), more)  # reasons quote peers' input

    def bind(self, endpoint: str, sock: MessageSocket) -> str:
        """Bind ``sock`` on this node and publish it in Redis as ``endpoint``."""
        address = sock.bind(
            host=self.address, scheme=self.cfg.run.transport, ipc_dir=str(self.run_dir / "ipc")
        )
        self.registry.publish_endpoint(self.name, self.index, endpoint, address)
        return address

    def wait_for_endpoints(
        self, role: str, endpoint: str, min_count: int = 1, timeout_s: float = 120.0
    ) -> list[str]:
        """Addresses of ``role``'s ``endpoint`` once at least ``min_count`` are live."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.registry.endpoints(role, endpoint)
            if len(found) >= min_count:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {min_count} live {role}.{endpoint} within {timeout_s}s")
            if self.stop_event.wait(0.05):
                raise InterruptedError("stopped while waiting for peers")

    # --- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        """Register, set up, step until stopped, shut down. Returns the process exit code."""
        self._install_signal_handlers()
        self.registry.register(
            self.name, self.index, node=self.node.name, host=self.address, pid=os.getpid()
        )
        self.registry.heartbeat(self.name, self.index, self.cfg.run.heartbeat_ttl_s, {})
        heartbeat = Heartbeat(
            beat=self._beat,
            flush=self._flush_counters,
            ttl_s=self.cfg.run.heartbeat_ttl_s,
            outage=self._outage,
            stop_event=self.stop_event,
            log=self.log,
        )
        heartbeat.start()
        code = 0
        try:
            self.setup()
            self._set_up = True
            self.registry.set_status(self.name, self.index, "running")
            self.log.info("running")
            self.progress()
            while not self.stop_event.is_set():
                try:
                    self.step()
                except _REDIS_ERRORS as err:
                    self._ride_out_redis_outage(err)
                self.progress()
        except InterruptedError:
            pass
        except Exception:
            self.log.exception("failed")
            self.failed, code = True, 1
        if self._outage.gone_for_good():
            code = 1
        code = self._finish(code)
        heartbeat.stop()
        return code

    def _finish(self, code: int) -> int:
        self._liveness.stopping()
        self._set_status("stopping")
        try:
            if self._set_up:
                self.shutdown()
        except Exception:
            self.log.exception("shutdown failed")
            code = 1
        for close in reversed(self._owned):
            try:
                close()
            except Exception:
                self.log.exception("closing %s failed", close)
                code = 1
        self._flush_counters()
        try:  # the last gauges, not those of the last heartbeat (up to a second old)
            self.registry.publish_stats(self.name, self.index, self.stats())
        except Exception as err:
            self.log.warning("could not publish final stats: %s", err)
        self._set_status("error" if code else "done")
        self.log.info("stopped (%s)", "error" if code else "done")
        return code

    def _ride_out_redis_outage(self, err: Exception) -> None:
        """A step failed on Redis: wait and step again, up to ``run.head_timeout_s`` in all
        (then raise: the role stops with an error)."""
        if isinstance(err, redis.exceptions.AuthenticationError):
            raise RuntimeError(f"the run's Redis refused the run secret: {err}") from err
        if self._outage.mark_lost(time.monotonic()):
            self.log.warning(
                "Redis unreachable (%s); riding it out for up to %.0fs",
                err,
                self.cfg.run.head_timeout_s,
            )
        if self._outage.gone_for_good():
            raise RuntimeError(
                f"Redis unreachable for {self._outage.duration_s():.0f}s (run.head_timeout_s)"
            ) from err
        self.stop_event.wait(_OUTAGE_RETRY_S)

    def _set_status(self, status: str) -> None:
        try:
            self.registry.set_status(self.name, self.index, status)
        except Exception as err:  # Redis gone at exit: the exit code still tells the launcher
            self.log.warning("could not record status %s: %s", status, err)

    def _beat(self) -> None:
        """Publish one heartbeat: the gauges and the time by which the next step is due."""
        stall_at, busy = self._liveness.deadline(self.stuck_work)
        self.registry.heartbeat(
            self.name,
            self.index,
            self.cfg.run.heartbeat_ttl_s,
            self.stats(),
            stall_at=stall_at,
            busy=busy,
        )

    def _flush_counters(self) -> None:
        self._counters.flush(self.registry, self.log)

    def _install_signal_handlers(self) -> None:
        def on_signal(signum: int, count: int) -> None:  # on the signal watcher thread
            if count > 1:
                os._exit(128 + signum)  # second signal: the user insists
            self.log.info("signal %d: stopping after the current step", signum)
            self.stop_event.set()

        install_stop_signals(on_signal)
