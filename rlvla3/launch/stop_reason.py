"""Why a node's launcher ended its run: a kind the code branches on, and the text people read.

The text is what the launcher prints (``run NAME ended: TEXT``), what ``summary.json`` holds as
``stop_reason`` and what the head hands the other nodes (``Registry.end_run``); the code reads
only the kind, so a reworded text changes no behaviour.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class StopKind(enum.Enum):
    """What ended the run."""

    STOP_REQUESTED = "stop_requested"
    """``rlvla3 stop``, or a role or another node asked the run to stop (``Registry.request_stop``)."""
    MAX_WALL_S = "max_wall_s"
    """``run.stop.max_wall_s`` reached."""
    MAX_ENV_STEPS = "max_env_steps"
    """``run.stop.max_env_steps`` reached."""
    TARGET_REACHED = "target_reached"
    """A target of ``run.stop`` reached: the run is solved."""
    JOB_DONE = "job_done"
    """The job a command launched the run for is done (``rlvla3 eval``: every episode played)."""
    ROLES_FINISHED = "roles_finished"
    """Every role process of this launcher exited cleanly."""
    ROLE_FAILED = "role_failed"
    """A role process ran out of restarts."""
    SIGNAL = "signal"
    """Ctrl-C or SIGTERM."""
    REDIS_LOST = "redis_lost"
    """The run's Redis stayed out of reach for ``run.head_timeout_s``."""
    HEAD_ENDED = "head_ended"
    """(Another node) the head node ended the run."""
    HEAD_LOST = "head_lost"
    """(Another node) the head node stayed out of reach for ``run.head_timeout_s``."""
    LAUNCHER_FAILED = "launcher_failed"
    """The launcher itself raised an error."""


# The launcher's exit code per kind; a kind not named here is a clean end (0).
_EXIT_CODES = {
    StopKind.SIGNAL: 130,
    StopKind.ROLE_FAILED: 1,
    StopKind.REDIS_LOST: 1,
    StopKind.HEAD_LOST: 1,
    StopKind.LAUNCHER_FAILED: 1,
}


@dataclass(frozen=True, slots=True)
class StopReason:
    """Why the run ended."""

    kind: StopKind
    """What ended it (what the code decides by)."""
    text: str
    """What people read, e.g. ``solved: mean return 195.3 over 100 episodes``."""
    head_exit_code: int = 0
    """For ``HEAD_ENDED``: the exit code the head ended the run with (other nodes exit with it)."""

    @property
    def solved(self) -> bool:
        """The run reached a target of ``run.stop``."""
        return self.kind is StopKind.TARGET_REACHED

    @property
    def exit_code(self) -> int:
        """The launcher's exit code for this end: 0 clean, 1 failed, 130 stopped by a signal."""
        if self.kind is StopKind.HEAD_ENDED:
            return self.head_exit_code
        return _EXIT_CODES.get(self.kind, 0)

    def noted(self, note: str) -> StopReason:
        """The same reason, its text followed by ``; note``."""
        return dataclasses.replace(self, text=f"{self.text}; {note}")

    def __str__(self) -> str:
        return self.text


STOPPED_BY_SIGNAL = StopReason(StopKind.SIGNAL, "stopped by signal")
ROLES_FINISHED = StopReason(StopKind.ROLES_FINISHED, "all roles finished")
LAUNCHER_FAILED = StopReason(StopKind.LAUNCHER_FAILED, "launcher failed")
