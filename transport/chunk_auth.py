"""Chunk tags: which env worker made a trajectory chunk, checked by the trainer.

CURVE (``transport/security.py``) admits every peer that holds the run's client key, so it says
that a chunk came from the run, not from whom. The chunk accounting trusts a chunk's
``producer`` and numbers (``rlvla3/runtime/chunk_acks.py``): a chunk sent under a genuine
producer's name with a far higher ``chunk_id`` and ``resend_from`` would lift that producer's
settled mark past chunks still to come, and the trainer would drop those as duplicates.

So in a multi-host run each env worker tags its chunks with its own key, derived from the
run's chunk check key and its index (``producer_key``), and the trainer, which holds the check
key, derives the key of the chunk's ``worker_index`` and refuses a chunk whose tag does not
match, or whose ``producer`` (and GRPO ``group``) is not that worker's (``worker/...``).
An env worker holds only its own key (``rlvla3/runtime/role_keys.py``): it can tag chunks as
itself, which it could fill with anything anyway, but as no other worker.

The tag covers the chunk's names and numbers (``tagged_header``), not its steps: what the
accounting trusts, at a cost that does not grow with the chunk (on the 2-core CPU machine
about 4 µs to tag and 6 µs to check). A peer cannot take a genuine tag off another worker's
chunk on the wire: CURVE encrypts every connection. A role that receives genuine chunks (a
trainer; or a peer that published itself as one in the run's Redis) could send their names
again with other steps: the same numbers of the same producer, so each but the first
received is a duplicate.

A one-host run has no keys (its peers are the host's own processes, trusted on every socket):
its env workers tag nothing and its trainers check nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from transport.derived_keys import derive
from transport.messages import TrajectoryChunk

TAG_BYTES = 32
_LABEL = b"rlvla3 chunk tags"


def chunk_check_key(secret: str) -> bytes:
    """The run's chunk check key (the trainers'): HMAC-SHA256 of the secret under its label."""
    return derive(secret, _LABEL)


def producer_key(check_key: bytes, worker_index: int) -> bytes:
    """The key env worker ``worker_index`` tags its chunks with: nothing about the check key
    or another worker's key can be read back from it."""
    return hmac.new(check_key, f"env_worker {worker_index}".encode(), hashlib.sha256).digest()


def tagged_header(
    *,
    worker_index: int,
    env_index: int,
    producer: str,
    group: str,
    chunk_id: int,
    resend_from: int,
) -> bytes:
    """What a tag covers: the chunk's names and numbers, one unambiguous encoding (JSON)."""
    fields = [worker_index, env_index, producer, group, chunk_id, resend_from]
    return json.dumps(fields, separators=(",", ":")).encode()


def chunk_tag(key: bytes, header: bytes) -> bytes:
    """HMAC-SHA256 of ``header`` under a producer's key."""
    return hmac.new(key, header, hashlib.sha256).digest()


def header_of(chunk: TrajectoryChunk) -> bytes:
    """``tagged_header`` of a received chunk."""
    return tagged_header(
        worker_index=chunk.worker_index,
        env_index=chunk.env_index,
        producer=chunk.producer,
        group=chunk.group,
        chunk_id=chunk.chunk_id,
        resend_from=chunk.resend_from,
    )


class ChunkTagCheck:
    """The trainer's check of every chunk's tag (a multi-host run's).

    Args:
        check_key: the run's chunk check key (``chunk_check_key``).
    """

    def __init__(self, check_key: bytes) -> None:
        if not check_key:
            raise ValueError("check_key: empty (a one-host run checks no tags: no ChunkTagCheck)")
        self._check_key = check_key

    def problem(self, chunk: TrajectoryChunk) -> str | None:
        """Why ``chunk`` is not attributable to the producer it names (None: it is). Not cached
        per worker: ``worker_index`` is the sender's to choose, and an HMAC costs microseconds."""
        if len(chunk.tag) != TAG_BYTES:
            return f"tag: {len(chunk.tag)} bytes, expected {TAG_BYTES} (every chunk of this run is tagged)"
        key = producer_key(self._check_key, chunk.worker_index)
        if not hmac.compare_digest(chunk_tag(key, header_of(chunk)), chunk.tag):
            return f"tag: not the key of env worker {chunk.worker_index}, which the chunk claims"
        # tagged by that worker: the names it gave must be its own
        own = f"{chunk.worker_index}/"
        for field in ("producer", "group"):
            name = getattr(chunk, field)
            if name and not name.startswith(own):
                return f"{field}: {name!r:.40} is not env worker {chunk.worker_index}'s"
        return None
