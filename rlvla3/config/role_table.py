"""The role table: every kind of role process a run can have, and what the rest of rlvla3
knows about it (the module a process runs, its settings, when it stops, what the monitor shows).

A role's name is its key under ``roles:`` in the launch YAML, the name of its Redis records and
of its log files. Everything that is keyed by role name reads this table, so adding a role means
adding one row here (and its module under ``roles/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from rlvla3.config.role_settings import (
    EnvWorkerSettings,
    RolloutServerSettings,
    SftTrainerSettings,
    TrainerSettings,
    WeightBroadcasterSettings,
)

SettingsT = TypeVar("SettingsT")


class RunKey(StrEnum):
    """A key derived from the run secret that the launcher may hand a role of a multi-host
    run (``rlvla3/runtime/role_keys.py``); a role gets the ones its row names, never the
    secret itself."""

    REDIS = "redis"
    """The run user's password on the run's Redis (with the Redis certificate, which is public)."""
    REDIS_ENV = "redis_env"
    """The env user's password on the run's Redis (``rlvla3/runtime/redis_auth.py``): it may
    read every key and write all but the guarded ones (the trainers' side of the chunk ledger,
    the weight versions...)."""
    CURVE_CLIENT = "curve_client"
    """The CURVE client secret key: connect to the run's ZeroMQ sockets."""
    CURVE_SERVER = "curve_server"
    """The CURVE server secret key: bind ZeroMQ sockets that the run's peers connect to."""
    WEIGHTS = "weights"
    """The weights key: sign weight versions and check their tags (HMAC: a key that checks
    can sign, so only roles that take weights in hold it)."""
    CHUNK_CHECK = "chunk_check"
    """The chunk check key: check every env worker's chunk tags (``transport/chunk_auth.py``;
    each worker's key derives from it, so it could tag as any of them)."""
    CHUNK_SIGN = "chunk_sign"
    """An env worker's own chunk-tag key (derived from the check key and its index): it tags
    its chunks as itself and as no other worker."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RoleSpec(Generic[SettingsT]):
    """One kind of role process."""

    name: str
    """Its key under ``roles:``, its Redis records' and log files' name (``env_worker``)."""
    module: str
    """The module a process of this role runs with ``python -m`` (a string: ``roles/`` is a
    higher layer than ``rlvla3/``)."""
    settings: type[SettingsT]
    """The dataclass of its ``roles.<name>.settings``."""
    stop_stage: int
    """When the launcher stops it, lower first: producers stop before their consumers, so every
    queue is drained by its consumer before the consumer stops."""
    evaluation: bool = False
    """One of the roles of periodic evaluation (``run.eval``), which a run has one of each of
    while evaluation is on and none of otherwise."""
    headline_rate: tuple[str, str] | None = None
    """The counter whose rate per second the monitor shows as the role's headline figure, and
    its unit (None: the role has none)."""
    keys: frozenset[RunKey] = frozenset()
    """The keys its processes are handed in a multi-host run: only what its code uses."""


_SERVED = ("requests_served", "req/s")
_EVAL_ENV_KEYS = frozenset({RunKey.REDIS_ENV, RunKey.CURVE_CLIENT})
"""Evaluation env workers connect to rollout servers, bind nothing, take no weights and send
no chunks; on the run's Redis they are the env user."""
_ENV_KEYS = _EVAL_ENV_KEYS | {RunKey.CHUNK_SIGN}
"""Env workers also send chunks to the trainers, tagged with their own key."""
_SERVING_KEYS = frozenset({RunKey.REDIS, RunKey.CURVE_SERVER, RunKey.WEIGHTS})
"""Rollout servers and the broadcaster bind sockets, connect to none (weight links are
torch's), and check the tags of the weights they take."""
_TRAINER_KEYS = frozenset(RunKey) - {RunKey.CHUNK_SIGN, RunKey.REDIS_ENV}
"""The trainer binds its chunk socket and checks every chunk's tag, connects to the
broadcaster, signs the versions it publishes and checks the broadcaster's copy when it
restarts."""
_SFT_KEYS = frozenset({RunKey.REDIS, RunKey.CURVE_CLIENT, RunKey.WEIGHTS})
"""The SFT trainer is the trainer less the chunk socket: it binds nothing."""

# name, settings, stop stage, evaluation role, headline rate, keys: one row per role
_ROWS = (
    ("eval_env_worker", EnvWorkerSettings, 0, True, ("eval_env_steps", "steps/s"), _EVAL_ENV_KEYS),
    ("env_worker", EnvWorkerSettings, 1, False, ("env_steps", "steps/s"), _ENV_KEYS),
    ("eval_rollout_server", RolloutServerSettings, 2, True, _SERVED, _SERVING_KEYS),
    ("rollout_server", RolloutServerSettings, 3, False, _SERVED, _SERVING_KEYS),
    ("trainer", TrainerSettings, 4, False, ("samples_consumed", "samples/s"), _TRAINER_KEYS),
    ("sft_trainer", SftTrainerSettings, 5, False, ("sft_samples", "samples/s"), _SFT_KEYS),
    ("weight_broadcaster", WeightBroadcasterSettings, 6, False, None, _SERVING_KEYS),
)
ROLES: tuple[RoleSpec, ...] = tuple(
    RoleSpec(
        name=name,
        module=f"roles.{name}",
        settings=settings,
        stop_stage=stop_stage,
        evaluation=evaluation,
        headline_rate=rate,
        keys=keys,
    )
    for name, settings, stop_stage, evaluation, rate, keys in _ROWS
)
"""Every role, in the order the launcher stops them."""

ROLE_TABLE: dict[str, RoleSpec] = {spec.name: spec for spec in ROLES}
"""Role name -> its row."""

STOP_ORDER: tuple[str, ...] = tuple(s.name for s in sorted(ROLES, key=lambda s: s.stop_stage))
"""Role names in the order the launcher stops them."""

EVAL_ROLES: tuple[str, ...] = tuple(s.name for s in ROLES if s.evaluation)
"""The roles of periodic evaluation (``run.eval``): one of each."""


def role_spec(name: str) -> RoleSpec:
    """The row of role ``name``.

    Raises:
        KeyError: no role is called ``name`` (the message lists the known roles).
    """
    try:
        return ROLE_TABLE[name]
    except KeyError:
        raise KeyError(f"{name!r}: unknown role (known roles: {known_roles()})") from None


def known_roles() -> str:
    """Every role name, sorted and comma-separated (for error messages)."""
    return ", ".join(sorted(ROLE_TABLE))
