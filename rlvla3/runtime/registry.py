"""Run bookkeeping in Redis: role registry, heartbeats, endpoints, counters, weight version.

All Redis access of roles, the launcher and the monitor goes through ``Registry``; every key comes
from ``rlvla3/runtime/keys.py``, and what it reads back about roles and launchers comes as the
records of ``rlvla3/runtime/registry_records.py``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

import redis

from rlvla3.config import redis_url
from rlvla3.runtime import keys
from rlvla3.runtime.flush_once import flush_once
from rlvla3.runtime.ledger_store import read_ledger
from rlvla3.runtime.redis_auth import ENV_USER, RedisAuth, as_auth
from rlvla3.runtime.registry_records import LauncherRecord, RoleRecord, launcher_record, role_record

_MAX_LIST_POINTS = 200_000  # a long run's learning curve from its first episode (~30 MB)

_log = logging.getLogger(__name__)


class RunInUse(RuntimeError):
    """A run of the same name is live on the Redis a launch was about to clear."""


class Registry:
    """Typed access to one run's state in Redis.

    Args:
        url: the Redis URL (``redis://host:port/0``, ``rediss://`` for TLS, ``unix:///path``).
        run_id: the run whose keys it reads and writes.
        password: Redis credentials: a multi-host run's (``run_redis_auth``: its user, password
            and pinned certificate), or a plain AUTH password; None: the URL's own, if any.
            ``url`` then keeps the password redacted (``self.url``).
    """

    def __init__(self, url: str, run_id: str, password: RedisAuth | str | None = None) -> None:
        auth = as_auth(password)
        in_url = redis_url.password_of(url)
        if auth is None and in_url is not None and in_url != redis_url.REDACTED:
            auth = RedisAuth(in_url)
        self.url = redis_url.redacted(url)  # what messages may show
        url = redis_url.without_password(url)
        self.run_id = run_id
        # the env user may not write the guarded keys: its flushes keep their marker apart
        self.writes_guarded = auth is None or auth.username != ENV_USER
        self._said_unreadable: set[str] = set()  # registry records left out, each said once
        options: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": 10,
            "socket_connect_timeout": 5,
        }
        if not url.startswith("unix:"):  # a dead peer host is noticed, not waited on forever
            options["socket_keepalive"] = True
        if auth is not None:
            options.update(auth.client_options(url))
        self.redis = redis.Redis.from_url(url, **options)

    # --- role registry and heartbeats -------------------------------------------------------
    def register(self, role: str, index: int, *, node: str, host: str, pid: int) -> None:
        """Record a (re)starting role instance; keeps its restart count."""
        key = keys.role_record(self.run_id, role, index)
        self.redis.sadd(keys.roles_index(self.run_id), keys.role_id(role, index))
        self.redis.hset(
            key,
            mapping={
                "role": role,
                "index": index,
                "node": node,
                "host": host,
                "pid": pid,
                "status": "starting",
                "endpoints": "{}",
                "heartbeat_at": time.time(),
                "stall_at": 0,  # not checked until the role runs and says when it would stall
                "busy": "",
            },
        )
        self.redis.hsetnx(key, "restarts", 0)

    def heartbeat(
        self,
        role: str,
        index: int,
        ttl_s: float,
        stats: dict[str, float],
        *,
        stall_at: float = 0.0,
        busy: str = "",
    ) -> None:
        """Refresh the role's TTL key and publish its current stats and liveness: ``stall_at``
        (wall time after which it counts as stalled, 0: not checked) and ``busy``."""
        pipe = self.redis.pipeline()
        pipe.set(keys.role_alive(self.run_id, role, index), 1, px=int(ttl_s * 1000))
        pipe.hset(
            keys.role_record(self.run_id, role, index),
            mapping={"heartbeat_at": time.time(), "stall_at": stall_at, "busy": busy},
        )
        if stats:
            pipe.hset(keys.role_stats(self.run_id, role, index), mapping=stats)
        pipe.execute()

    def publish_stats(self, role: str, index: int, stats: dict[str, float]) -> None:
        """Publish the role's stats without refreshing its heartbeat (e.g. its last ones)."""
        if stats:
            self.redis.hset(keys.role_stats(self.run_id, role, index), mapping=stats)

    def set_status(self, role: str, index: int, status: str) -> None:
        """Record a lifecycle transition."""
        self.redis.hset(keys.role_record(self.run_id, role, index), "status", status)

    def mark_dead(self, role: str, index: int) -> None:
        """Drop a role's heartbeat at once (the launcher saw its process exit)."""
        self.redis.delete(keys.role_alive(self.run_id, role, index))

    def record_restart(self, role: str, index: int) -> int:
        """Count one launcher restart of the role; returns the new total."""
        self.incr("role_restarts")
        return int(self.redis.hincrby(keys.role_record(self.run_id, role, index), "restarts", 1))

    def publish_endpoint(self, role: str, index: int, name: str, address: str) -> None:
        """Advertise a bound socket so peers can connect to it."""
        key = keys.role_record(self.run_id, role, index)
        endpoints = json.loads(self.redis.hget(key, "endpoints") or "{}")
        endpoints[name] = address
        self.redis.hset(key, "endpoints", json.dumps(endpoints))

    def endpoints(self, role: str, name: str) -> list[str]:
        """Addresses of endpoint ``name`` of every live instance of ``role``, by index.

        Live: heartbeat not expired and status ``starting`` or ``running`` (a stopping role's
        endpoints are about to close; peers must not start new work with it).
        """
        found = []
        for rec in self.roles():
            serving = rec.alive and rec.status in ("starting", "running")
            if rec.role == role and serving and name in rec.endpoints:
                found.append((rec.index, rec.endpoints[name]))
        return [address for _, address in sorted(found)]

    def roles(self) -> list[RoleRecord]:
        """Every role instance registered in the run, sorted by role and index."""
        ids = sorted(self.redis.smembers(keys.roles_index(self.run_id)))
        records = []
        now = time.time()
        for rid in ids:
            role, _, index = rid.partition("/")
            try:
                rec = self._record(role, int(index), now)
            except (ValueError, TypeError, OverflowError) as err:
                # not a record any role writes: every role that scans its peers would fail on
                # it, again after each restart; left out, and said once
                if rid not in self._said_unreadable:
                    self._said_unreadable.add(rid)
                    _log.warning("left out the unreadable registry record %r: %s", rid[:80], err)
                continue
            if rec is not None:
                records.append(rec)
        return sorted(records, key=lambda r: (r.role, r.index))

    def _record(self, role: str, index: int, now: float) -> RoleRecord | None:
        pipe = self.redis.pipeline()
        pipe.hgetall(keys.role_record(self.run_id, role, index))
        pipe.exists(keys.role_alive(self.run_id, role, index))
        pipe.hgetall(keys.role_stats(self.run_id, role, index))
        raw, alive, stats = pipe.execute()
        if not raw:
            return None
        return role_record(role, index, raw, alive=bool(alive), stats=stats, now=now)

    # --- counters -----------------------------------------------------------------------------
    def incr(self, name: str, amount: int = 1) -> int:
        """Add to a run-wide counter; returns the new value."""
        return int(self.redis.hincrby(keys.counters(self.run_id), name, amount))

    def flush(
        self,
        amounts: dict[str, int],
        ledger_highs: dict[str, int] | None = None,
        ledger_adds: dict[str, int] | None = None,
        *,
        flusher: str,
        number: int,
    ) -> bool:
        """Add ``amounts`` to the counters, raise the ledger's ``ledger_highs`` marks and add
        ``ledger_adds`` to its other fields in one atomic step (a role killed at any moment
        leaves all of a flush or none). ``flusher`` (one per role process) numbers its flushes:
        a retry whose first try landed unanswered is skipped (``rlvla3/runtime/flush_once.py``).
        Returns whether this call applied it."""
        return flush_once(
            self.redis,
            self.run_id,
            marker=keys.counter_flush(self.run_id, flusher, guarded=self.writes_guarded),
            number=number,
            amounts=amounts,
            ledger_highs=ledger_highs or {},
            ledger_adds=ledger_adds or {},
        )

    def chunk_ledger(self) -> dict[str, int]:
        """The chunk ledger's fields, both writers' (``rlvla3/runtime/ledger_store.py``)."""
        return read_ledger(self.redis, self.run_id)

    def counters(self) -> dict[str, int]:
        """All run-wide counters."""
        return {k: int(v) for k, v in self.redis.hgetall(keys.counters(self.run_id)).items()}

    def chunk_backlog(self) -> int:
        """Chunks pushed (or resent) by env workers that no trainer has received yet (nor
        written off as lost); what the env workers' back-pressure (``max_chunks_queued``)
        bounds."""
        c = self.counters()
        sent = c.get("chunks_produced", 0) + c.get("chunks_resent", 0)
        taken = c.get("chunks_received", 0) + c.get("chunks_duplicate", 0)
        return sent - taken - c.get("chunks_written_off", 0)

    # --- weights, config, stop requests, curves -------------------------------------------------
    def set_weight_version(self, version: int) -> None:
        """Record the newest broadcast weight version and when it was published."""
        self.redis.hset(keys.weights(self.run_id), mapping={"version": version, "at": time.time()})

    def weight_version(self) -> int:
        """The newest published weight version, -1 before the first."""
        value = self.redis.hget(keys.weights(self.run_id), "version")
        return -1 if value is None else int(value)

    def set_trained_version(self, version: int) -> None:
        """Record the newest version a trainer has handed to the broadcaster (before it is sent:
        the broadcaster accepts no version above this, so a forged one cannot jump ahead)."""
        self.redis.hset(keys.weights(self.run_id), "trained", version)

    def trained_version(self) -> int:
        """The newest version a trainer has produced, -1 before the first."""
        value = self.redis.hget(keys.weights(self.run_id), "trained")
        return -1 if value is None else int(value)

    def save_config(self, text: str) -> None:
        """Store the resolved config YAML."""
        self.redis.set(keys.config(self.run_id), text)

    def mark_launch(self, launch_id: str) -> None:
        """The head launcher started the run now, as launch ``launch_id`` (other nodes wait for
        this, and tell this launch's files in a run dir from an earlier one's by the id)."""
        self.redis.hset(keys.launch(self.run_id), mapping={"at": time.time(), "id": launch_id})

    def launched_since(self, since: float) -> bool:
        """Whether the head launcher marked a launch at or after unix time ``since``."""
        value = self.redis.hget(keys.launch(self.run_id), "at")
        return value is not None and float(value) >= since

    def launch_id(self) -> str | None:
        """The id of the head's launch mark, None before there is one."""
        return self.redis.hget(keys.launch(self.run_id), "id")

    # --- launchers (one per node) -----------------------------------------------------------------
    def launcher_heartbeat(
        self, node: str, *, ttl_s: float, status: str, address: str, hostname: str, pid: int
    ) -> None:
        """Record a node's launcher and refresh its TTL key."""
        pipe = self.redis.pipeline()
        pipe.sadd(keys.launchers_index(self.run_id), node)
        pipe.hset(
            keys.launcher_record(self.run_id, node),
            mapping={
                "status": status,
                "address": address,
                "hostname": hostname,
                "pid": pid,
                "heartbeat_at": time.time(),
            },
        )
        pipe.set(keys.launcher_alive(self.run_id, node), 1, px=int(ttl_s * 1000))
        pipe.execute()

    def launchers(self) -> list[LauncherRecord]:
        """Every node's launcher that joined the run, by node name."""
        records = []
        now = time.time()
        for node in sorted(self.redis.smembers(keys.launchers_index(self.run_id))):
            pipe = self.redis.pipeline()
            pipe.hgetall(keys.launcher_record(self.run_id, node))
            pipe.exists(keys.launcher_alive(self.run_id, node))
            raw, alive = pipe.execute()
            if raw:
                records.append(launcher_record(node, raw, alive=bool(alive), now=now))
        return records

    def end_run(self, reason: str, code: int) -> None:
        """The head launcher ends the run: every node stops its roles and exits with ``code``."""
        self.redis.hset(keys.run_end(self.run_id), mapping={"reason": reason, "code": code})
        self.request_stop(reason)

    def run_end(self) -> tuple[str, int] | None:
        """``(reason, exit code)`` once the head has ended the run, else None."""
        raw = self.redis.hgetall(keys.run_end(self.run_id))
        return (raw.get("reason", ""), int(raw.get("code", 1))) if raw else None

    def request_stop(self, reason: str) -> None:
        """Ask the launcher to end the run (first reason wins)."""
        self.redis.set(keys.stop_request(self.run_id), reason, nx=True)

    def stop_reason(self) -> str | None:
        """Why a stop was requested, or None."""
        return self.redis.get(keys.stop_request(self.run_id))

    def start_evaluation(self, version: int) -> None:
        """Freeze training: from now on, episodes acted on only by ``version`` are the evaluation."""
        self.redis.hset(
            keys.evaluation(self.run_id), mapping={"version": version, "started_at": time.time()}
        )

    def evaluation_version(self) -> int | None:
        """The weight version under evaluation, or None while training goes on."""
        value = self.redis.hget(keys.evaluation(self.run_id), "version")
        return None if value is None else int(value)

    def begin_eval_round(self, version: int) -> int:
        """Periodic evaluation: the eval rollout server now serves ``version``; returns the new
        round's number (the eval env worker drops any round it was playing)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hincrby(keys.eval_round(self.run_id), "round", 1)
        pipe.hset(keys.eval_round(self.run_id), "version", version)
        return int(pipe.execute()[0])

    def finish_eval_round(self, round_: int) -> None:
        """Periodic evaluation: every episode of ``round_`` is recorded."""
        self.redis.hset(keys.eval_round(self.run_id), "done", round_)

    def eval_round(self) -> tuple[int, int, int]:
        """``(round, version, done)`` of periodic evaluation; ``(0, -1, 0)`` before the first."""
        raw = self.redis.hgetall(keys.eval_round(self.run_id))
        return int(raw.get("round", 0)), int(raw.get("version", -1)), int(raw.get("done", 0))

    def append(self, series: str, points: Iterable[dict[str, Any]]) -> None:
        """Append JSON points to ``metrics``, ``episodes`` or ``evaluations`` (kept to the newest
        200,000)."""
        key = _SERIES[series](self.run_id)
        encoded = [json.dumps(p) for p in points]
        if encoded:
            pipe = self.redis.pipeline()
            pipe.rpush(key, *encoded)
            pipe.ltrim(key, -_MAX_LIST_POINTS, -1)
            pipe.execute()

    def series(self, series: str, last: int = 0) -> list[dict[str, Any]]:
        """The newest ``last`` points (all when 0) of ``metrics``, ``episodes`` or
        ``evaluations``."""
        key = _SERIES[series](self.run_id)
        return [json.loads(p) for p in self.redis.lrange(key, -last if last else 0, -1)]

    def live_members(self) -> list[str]:
        """The roles (``role/index``) and node launchers (``launcher NODE``) of this run whose
        heartbeats are fresh and that have not ended."""
        ended = ("done", "error")
        live = [f"{r.role}/{r.index}" for r in self.roles() if r.alive and r.status not in ended]
        live += [
            f"launcher {rec.node}"
            for rec in self.launchers()
            if rec.alive and rec.status not in ended
        ]
        return live

    def refuse_if_live(self) -> None:
        """Raise ``RunInUse`` when the run has live roles or launchers."""
        live = self.live_members()
        if live:
            shown = ", ".join(live[:5]) + (f" and {len(live) - 5} more" if len(live) > 5 else "")
            raise RunInUse(
                f"run {self.run_id!r} is live on {self.url} ({shown} heartbeating); stop it, "
                "or give this run another run.name"
            )

    def clear_run(self, *, refuse_live: bool = False) -> None:
        """Delete every key of this run (a fresh start under the same run id).

        Raises:
            RunInUse: ``refuse_live`` and the run has live roles or launchers (another launch
                of the same ``run.name`` on a shared Redis).
        """
        if refuse_live:
            self.refuse_if_live()
        for prefix in (keys.run_prefix(self.run_id), keys.guarded_prefix(self.run_id)):
            batch = list(self.redis.scan_iter(match=f"{prefix}:*", count=1000))
            if batch:
                self.redis.delete(*batch)

    def close(self) -> None:
        """Close the connection pool."""
        self.redis.close()


_SERIES = {"metrics": keys.metrics, "episodes": keys.episodes, "evaluations": keys.evaluations}
