"""The per-run secret of a multi-node run: the seed of its Redis password and TLS key, its CURVE
keys and its weights key (``transport/derived_keys.py``).

Made by the head node's launcher (or by ``launch/slurm.sbatch``, which hands it to every node's
launcher in the ``RLVLA3_RUN_SECRET`` environment variable, which the launcher takes out of its
``os.environ`` at start: ``take``), kept in ``RUN_DIR/secret`` with mode 0600 so that
``rlvla3 monitor`` on any node can join, and never logged. Roles never hold it: a launcher
hands each role it starts only the keys derived for that role (``rlvla3/runtime/role_keys.py``)
through a pipe (``hand_over``; the role's ``--secret-fd``), never the environment, so that
neither the role's ``/proc/PID/environ`` nor the processes it starts (a simulator's) carry
them. One-host runs on loopback have none: nothing of theirs listens beyond loopback and a
unix socket.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

SECRET_ENV = "RLVLA3_RUN_SECRET"
SECRET_FILE = "secret"
REDIS_PASSWORD_FILE = "redis_password"
"""The run dir's copy (mode 0600) of a configured ``run.redis_url``'s password, which
``config.yaml`` and ``run.json`` show as ``***``."""
_MIN_LEN = 16
_PIPE_MIN_BUFFER = 4096  # Linux's pipe capacity when a user is over pipe-user-pages-soft


class SecretError(RuntimeError):
    """A run secret that is unusable, or readable by others."""


def new_secret() -> str:
    """A fresh secret (256 random bits, hex)."""
    return secrets.token_hex(32)


_taken: str | None = None  # what ``take`` handed this process, for its later ``from_env`` calls


def from_env() -> str | None:
    """The secret handed over in ``RLVLA3_RUN_SECRET`` (or taken by ``take``), if any."""
    value = os.environ.get(SECRET_ENV)
    if value is None:
        return _taken
    return _checked(value.strip(), SECRET_ENV)


def hand_over(text: str) -> int:
    """A pipe holding ``text`` (a role's key bundle, a few KB at most); returns its read end,
    for a child's ``pass_fds`` (close it here once the child started). That is below a pipe's
    smallest buffer (4 KiB; 64 KiB by default): the write never blocks, and the child reads
    it whenever it starts."""
    data = text.encode()
    if len(data) > _PIPE_MIN_BUFFER:
        raise ValueError(f"{len(data)} bytes do not fit a pipe's buffer for sure")
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, data)
    finally:
        os.close(write_fd)
    return read_fd


def read_pipe(fd: int) -> str:
    """What ``hand_over`` put in the pipe ``fd``; the pipe is closed."""
    with os.fdopen(fd, "rb") as pipe:
        return pipe.read().decode(errors="replace")


def take() -> str | None:
    """A launcher's secret: ``RLVLA3_RUN_SECRET``, which then leaves ``os.environ`` so that
    processes this one starts do not inherit it, and is kept for this process's later
    ``from_env`` calls. (The kernel's ``/proc/PID/environ`` keeps showing the environment a
    process started with: only a pipe keeps a secret out of it.)"""
    global _taken
    value = pop_env()
    _taken = value or _taken
    return _taken


def pop_env() -> str | None:
    """``RLVLA3_RUN_SECRET``, taken out of ``os.environ`` (not kept: a role derives its keys
    from it and forgets it)."""
    value = from_env() if SECRET_ENV in os.environ else None
    os.environ.pop(SECRET_ENV, None)
    return value


def write(run_dir: Path, secret: str) -> Path:
    """Store ``secret`` in ``RUN_DIR/secret`` (mode 0600, replaced atomically)."""
    return write_private(run_dir / SECRET_FILE, secret)


def read(run_dir: Path) -> str | None:
    """The secret in ``RUN_DIR/secret`` (None when there is none).

    Raises:
        SecretError: the file is readable by group or others, or not a usable secret.
    """
    path = run_dir / SECRET_FILE
    text = read_private(path)
    return None if text is None else _checked(text, str(path))


def redis_password(run_dir: Path) -> str | None:
    """The password of the run's configured ``run.redis_url`` (None: it has none).

    Raises:
        SecretError: the file is readable by group or others.
    """
    return read_private(run_dir / REDIS_PASSWORD_FILE)


def write_private(path: Path, text: str) -> Path:
    """Store ``text`` in ``path`` with mode 0600 (replaced atomically)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a left-over file would keep its own, maybe wider, mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text + "\n")
    os.replace(tmp, path)
    return path


def read_private(path: Path) -> str | None:
    """The text of a file ``write_private`` wrote (None when there is none).

    Raises:
        SecretError: the file is readable by group or others.
    """
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except FileNotFoundError:
        return None
    if mode & 0o077:
        raise SecretError(f"{path}: readable by others (mode {mode & 0o777:o}); chmod 600 {path}")
    return text.strip()


def load(run_dir: Path) -> str | None:
    """The run's secret: ``RLVLA3_RUN_SECRET`` first, else ``RUN_DIR/secret``."""
    return from_env() or read(run_dir)


def _checked(value: str, where: str) -> str:
    if len(value) < _MIN_LEN or not value.isprintable() or any(c.isspace() for c in value):
        raise SecretError(
            f"{where}: a run secret must be at least {_MIN_LEN} printable characters without spaces"
        )
    return value
