"""A protocol evaluation's episodes in the run's Redis (``rlvla3 eval``): the ones still to
play, the ones being played and by whom, and the results, so any number of eval env workers
(on any node) share one episode list and each episode is played once.

A worker takes an episode and claims it in one transaction, and finishes it (result pushed,
claim dropped) in another. An episode whose worker died while playing it is put back by
``requeue_orphans`` (called by the launcher): the episode is replayed from its start, which
changes nothing in its outcome.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from rlvla3.runtime import keys
from rlvla3.runtime.registry import Registry

# Pop the next episode and claim it in one step, so a worker that dies in between loses none.
# The claim keeps the episode's JSON as it was queued (a string), to be queued again as is.
_TAKE = """
local raw = redis.call('LPOP', KEYS[1])
if not raw then return false end
local ok, episode = pcall(cjson.decode, raw)
local key = raw
if ok and type(episode) == 'table' and type(episode.key) == 'string' then key = episode.key end
local claim = cjson.encode({episode = raw, worker = ARGV[1], pid = tonumber(ARGV[2])})
redis.call('HSET', KEYS[2], key, claim)
return raw
"""


class EvalQueue:
    """The episode list of one run's protocol evaluation (episodes and results as plain data)."""

    def __init__(self, registry: Registry) -> None:
        self.redis = registry.redis
        run_id = registry.run_id
        self._todo = keys.eval_todo(run_id)
        self._claims = keys.eval_claims(run_id)
        self._results = keys.eval_results(run_id)
        self._take = self.redis.register_script(_TAKE)

    # --- the launcher's side ----------------------------------------------------------------------
    def fill(self, episodes: Iterable[dict[str, Any]]) -> None:
        """Queue ``episodes`` (in this order) for the workers, replacing any earlier list."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self._todo, self._claims, self._results)
        items = [json.dumps(e) for e in episodes]
        if items:
            pipe.rpush(self._todo, *items)
        pipe.execute()

    def results(self, start: int) -> list[dict[str, Any]]:
        """The results finished since the first ``start`` ones."""
        return [json.loads(r) for r in self.redis.lrange(self._results, start, -1)]

    def pending(self) -> tuple[int, int]:
        """How many episodes wait to be taken, and how many are being played."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.llen(self._todo)
        pipe.hlen(self._claims)
        waiting, playing = pipe.execute()
        return int(waiting), int(playing)

    def requeue_orphans(self, alive: Callable[[str, int], bool]) -> int:
        """Put back (first in line) every episode claimed by a worker that ``alive(worker,
        pid)`` says is gone; returns how many."""
        requeued = 0
        for key, raw in self.redis.hgetall(self._claims).items():
            claim = json.loads(raw)
            if alive(claim["worker"], claim["pid"]):
                continue
            if self.redis.hdel(self._claims, key):  # (0: it finished meanwhile)
                self.redis.lpush(self._todo, claim["episode"])
                requeued += 1
        return requeued

    # --- a worker's side --------------------------------------------------------------------------
    def take(self, worker: str, pid: int) -> Any | None:
        """The next episode to play (as plain data), claimed for ``worker`` (process ``pid``) in
        the same atomic step; None when none is left."""
        raw = self._take(keys=[self._todo, self._claims], args=[worker, pid])
        return None if raw is None else json.loads(raw)

    def finish(self, key: str, result: dict[str, Any]) -> None:
        """Record episode ``key``'s result and drop its claim, together."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.rpush(self._results, json.dumps(result))
        pipe.hdel(self._claims, key)
        pipe.execute()

    def drop(self, key: str) -> None:
        """Give up episode ``key`` for good (it could not be read): its claim goes."""
        self.redis.hdel(self._claims, key)
