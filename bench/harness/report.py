"""What a benchmark prints and the flags it reads: fixed-width tables, key=value progress lines,
the host's load around a measurement, and the ``--json`` / ``--smoke`` flags every script has.

The JSON itself goes through ``provenance.write_result``; this module is the text beside it.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def benchmark_parser(doc: str, smoke_help: str) -> argparse.ArgumentParser:
    """A parser whose help is ``doc`` as written, with ``--json PATH`` (where the results go;
    nothing is written without it) and ``--smoke`` (a few seconds of every case, for CI)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    return parser


def add_straggler_flags(
    parser: argparse.ArgumentParser, *, latency_mean_ms: float, duration_s: float
) -> None:
    """The flags of a straggler workload: ``--num-envs`` envs over ``--num-workers`` processes,
    each step taking a lognormal extra latency (``--latency-mean-ms``, ``--latency-sigma``),
    measured for ``--duration-s``; the defaults given are the script's own."""
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--latency-mean-ms", type=float, default=latency_mean_ms)
    parser.add_argument("--latency-sigma", type=float, default=1.0)
    parser.add_argument("--duration-s", type=float, default=duration_s)


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a printed table."""

    header: str
    """Its title, in the header line."""
    width: int = 0
    """Characters the title and each value are padded to (longer ones are not cut)."""
    spec: str = ""
    """Format spec of its values without alignment and width, e.g. ``".1f"`` or ``",.0f"``;
    empty for values given as text."""
    align: str = ">"
    """``>`` (numbers) or ``<`` (names)."""
    header_align: str | None = None
    """Alignment of the title where it differs from the values'."""

    def title(self) -> str:
        """The title, padded."""
        return f"{self.header:{self.header_align or self.align}{self.width}}"

    def cell(self, value: Any) -> str:
        """``value`` formatted and padded (a bool or None as its word: a number spec would
        print a bool as 0 or 1)."""
        if isinstance(value, bool) or value is None:
            value = str(value)
        return f"{value:{self.align}{self.width}{self.spec}}"


_SPEC = re.compile(r"(?P<align>[<>^]?)(?P<width>\d*)(?P<rest>.*)")


@dataclass(frozen=True, slots=True)
class Table:
    """A fixed-width table: a header line, then one line per row, cells one space apart."""

    columns: tuple[Column, ...]
    """Its columns, left to right."""

    @classmethod
    def from_layout(cls, layout: str) -> Table:
        """The table of ``layout``: columns ``TITLE:SPEC`` separated by `` | ``, SPEC a format
        spec with the alignment and width of title and values (``>`` where none is given), e.g.
        ``"case:<26 | env steps/s:>12,.0f | dropped:>8.1%"``."""
        columns = []
        for item in layout.split(" | "):
            title, _, spec = item.rpartition(":")
            m = _SPEC.fullmatch(spec)
            assert m is not None  # (every string matches)
            width = int(m["width"]) if m["width"] else 0
            columns.append(Column(title, width, m["rest"], m["align"] or ">"))
        return cls(tuple(columns))

    def header(self) -> str:
        """The line of titles (no trailing blanks)."""
        return " ".join(c.title() for c in self.columns).rstrip()

    def row(self, *values: Any) -> str:
        """The line of one row: a value per column (no trailing blanks)."""
        return " ".join(c.cell(v) for c, v in zip(self.columns, values, strict=True)).rstrip()

    def print(self, rows: Iterable[Sequence[Any]]) -> None:
        """Print the header and ``rows``."""
        print(self.header())
        for values in rows:
            print(self.row(*values))


def point_line(point: Mapping[str, Any]) -> str:
    """A learning curve's point as ``key=value`` pairs (floats to 3 decimals)."""
    return " ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items()
    )


def load_average_1m() -> float:
    """The host's 1-minute load average now."""
    return os.getloadavg()[0]


def host_record(load_before: float) -> dict[str, Any]:
    """The host beside a measurement: CPU count and the 1-minute load average before (as read
    with ``load_average_1m``) and now. On a shared host, others' load shows in every figure."""
    return {
        "cpus": os.cpu_count(),
        "load_avg_1m_before": load_before,
        "load_avg_1m_after": load_average_1m(),
    }


def host_line(host: Mapping[str, Any]) -> str:
    """``host_record``'s figures as one line."""
    return (
        f"host: {host['cpus']} CPUs, 1-min load average {host['load_avg_1m_before']:.1f} "
        f"before, {host['load_avg_1m_after']:.1f} after"
    )
