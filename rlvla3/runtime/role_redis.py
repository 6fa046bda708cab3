"""Which Redis a role process talks to, and with which password: the run's own (its URL in the
run dir's ``run.json``, the role's Redis credentials from its keys where it wants AUTH),
or a configured
``run.redis_url`` (its password in the run dir's ``redis_password`` where ``config.yaml``
shows ``***``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from rlvla3.config import redis_url
from rlvla3.config.run_config import Config
from rlvla3.runtime import run_secret
from rlvla3.runtime.redis_auth import RedisAuth
from rlvla3.runtime.role_keys import RoleKeys


def run_redis(
    cfg: Config, run_dir: Path, keys: RoleKeys | None
) -> tuple[Config, RedisAuth | str | None]:
    """``cfg`` with the Redis URL roles use, and that Redis's credentials (None: none).

    Raises:
        MissingKeyError: the run's Redis wants the run user's credentials, and ``keys`` (the
            role's) hold none.
    """
    if cfg.run.redis_url is None:  # an embedded Redis: its URL is in run.json, not the config
        cfg, wants_auth = _with_run_redis(cfg, run_dir / "run.json")
        return cfg, keys.redis_auth() if wants_auth and keys is not None else None
    return cfg, _configured_password(cfg, run_dir)


def _configured_password(cfg: Config, run_dir: Path) -> str | None:
    """The password of a configured ``run.redis_url`` that ``config.yaml`` shows as ``***``:
    the run dir's ``redis_password`` (None: the URL carries its own, or none)."""
    url = cfg.run.redis_url
    if url is None or redis_url.password_of(url) != redis_url.REDACTED:
        return None
    return run_secret.redis_password(run_dir)


def _with_run_redis(cfg: Config, run_json: Path) -> tuple[Config, bool]:
    """``cfg`` with the Redis URL the launcher recorded in ``run.json`` (if it did), and whether
    that Redis wants the run user's credentials (AUTH)."""
    try:
        info = json.loads(run_json.read_text())
    except (OSError, ValueError):
        return cfg, False
    url = info.get("redis_url")
    if not url:
        return cfg, False
    return replace(cfg, run=replace(cfg.run, redis_url=url)), bool(info.get("redis_auth"))
