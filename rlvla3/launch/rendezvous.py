"""How the launchers of one run meet: the head starts the run's Redis, the others find it.

- One host: a private redis-server on a unix socket, no password (``run.redis_url`` overrides).
- Multi-host head: a private redis-server on the head's node address, its port from
  ``run.redis_port`` or the Slurm job, TLS only, with the run user's password and ACL
  (``rlvla3/runtime/redis_auth.py``; both derived from the run secret).
- Multi-host other nodes: wait (``run.join_timeout_s``) until the head's Redis answers and the
  head has marked the launch. Where: ``run.redis_url``; else the head's address (its
  configured host, or its Slurm host) and the known port; else ``run.json`` in the shared run
  dir. The secret: ``RLVLA3_RUN_SECRET``, else ``RUN_DIR/secret``. A node sends its password
  only after the TLS handshake proved the server holds the run's certificate key.

``run.json`` in the run dir says how to reach the run's Redis (never the password), for roles
and ``rlvla3 monitor``: ``run_id``, ``redis_url``, ``redis_auth`` (it wants the run user's
credentials, derived from the run secret), ``launch_id`` (the head's launch it belongs to), ``head`` (the head node's name,
null on one host), ``node`` and ``launcher_pid`` (the node and launcher that wrote it: the head,
or a node with a run dir of its own), ``started_at``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from rlvla3.config import redis_url
from rlvla3.config.run_config import Config
from rlvla3.launch.cluster import Seat, head_address, redis_port
from rlvla3.launch.redis_server import EmbeddedRedis, url_host
from rlvla3.runtime import run_secret
from rlvla3.runtime.redis_auth import RedisAuth, env_password, run_password, run_redis_auth
from rlvla3.runtime.redis_tls import redis_tls_identity
from rlvla3.runtime.registry import Registry

_RETRY_S = 0.5
_HEAD_GRACE_S = 300.0  # on a shared Redis, a head launch mark younger than this is this run's


class JoinError(RuntimeError):
    """A node could not join the run (no head found within ``run.join_timeout_s``)."""


@dataclass(frozen=True, slots=True)
class Joined:
    """What a node learns when it joins a run: the store, the secret and the launch's id."""

    store: RunStore
    secret: str
    launch_id: str


@dataclass(frozen=True, slots=True)
class RunStore:
    """Where the run's Redis is.

    Attributes:
        url: its URL, its password (if any) shown as ``***``.
        password: the run user's credentials when the Redis is the run's private multi-host
            one (``run_redis_auth``), a configured ``run.redis_url``'s password, else None.
    """

    url: str
    password: RedisAuth | str | None
    server: EmbeddedRedis | None = field(default=None, compare=False)
    """The run's own redis-server when this node started it (the head), else None."""

    def registry(self, run_id: str) -> Registry:
        """A registry client of this store for ``run_id``."""
        return Registry(self.url, run_id, self.password)


def configured_store(url: str) -> RunStore:
    """The store of a configured ``run.redis_url``: its password kept apart, so that what
    shows the store's URL (``run.json``, messages) shows ``***``."""
    return RunStore(redis_url.redacted(url), redis_url.password_of(url))


@contextlib.contextmanager
def head_store(
    cfg: Config, seat: Seat, address: str, secret: str | None, data_dir: Path
) -> Iterator[RunStore]:
    """The run's Redis, started here (unless ``run.redis_url`` names one) and stopped at exit;
    it keeps its append-only file in ``data_dir``."""
    if cfg.run.redis_url is not None:
        yield configured_store(cfg.run.redis_url)
        return
    durable = {"data_dir": data_dir, "appendfsync": cfg.run.redis_appendfsync}
    if not seat.multi_host:
        with EmbeddedRedis(**durable) as server:
            yield RunStore(server.url, None, server)
        return
    if secret is None:
        raise ValueError("a multi-host run's Redis needs the run secret")
    with EmbeddedRedis(
        host=address,
        port=redis_port(cfg, seat),
        password=run_password(secret),
        env_password=env_password(secret),
        tls=redis_tls_identity(secret),  # across hosts TLS only (the module doc)
        **durable,
    ) as server:
        yield RunStore(server.url, run_redis_auth(secret), server)


def find_head_store(
    cfg: Config,
    seat: Seat,
    run_dir: Path,
    stop: threading.Event,
    echo: Callable[[str], None],
) -> Joined:
    """Wait for the head's Redis and launch mark.

    Raises:
        JoinError: nothing answered within ``run.join_timeout_s`` (says what was tried).
        InterruptedError: ``stop`` was set while waiting.
    """
    deadline = time.monotonic() + cfg.run.join_timeout_s
    since = time.time() - _HEAD_GRACE_S
    head = head_address(seat)
    echo(
        f"node {seat.label}: waiting for head node {seat.head.name!r} "
        f"({head or 'address from the run dir'}) to start run {cfg.run.name!r}"
    )
    last_problem = "nothing tried yet"
    while True:
        try:
            secret = run_secret.load(run_dir)
        except run_secret.SecretError as err:
            raise JoinError(f"node {seat.label}: {err}") from None
        for store in _candidates(cfg, seat, run_dir, head, secret):
            registry = store.registry(cfg.run.name)
            try:
                private = cfg.run.redis_url is None
                if registry.launched_since(0 if private else since):
                    if secret is None:
                        raise JoinError(
                            f"node {seat.label}: found the head's Redis but no "
                            f"run secret ({run_secret.SECRET_ENV} or "
                            f"{run_dir / run_secret.SECRET_FILE})"
                        )
                    return Joined(store, secret, registry.launch_id() or "")
                last_problem = f"{store.url} answers, but the head has not started the run yet"
            except redis.AuthenticationError:
                last_problem = f"{store.url} refused the run secret (an older run's secret?)"
            except (redis.RedisError, OSError) as err:  # not up yet, or not a Redis at all
                last_problem = f"{store.url}: {err}"
            finally:
                registry.close()
        if secret is None:
            last_problem = (
                f"no run secret yet ({run_secret.SECRET_ENV}, or "
                f"{run_dir / run_secret.SECRET_FILE} from the head)"
            )
        if time.monotonic() > deadline:
            raise JoinError(
                f"node {seat.label}: head node {seat.head.name!r} not reached within "
                f"run.join_timeout_s={cfg.run.join_timeout_s:g}s ({last_problem})"
            )
        if stop.wait(_RETRY_S):
            raise InterruptedError("stopped while waiting for the head node")


def _candidates(
    cfg: Config, seat: Seat, run_dir: Path, head: str | None, secret: str | None
) -> list[RunStore]:
    """Where the head's Redis may be, most direct first: ``run.redis_url``; the head's address
    and the known port; the address in a shared run dir's ``run.json``."""
    if cfg.run.redis_url is not None:
        return [configured_store(cfg.run.redis_url)]
    stores = []
    auth = None if secret is None else run_redis_auth(secret)
    port = redis_port(cfg, seat)
    if head is not None and port:
        stores.append(RunStore(f"rediss://{url_host(head)}:{port}/0", auth))
    info = read_run_info(run_dir)
    if info is not None and info.get("redis_url") and info.get("run_id") == cfg.run.name:
        stores.append(RunStore(info["redis_url"], auth if info.get("redis_auth") else None))
    return stores


def write_run_info(
    run_dir: Path,
    cfg: Config,
    seat: Seat,
    store: RunStore,
    launch_id: str,
    launcher_pid: int | None = None,
) -> None:
    """``RUN_DIR/run.json``: how to reach the run's Redis (the same on every node)."""
    info = {
        "run_id": cfg.run.name,
        "redis_url": store.url,
        "redis_auth": store.password is not None,
        "launch_id": launch_id,
        "head": seat.head.name if seat.multi_host else None,
        "node": seat.node.name if seat.node is not None else None,
        "launcher_pid": launcher_pid,
        "started_at": time.time(),
    }
    _write_atomic(run_dir / "run.json", json.dumps(info, indent=2) + "\n")


def read_run_info(run_dir: Path) -> dict | None:
    """The run dir's ``run.json``, None when missing or unreadable."""
    try:
        info = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def write_node_info(run_dir: Path, seat: Seat, address: str) -> None:
    """``RUN_DIR/nodes/NODE.json``: this node's launcher (address, host name, pid)."""
    (run_dir / "nodes").mkdir(exist_ok=True)
    info = {
        "node": seat.label,
        "address": address,
        "hostname": socket.gethostname(),
        "launcher_pid": os.getpid(),
        "started_at": time.time(),
    }
    _write_atomic(run_dir / "nodes" / f"{seat.label}.json", json.dumps(info, indent=2) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
