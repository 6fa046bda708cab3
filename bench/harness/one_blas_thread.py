"""Imported for its effect, before numpy: one OpenBLAS thread for this process and the processes
it starts, as the launcher gives every role (``rlvla3/launch/processes.py``), so a benchmark's
servers compute as the real roles do."""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
