"""What every role process runs on: the Role base, Redis registry and keys, metric names, chunk accounting, checkpoints, signals."""
