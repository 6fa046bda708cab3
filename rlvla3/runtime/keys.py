"""Every Redis key the project uses, built in one place: ``rlvla3:{run_id}:...``, and
``rlvla3-guarded:{run_id}:...`` for those env workers may only read.

Roles, the launcher and the monitor never spell a key themselves; they call these functions, so
the key layout can be read (and changed) here alone.
"""

from __future__ import annotations

PREFIX = "rlvla3"
GUARDED_PREFIX = "rlvla3-guarded"
"""Prefix of the keys a multi-host run's env workers may read but not write (their Redis user's
ACL, ``rlvla3/runtime/redis_auth.py``): the trainers' side of the chunk ledger, the chunks
handed back, the weight versions, the learning curve, and what launchers write of the run.
Its own prefix, not a name under ``rlvla3:``, because an ACL key pattern cannot leave names
out."""


def guarded_prefix(run_id: str) -> str:
    """``rlvla3-guarded:{run_id}``: the run's guarded keys (``GUARDED_PREFIX``)."""
    return f"{GUARDED_PREFIX}:{run_id}"


def run_prefix(run_id: str) -> str:
    """Common prefix of all keys of one run (used to clear a run's state)."""
    _check(run_id, "run_id")
    return f"{PREFIX}:{run_id}"


def role_id(role: str, index: int) -> str:
    """The id of one role instance, e.g. ``env_worker/0``."""
    _check(role, "role")
    return f"{role}/{index}"


def roles_index(run_id: str) -> str:
    """Set of the role ids ever registered in the run."""
    return f"{run_prefix(run_id)}:roles"


def role_record(run_id: str, role: str, index: int) -> str:
    """Hash: role, index, node, host, pid, status, endpoints (JSON), restarts, heartbeat_at."""
    return f"{run_prefix(run_id)}:role:{role_id(role, index)}"


def role_alive(run_id: str, role: str, index: int) -> str:
    """String with a TTL; present while the role's heartbeat is fresh."""
    return f"{run_prefix(run_id)}:alive:{role_id(role, index)}"


def role_stats(run_id: str, role: str, index: int) -> str:
    """Hash of the role's own gauges and counters (rates, queue depths, batch fill...)."""
    return f"{run_prefix(run_id)}:stats:{role_id(role, index)}"


def counters(run_id: str) -> str:
    """Hash of run-wide counters (env_steps, chunks_produced, chunks_consumed, bad_frames...)."""
    return f"{run_prefix(run_id)}:counters"


def chunk_pushed(run_id: str) -> str:
    """Hash of the env workers' side of the chunk ledger (``rlvla3/runtime/chunk_ledger.py``):
    the highest sequence number each producer pushed."""
    return f"{run_prefix(run_id)}:chunk_pushed"


def chunk_ledger(run_id: str) -> str:
    """Hash of the trainers' side of the chunk accounting that survives crashes
    (``rlvla3/runtime/chunk_ledger.py``): the highest sequence number each trainer received
    from each producer, each producer's settled mark, and what each trainer holds in its
    buffer."""
    return f"{guarded_prefix(run_id)}:chunk_ledger"


def handed_back_chunks(run_id: str) -> str:
    """Set of ``producer chunk_id``: the chunks a failed trainer left unsettled for its
    successor (``ChunkAccounting.hand_back``); a chunk handed back a second time is settled
    instead."""
    return f"{guarded_prefix(run_id)}:handed_back_chunks"


def counter_flush(run_id: str, flusher: str, *, guarded: bool) -> str:
    """String: the number of the last counter flush applied for ``flusher`` (one role process),
    so that a flush sent again after its reply was lost is not applied twice. ``guarded``:
    the flusher may write the guarded keys (all but env workers): its marker is guarded too,
    so that no env worker can mark its flushes applied and have them skipped."""
    prefix = guarded_prefix(run_id) if guarded else run_prefix(run_id)
    return f"{prefix}:counter_flush:{flusher}"


def weights(run_id: str) -> str:
    """Hash: ``version`` and ``at`` (unix seconds) of the newest broadcast weights, and
    ``trained``, the newest version a trainer produced."""
    return f"{guarded_prefix(run_id)}:weights"


def config(run_id: str) -> str:
    """String: the resolved run config as YAML."""
    return f"{guarded_prefix(run_id)}:config"


def launch(run_id: str) -> str:
    """Hash: ``at`` (unix time) and ``id`` (a fresh id) of the head launcher's (re)start of the
    run."""
    return f"{guarded_prefix(run_id)}:launch"


def launchers_index(run_id: str) -> str:
    """Set of the node names whose launchers joined the run."""
    return f"{guarded_prefix(run_id)}:launchers"


def launcher_record(run_id: str, node: str) -> str:
    """Hash: one node's launcher: ``status``, ``pid``, ``address``, ``hostname``, ``heartbeat_at``."""
    _check(node, "node")
    return f"{guarded_prefix(run_id)}:launcher:{node}"


def launcher_alive(run_id: str, node: str) -> str:
    """String with a TTL; present while the node's launcher heartbeats."""
    _check(node, "node")
    return f"{guarded_prefix(run_id)}:launcher_alive:{node}"


def run_end(run_id: str) -> str:
    """Hash: ``reason`` and exit ``code`` of a run the head launcher has ended."""
    return f"{guarded_prefix(run_id)}:end"


def stop_request(run_id: str) -> str:
    """String: set (with a reason) by any role that wants the whole run to end."""
    return f"{guarded_prefix(run_id)}:stop"


def evaluation(run_id: str) -> str:
    """Hash: ``version`` (int) the end-of-run evaluation measures, and ``started_at``."""
    return f"{guarded_prefix(run_id)}:eval"


def eval_round(run_id: str) -> str:
    """Hash of periodic evaluation: ``round`` (int, raised by the eval rollout server when it
    takes new weights), ``version`` (those weights') and ``done`` (the newest round the eval env
    worker finished)."""
    return f"{run_prefix(run_id)}:eval_round"


def evaluations(run_id: str) -> str:
    """List of JSON periodic evaluation results (version, success rate, mean return; bounded)."""
    return f"{run_prefix(run_id)}:evaluations"


def eval_todo(run_id: str) -> str:
    """List of JSON protocol episodes not yet taken by an eval env worker (``rlvla3 eval``)."""
    return f"{run_prefix(run_id)}:eval_todo"


def eval_claimants(run_id: str) -> str:
    """Set of ``WORKER@PID`` (``eval_env_worker/0@4242``): every eval env worker process that
    has taken protocol episodes, each with its own ``eval_claimed`` list."""
    return f"{run_prefix(run_id)}:eval_claimants"


def eval_claimed(run_id: str, claimant: str) -> str:
    """List of the JSON protocol episodes eval env worker process ``claimant`` plays now."""
    return f"{run_prefix(run_id)}:eval_claimed:{claimant}"


def eval_attempts(run_id: str) -> str:
    """Hash: queued JSON protocol episode -> how many of its players died playing it."""
    return f"{run_prefix(run_id)}:eval_attempts"


def eval_results(run_id: str) -> str:
    """List of JSON results of finished protocol episodes, in the order they finished."""
    return f"{run_prefix(run_id)}:eval_results"


def metrics(run_id: str) -> str:
    """List of JSON learning-curve points pushed by the trainer (bounded)."""
    return f"{guarded_prefix(run_id)}:metrics"


def episodes(run_id: str) -> str:
    """List of JSON episode results (return, length, success) pushed by env workers (bounded)."""
    return f"{run_prefix(run_id)}:episodes"


def _check(part: str, what: str) -> None:
    if not part or ":" in part or "/" in part or any(c.isspace() for c in part):
        raise ValueError(f"{what} {part!r}: must be non-empty without ':', '/' or spaces")
