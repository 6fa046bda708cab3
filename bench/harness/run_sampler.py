"""Measure a live run: launch it, wait for steady state, sample its counters, stop it.

The whole-system benchmarks (``bench/throughput.py``, ``bench/async_vs_sync.py``) measure rates
this way. Roles add to the Redis counters in batches every 0.5 s, so the difference of two reads
is off by up to half a second of work (±2.5% over 20 s); the counters are sampled every 0.1 s
instead and rates fitted by least squares, so every flush inside the window counts.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from rlvla3.runtime.registry import Registry

from .launch_run import REPO, launch_command


@dataclass(frozen=True)
class CounterSamples:
    """Counters read every 0.1 s over a measuring window.

    Attributes:
        times: seconds since the window began, one per read.
        values: counter name -> its value at each read.
    """

    times: np.ndarray
    values: dict[str, np.ndarray]

    def rate(self, name: str) -> float:
        """``name`` per second over the window (least-squares slope)."""
        return float(np.polyfit(self.times, self.values[name], 1)[0])

    def delta(self, name: str) -> float:
        """How much ``name`` grew from the window's first read to its last."""
        return float(self.values[name][-1] - self.values[name][0])


def sample_run(
    config: dict[str, Any],
    workdir: Path,
    counters: tuple[str, ...],
    warmup_s: float,
    duration_s: float,
    start_timeout_s: float = 300.0,
    started_by: str = "env_steps",
) -> CounterSamples:
    """Launch the run ``config`` (``rlvla3 launch``; ``run.name`` and ``run.redis_url`` set) in
    ``workdir``, wait until its counter ``started_by`` moves (``env_steps``: it steps envs;
    ``samples_consumed``: a first update trained, so a sync run has been through one whole
    round) and then ``warmup_s`` more, read ``counters`` every 0.1 s for ``duration_s``, and
    stop it (SIGINT, as Ctrl-C would)."""
    name = config["run"]["name"]
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = workdir / f"{name}-launcher.log"
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen(
            launch_command(path, workdir / name), stdout=log, stderr=subprocess.STDOUT, cwd=REPO
        )
    registry = Registry(config["run"]["redis_url"], name)
    tick = threading.Event()
    times: list[float] = []
    reads: list[list[int]] = []
    try:
        deadline = time.monotonic() + start_timeout_s
        while registry.counters().get(started_by, 0) == 0:  # roles start, weights arrive
            if launcher.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace").splitlines()[-40:]
                raise RuntimeError(
                    f"{name}: the run did not start; its launcher log ({log_path}) ends:\n"
                    + "\n".join(tail)
                )
            tick.wait(0.2)
        tick.wait(warmup_s)
        started = time.monotonic()
        while (now := time.monotonic()) - started < duration_s:
            read = registry.counters()
            times.append(now - started)
            reads.append([read.get(k, 0) for k in counters])
            tick.wait(0.1)
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=120)
    arr = np.array(reads, dtype=np.float64).reshape(-1, len(counters))
    return CounterSamples(np.array(times), {k: arr[:, i] for i, k in enumerate(counters)})
