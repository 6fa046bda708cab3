"""Typed per-role settings (``roles.<name>.settings`` in the YAML), one dataclass per role.

They live here, not in the role modules, so the launcher can validate a whole YAML without
importing torch or any role code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoSourceSettings:
    """Bus demo: pushes small messages at a fixed rate until stopped."""

    rate_hz: float = 200.0
    payload_elements: int = 16
    queue_hwm: int = 100


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoSinkSettings:
    """Bus demo: pulls the source's messages and counts them."""

    queue_hwm: int = 100


ROLE_SETTINGS: dict[str, type] = {
    "demo_source": DemoSourceSettings,
    "demo_sink": DemoSinkSettings,
}
