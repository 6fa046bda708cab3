"""What a launcher started by Slurm (``srun``, one task per node) learns from its environment.

Slurm tells each task its job id, the job's hosts (a compressed host list such as
``gpu[01-02],cpu[1-4]``) and the task's node id within them; ``launch/slurm.sbatch`` starts one
launcher per node this way, and each finds its node of the YAML from its node id.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
# The Redis port of a Slurm run is derived from its job id, below Linux's ephemeral ports, so
# every node knows it without asking and two jobs on one head host rarely collide.
_PORT_BASE, _PORT_SPAN = 15000, 10000


class HostListError(ValueError):
    """A Slurm host list that cannot be expanded."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmStep:
    """The Slurm job step this process runs in.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        node_id: this task's node within ``hosts`` (``SLURM_NODEID``).
        hosts: the step's host names, in Slurm's order.
        launch_address: address of the host that ran ``srun`` (the batch host), if Slurm gave it.
    """

    job_id: int
    node_id: int
    hosts: tuple[str, ...]
    launch_address: str | None

    @staticmethod
    def from_env(env: Mapping[str, str]) -> SlurmStep | None:
        """The step described by ``env`` (``os.environ``), or None outside a Slurm step.

        Raises:
            HostListError: Slurm's variables are there but do not make sense.
        """
        needed = ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_STEP_ID")
        if not all(env.get(k) for k in needed):
            return None
        host_list = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        hosts = tuple(expand_host_list(host_list))
        try:
            job_id, node_id = int(env["SLURM_JOB_ID"]), int(env["SLURM_NODEID"])
        except ValueError:
            raise HostListError(
                f"SLURM_JOB_ID={env['SLURM_JOB_ID']!r} / SLURM_NODEID="
                f"{env['SLURM_NODEID']!r}: not integers"
            ) from None
        if not 0 <= node_id < len(hosts):
            raise HostListError(
                f"SLURM_NODEID={node_id} is outside the job's {len(hosts)} hosts ({host_list})"
            )
        return SlurmStep(
            job_id=job_id,
            node_id=node_id,
            hosts=hosts,
            launch_address=env.get("SLURM_LAUNCH_NODE_IPADDR") or None,
        )

    def redis_port(self) -> int:
        """The run's Redis port, the same on every node of the job."""
        return _PORT_BASE + self.job_id % _PORT_SPAN


def expand_host_list(text: str) -> list[str]:
    """``node[1-3,7],gpu[01-02]`` -> ``[node1, node2, node3, node7, gpu01, gpu02]``.

    Zero padding is kept (``[01-10]``); several bracket groups in one name multiply out.
    """
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        if item.strip():
            hosts.extend(_expand_one(item.strip(), text))
    if not hosts:
        raise HostListError(f"host list {text!r}: no hosts")
    return hosts


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise HostListError(f"host list {text!r}: unbalanced or nested brackets")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise HostListError(f"host list {text!r}: unbalanced brackets")
    items.append(text[start:])
    return items


def _expand_one(item: str, whole: str) -> list[str]:
    """One host expression (``rack[1-2]-n[01-04]``): every combination of its ranges."""
    parts = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
    choices: list[list[str]] = []
    for i, part in enumerate(parts):
        choices.append([part] if i % 2 == 0 else _expand_ranges(part, whole))
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_ranges(spec: str, whole: str) -> list[str]:
    out: list[str] = []
    for piece in spec.split(","):
        match = _RANGE.match(piece.strip())
        if match is None:
            raise HostListError(f"host list {whole!r}: {piece!r} is not a number or range")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise HostListError(f"host list {whole!r}: range {piece!r} runs backwards")
        width = len(first) if first.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(first), int(last) + 1))
    return out
