"""Pin a role process to the CPUs its ``roles.<role>.cpus`` setting names."""

from __future__ import annotations

import os

from rlvla3.config.typed_load import ConfigError


def pin_to_cpus(cpus: list[int] | None, field: str = "cpus") -> None:
    """Restrict this process (and the threads it starts later) to ``cpus``; None: no change.

    Raises:
        ConfigError: a CPU id this node does not have (names ``field`` and the usable CPUs).
    """
    if cpus is None:
        return
    available = sorted(os.sched_getaffinity(0))
    missing = [c for c in cpus if c not in available]
    if missing:
        raise ConfigError(f"{field}: this node has no CPU {missing} (usable: {available})")
    os.sched_setaffinity(0, cpus)
