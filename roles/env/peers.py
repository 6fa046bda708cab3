"""The addresses an env worker's runners send to, shared between its threads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Peers:
    """The live peers of one env worker. Its main loop replaces the lists as peers restart on
    new ports; runner threads read them before each send (a list swap is atomic)."""

    servers: list[str]
    """Request endpoints of the rollout servers that act for the envs."""
    trainers: list[str]
    """Chunk endpoints of the trainers (none when the worker does not train)."""
