"""Launching a run: one launcher per node, its role processes, the run's Redis, multi-node rendezvous, Slurm, stop rules, the progress line and the run summary (``summary.json``)."""
