"""A protocol evaluation's episodes in the run's Redis (``rlvla3 eval``): the ones still to
play, the ones being played and by whom, and the results, so any number of eval env workers
(on any node) share one episode list and each episode is played once.

A worker process takes an episode by moving it (``LMOVE``, atomic) from the list still to play
to its own claimed list, so a worker that dies at any point loses none; it finishes it (result
pushed, claim removed) in one transaction. ``requeue_orphans`` (called by the launcher) puts
the claims of dead worker processes back first in line: the episode is replayed from its
start, which changes nothing in its outcome. An episode whose players died ``max_attempts``
times (one that crashes its simulator every time) is given up instead, for the launcher to
record as failed, so one such episode cannot use up the workers' restarts. Only plain list,
set and hash commands: the run user's ACL (``redis_auth.RUN_USER_COMMANDS``) allows no Lua.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rlvla3.runtime import keys
from rlvla3.runtime.registry import Registry

MAX_ATTEMPTS = 3
"""Plays of an episode whose player died each time before it is given up."""


@dataclass(frozen=True, slots=True)
class Claim:
    """An episode a worker process took."""

    raw: str
    """The queued JSON text, as it was queued (unchecked: it came over the network)."""
    claimant: str
    """The worker process that took it, ``WORKER@PID``."""

    def data(self) -> Any:
        """The queued plain data.

        Raises:
            ValueError: not JSON.
        """
        return json.loads(self.raw)


class EvalQueue:
    """The episode list of one run's protocol evaluation (episodes and results as plain data)."""

    def __init__(self, registry: Registry) -> None:
        self.redis = registry.redis
        self.run_id = registry.run_id
        self._todo = keys.eval_todo(self.run_id)
        self._claimants = keys.eval_claimants(self.run_id)
        self._attempts = keys.eval_attempts(self.run_id)
        self._results = keys.eval_results(self.run_id)

    # --- the launcher's side ----------------------------------------------------------------------
    def fill(self, episodes: Iterable[dict[str, Any]]) -> None:
        """Queue ``episodes`` (in this order) for the workers, replacing any earlier list."""
        claimed = [self._claimed(c) for c in self._members()]
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self._todo, self._claimants, self._attempts, self._results, *claimed)
        items = [json.dumps(e) for e in episodes]
        if items:
            pipe.rpush(self._todo, *items)
        pipe.execute()

    def results(self, start: int) -> list[dict[str, Any]]:
        """The results finished since the first ``start`` ones; a record that is not a JSON
        object (a broken or hostile writer's) is one without a key, which no episode takes."""
        return [_record(r) for r in self.redis.lrange(self._results, start, -1)]

    def pending(self) -> tuple[int, int]:
        """How many episodes wait to be taken, and how many are being played."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.llen(self._todo)
        for claimant in self._members():
            pipe.llen(self._claimed(claimant))
        waiting, *playing = pipe.execute()
        return int(waiting), sum(int(n) for n in playing)

    def requeue_orphans(
        self, alive: Callable[[str, int], bool], max_attempts: int = MAX_ATTEMPTS
    ) -> list[str]:
        """Put back (first in line) every episode claimed by a worker process that
        ``alive(worker, pid)`` says is gone, unless its players have died ``max_attempts``
        times: those are taken off the list and returned (their queued JSON)."""
        given_up: list[str] = []
        for claimant in self._members():
            worker, _, pid = claimant.rpartition("@")
            if alive(worker, int(pid) if pid.isdigit() else -1):
                continue
            claimed = self._claimed(claimant)
            for raw in self.redis.lrange(claimed, 0, -1):
                if not self.redis.lrem(claimed, 1, raw):
                    continue  # (it finished meanwhile)
                if self.redis.hincrby(self._attempts, raw, 1) >= max_attempts:
                    given_up.append(raw)
                else:
                    self.redis.lpush(self._todo, raw)
            self.redis.srem(self._claimants, claimant)
        return given_up

    # --- a worker's side --------------------------------------------------------------------------
    def take(self, worker: str, pid: int) -> Claim | None:
        """The next episode to play, claimed for ``worker`` (process ``pid``) in the same atomic
        step; None when none is left."""
        claimant = f"{worker}@{pid}"
        pipe = self.redis.pipeline(transaction=True)
        pipe.sadd(self._claimants, claimant)
        pipe.lmove(self._todo, self._claimed(claimant), "LEFT", "RIGHT")
        raw = pipe.execute()[1]
        return None if raw is None else Claim(raw, claimant)

    def finish(self, claim: Claim, result: dict[str, Any]) -> None:
        """Record the result of ``claim`` and drop the claim, together."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.rpush(self._results, json.dumps(result))
        pipe.lrem(self._claimed(claim.claimant), 1, claim.raw)
        pipe.execute()

    def drop(self, claim: Claim) -> None:
        """Give up ``claim`` for good (it could not be read)."""
        self.redis.lrem(self._claimed(claim.claimant), 1, claim.raw)

    def _claimed(self, claimant: str) -> str:
        return keys.eval_claimed(self.run_id, claimant)

    def _members(self) -> list[str]:
        return sorted(self.redis.smembers(self._claimants))


def _record(raw: Any) -> dict[str, Any]:
    try:
        record = json.loads(raw)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}
