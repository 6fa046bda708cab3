"""A node's run dir before its roles start: an earlier run's dir moved aside, ``logs/``, the run
secret, the resolved ``config.yaml`` the roles load, this node's ``nodes/NODE.json``, and, on a
node whose run dir is not the head's, the head's ``run.json``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rlvla3.config import redis_url
from rlvla3.config.run_config import Config, dump_config
from rlvla3.launch.cluster import Seat
from rlvla3.launch.rendezvous import Joined, read_run_info, write_node_info, write_run_info
from rlvla3.runtime import run_secret


def move_aside(run_dir: Path) -> str:
    """Rename an earlier run's dir out of the way (nothing is deleted); says where to."""
    moved = run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(moved)
    return f"moved the earlier run in {run_dir} to {moved}"


def config_path(run_dir: Path) -> Path:
    """The resolved config every role process of the run loads."""
    return run_dir / "config.yaml"


def write_config(run_dir: Path, cfg: Config) -> Config:
    """The config as given, launchable again (the Redis URL goes to ``run.json``); a
    ``run.redis_url``'s password goes to ``RUN_DIR/redis_password`` (mode 0600) and shows as
    ``***``. Returns the config as written (what may be shown or stored elsewhere)."""
    url = cfg.run.redis_url
    password = redis_url.password_of(url) if url else None
    if url and password is not None and password != redis_url.REDACTED:
        run_secret.write_private(run_dir / run_secret.REDIS_PASSWORD_FILE, password)
        cfg = replace(cfg, run=replace(cfg.run, redis_url=redis_url.redacted(url)))
    config_path(run_dir).write_text(dump_config(cfg))
    return cfg


def prepare_run_dir(run_dir: Path, seat: Seat, address: str, secret: str | None) -> None:
    """``logs/``, the run secret (rewritten when missing or another) and this node's
    ``nodes/NODE.json`` in a multi-node run."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if secret is not None and _stored_secret(run_dir) != secret:
        run_secret.write(run_dir, secret)
    if seat.node is not None:
        write_node_info(run_dir, seat, address)


def claim_member_run_dir(
    run_dir: Path,
    cfg: Config,
    seat: Seat,
    joined: Joined,
    echo: Callable[[str], None],
    resume: bool = False,
) -> None:
    """A member node's run dir: the head's own when shared (its ``run.json`` names this launch);
    else this node's, where an earlier run's files are moved aside first, as the head does, so
    that roles and the monitor never read an old run's Redis address; with ``resume`` they stay
    (a trainer rank placed here resumes from its checkpoints) and only ``run.json`` and the
    config are rewritten."""
    info = read_run_info(run_dir)
    if info is not None and info.get("launch_id") == joined.launch_id:
        return
    if info is not None and not resume:
        echo(f"node {seat.label}: {move_aside(run_dir)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_info(run_dir, cfg, seat, joined.store, joined.launch_id, os.getpid())
    write_config(run_dir, cfg)


def _stored_secret(run_dir: Path) -> str | None:
    """The secret in the run dir, None when missing or unusable (it is then rewritten)."""
    try:
        return run_secret.read(run_dir)
    except run_secret.SecretError:
        return None
