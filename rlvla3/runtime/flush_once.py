"""Applying one counter flush to Redis at most once (``Registry.flush``).

A flush is a role's counter increments and chunk-ledger changes since its last one, applied in
one MULTI/EXEC transaction: all of it or none. Not once only, though: when the connection dies
after Redis applied the transaction and before its reply came back, redis-py sends it again
(its default retry), or the role keeps the increments and sends them with its next flush, and
they count twice (the chunk balance then shows chunks received that were never produced).

So each flusher (one role process) numbers its flushes, and the transaction also sets the
flusher's own key to the flush's number. A flush first WATCHes that key and reads it: a number
not below its own means it was applied already. A reply lost while watching surfaces as a
``WatchError`` (redis-py does not resend a watched transaction), and the flush reads the key
again. WATCH and not a Lua script: the run's Redis user may not EVAL
(``rlvla3/runtime/redis_auth.py``).
"""

from __future__ import annotations

import redis

from rlvla3.runtime import keys
from rlvla3.runtime.ledger_store import by_key, ledger_key

_ATTEMPTS = 3
"""Watched tries before giving up (only this process writes the key it watches, so a watch
breaks only when a connection died mid-flush)."""


def flush_once(
    client: redis.Redis,
    run_id: str,
    *,
    marker: str,
    number: int,
    amounts: dict[str, int],
    ledger_highs: dict[str, int],
    ledger_adds: dict[str, int],
) -> bool:
    """Apply flush ``number`` of the flusher whose key is ``marker`` (``keys.counter_flush``)
    unless it was already; returns whether this call applied it. Raises redis' errors when
    Redis cannot be reached (the caller keeps the flush and sends it again under the same
    number)."""
    with client.pipeline(transaction=True) as pipe:
        for attempt in range(_ATTEMPTS):
            try:
                pipe.watch(marker)
                applied = pipe.get(marker)
                if applied is not None and int(applied) >= number:
                    return False
                pipe.multi()
                for name, amount in amounts.items():
                    if amount:
                        pipe.hincrby(keys.counters(run_id), name, amount)
                for key, highs in by_key(run_id, ledger_highs).items():
                    pipe.hset(key, mapping=highs)
                for name, amount in ledger_adds.items():
                    if amount:
                        pipe.hincrby(ledger_key(run_id, name), name, amount)
                pipe.set(marker, number)
                pipe.execute()
                return True
            except redis.WatchError:
                if attempt == _ATTEMPTS - 1:
                    raise
    raise AssertionError("unreachable")
