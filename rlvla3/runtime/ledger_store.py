"""Where the chunk ledger (``rlvla3/runtime/chunk_ledger.py``) lives in Redis: two hashes, by
writer. Env workers' ``pushed`` marks go in ``keys.chunk_pushed``, which their Redis user may
write; every other field (the trainers') in ``keys.chunk_ledger``, a guarded key they may only
read (``rlvla3/runtime/redis_auth.py``). A read takes each hash's own fields only."""

from __future__ import annotations

import redis

from rlvla3.runtime import keys
from rlvla3.runtime.chunk_ledger import is_pushed_field, ledger_fields


def ledger_key(run_id: str, field: str) -> str:
    """The hash ``field`` lives in."""
    return keys.chunk_pushed(run_id) if is_pushed_field(field) else keys.chunk_ledger(run_id)


def by_key(run_id: str, fields: dict[str, int]) -> dict[str, dict[str, int]]:
    """``fields`` grouped by the hash each lives in (one HSET per hash)."""
    grouped: dict[str, dict[str, int]] = {}
    for name, value in fields.items():
        grouped.setdefault(ledger_key(run_id, name), {})[name] = value
    return grouped


def read_ledger(client: redis.Redis, run_id: str) -> dict[str, int]:
    """Both hashes at one moment (one transaction), each with its own fields only: env
    workers write ``chunk_pushed``, so a settled mark or a buffer there is not the trainers'
    (nor a value that is no number)."""
    with client.pipeline() as pipe:
        pipe.hgetall(keys.chunk_pushed(run_id))
        pipe.hgetall(keys.chunk_ledger(run_id))
        pushed, trainers = pipe.execute()
    return ledger_fields(pushed, env_side=True) | ledger_fields(trainers, env_side=False)
