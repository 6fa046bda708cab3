"""Chunk accounting that stays exact when processes die.

Every trajectory chunk carries its producer (``worker/env#incarnation``, unique per process
start) and a sequence number (``chunk_id``, from 0 per producer). Env workers record the highest
number they pushed, each trainer the highest it received from each producer and how many chunks
wait in its buffer; each role flushes these together with its counters in one Redis
transaction (``Registry.flush``), so a role killed at any moment leaves all of a flush or none.

From that ledger:

- **produced**: per producer, one more than the highest number anybody recorded. A chunk pushed
  by a worker that died before recording it is still known from the trainer's side, and a
  number below the highest that no trainer received is a chunk lost on the way. Chunks the
  trainer refused by its checks are produced by their producer's record where it has one (an
  env worker's ``pushed``), else each by itself: those whose producer could not go into the
  ledger or whose tag is not their env worker's (``bad_chunks_unattributed``) and those of a producer no env worker recorded (a
  forged one's, counted per producer in ``refused|PRODUCER``; its numbers are not trusted).
- **received**: ``chunks_received`` less ``chunks_returned``: a killed trainer's buffer goes
  back to its producers (they resend what it held, ``rlvla3/runtime/chunk_acks.py``), so its
  chunks count as received again only when a trainer takes them a second time. A resent chunk
  a trainer already settled is a duplicate (``chunks_duplicate``), never received twice.
- **lost**: produced minus received (chunks that died in a socket queue, with a lost node or
  in a killed trainer's buffer, and that their producer could not resend: it died, or its
  full resend buffer had let them go), plus ``chunks_lost_in_trainer`` (a killed
  trainer's buffer when env workers keep no resend buffer, ``resend_buffer_chunks`` 0).
- **balance**: produced = consumed + dropped + in flight at exit + buffered + lost.

Chunks a worker made but neither recorded nor delivered before it died are unknowable, like the
env steps in them (its ``env_steps`` died unflushed too): the run never saw them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

_PUSHED = "pushed|"
_RECEIVED = "received|"
_BUFFERED = "buffered|"
_SETTLED = "settled|"
_REFUSED = "refused|"
TRAINER_STARTS = "trainer_starts"
"""The ledger field counting trainer process starts: env workers resend what is not settled
when it grows (``rlvla3/runtime/chunk_acks.py``)."""


def pushed_field(producer: str) -> str:
    """The ledger field of the highest sequence number ``producer`` pushed."""
    return f"{_PUSHED}{producer}"


def is_pushed_field(field: str) -> bool:
    """Whether ``field`` is an env worker's (``pushed_field``): kept under its own key
    (``keys.chunk_pushed``), which env workers may write, apart from the trainers' side
    (``keys.chunk_ledger``), which they may only read."""
    return field.startswith(_PUSHED)


def ledger_fields(raw: dict[str, str], *, env_side: bool) -> dict[str, int]:
    """One side's hash as read from Redis, less what is not that side's: the env workers'
    (``env_side``) holds only ``pushed`` marks, the trainers' everything else. A field of the
    other side, or a value that is no integer, is left out: env workers may write their hash
    (``rlvla3/runtime/redis_auth.py``), so what is in it is not the trainers' word."""
    fields: dict[str, int] = {}
    for name, value in raw.items():
        if is_pushed_field(name) != env_side:
            continue
        try:
            fields[name] = int(value)
        except ValueError:
            continue
    return fields


def received_field(producer: str, trainer: str) -> str:
    """The ledger field of the highest sequence number ``trainer`` received from ``producer``."""
    return f"{_RECEIVED}{producer}|{trainer}"


def buffered_field(trainer: str) -> str:
    """The ledger field counting the chunks in ``trainer``'s buffer."""
    return f"{_BUFFERED}{trainer}"


def refused_field(producer: str) -> str:
    """The ledger field counting the chunks of ``producer`` the trainers refused."""
    return f"{_REFUSED}{producer}"


def settled_field(producer: str) -> str:
    """The ledger field of ``producer``'s settled mark: every chunk numbered below it is trained
    on or dropped (``rlvla3/runtime/chunk_acks.py``)."""
    return f"{_SETTLED}{producer}"


def settled_marks(ledger: dict[str, int]) -> dict[str, int]:
    """Every producer's settled mark in ``ledger``."""
    return {f[len(_SETTLED) :]: v for f, v in ledger.items() if f.startswith(_SETTLED)}


@dataclass(frozen=True, slots=True)
class Balance:
    """Where every chunk the run produced went (see the module doc).

    Attributes:
        produced: chunks produced, from the sequence numbers.
        received: chunks trainers took off their queues (each once: see the module doc).
        consumed: chunks trained on.
        dropped: chunks dropped (too stale, or refused by the chunk checks).
        in_flight_at_exit: chunks queued or buffered when a trainer stopped.
        buffered: chunks in live trainers' buffers now.
        lost_in_transit: produced but never received.
        lost_in_trainer: received by a trainer that was killed before training on them, with
            no resend buffer to deliver them again.
        duplicates: resent chunks a trainer had already settled, dropped (not in the balance).
    """

    produced: int
    received: int
    consumed: int
    dropped: int
    in_flight_at_exit: int
    buffered: int
    lost_in_transit: int
    lost_in_trainer: int
    duplicates: int = 0

    @property
    def lost(self) -> int:
        """Chunks lost, in transit or in a killed trainer."""
        return self.lost_in_transit + self.lost_in_trainer

    @property
    def balanced(self) -> bool:
        """produced = consumed + dropped + in flight at exit + buffered + lost."""
        settled = self.consumed + self.dropped + self.in_flight_at_exit + self.buffered
        return self.lost_in_transit >= 0 and self.produced == settled + self.lost

    def as_dict(self) -> dict[str, Any]:
        """The figures, ``lost`` and ``balanced`` included (for ``summary.json``)."""
        return {**asdict(self), "lost": self.lost, "balanced": self.balanced}


def balance(ledger: dict[str, int], counters: dict[str, int]) -> Balance:
    """The run's chunk balance from its ledger (``Registry.chunk_ledger``) and counters."""
    highest: dict[str, int] = {}
    pushers: set[str] = set()
    refused: dict[str, int] = {}
    buffered = 0
    for field, value in ledger.items():
        if field.startswith(_PUSHED):
            producer = field[len(_PUSHED) :]
            pushers.add(producer)
        elif field.startswith(_RECEIVED):
            producer = field[len(_RECEIVED) :].rpartition("|")[0]
        else:
            if field.startswith(_BUFFERED):
                buffered += value
            elif field.startswith(_REFUSED):
                refused[field[len(_REFUSED) :]] = value
            continue
        highest[producer] = max(highest.get(producer, -1), value)
    unrecorded = sum(n for producer, n in refused.items() if producer not in pushers)
    unattributed = counters.get("bad_chunks_unattributed", 0)
    produced = sum(high + 1 for high in highest.values()) + unattributed + unrecorded
    received = counters.get("chunks_received", 0) - counters.get("chunks_returned", 0)
    return Balance(
        produced=produced,
        received=received,
        consumed=counters.get("chunks_consumed", 0),
        dropped=counters.get("chunks_dropped", 0),
        in_flight_at_exit=counters.get("chunks_in_flight_at_exit", 0),
        buffered=buffered,
        lost_in_transit=produced - received,
        lost_in_trainer=counters.get("chunks_lost_in_trainer", 0),
        duplicates=counters.get("chunks_duplicate", 0),
    )
