"""The env worker's runners and the parts they are made of.

A runner is the loop of one thread over one group of envs, built from parts: a
``PolicyClient`` (actions from the rollout servers), a ``ChunkSink`` (trajectory chunks to the
trainers), a ``SimMeter`` (time inside the simulators) and the worker's ``Pacing`` (sync mode's
lock-step and weight rounds, back-pressure). ``EnvRunner`` steps separate envs, ``VectorRunner``
a vector env as arrays, ``EvalRunner`` plays held-out evaluation episodes; ``RunnerThread`` runs
any of them.
"""
