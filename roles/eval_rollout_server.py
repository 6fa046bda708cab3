"""Eval rollout server role: the rollout server of periodic evaluation (``run.eval``).

It receives every weight version like any rollout server but serves greedy actions from one
version at a time: it takes the newest weights only when the eval env worker has finished the
current round and at least ``run.eval.every_versions`` versions have passed since the one it
evaluated, then starts the next round (``Registry.begin_eval_round``). So every episode of a
round is acted on by one version, and training never waits for evaluation.
"""

from __future__ import annotations

import time

from rlvla3.runtime.role_main import main
from roles.rollout_server import RolloutServer

_ROUND_CHECK_S = 0.2  # how often a held version looks at the round's state in Redis


class EvalRolloutServer(RolloutServer):
    """Greedy rollout server that changes weights only between evaluation rounds."""

    name = "eval_rollout_server"
    serves_training = False

    def setup(self) -> None:
        super().setup()
        self.greedy = not self.cfg.run.eval.sample
        self.next_round_check = 0.0
        self.rounds_started = 0

    def _maybe_swap(self) -> None:
        # (read once: the weights thread clears it while it receives a newer version)
        pending = self.pending_version
        if pending is None:
            return
        if self.rounds_started:  # a (re)started server takes its first weights at once
            now = time.monotonic()
            if now < self.next_round_check:
                return
            self.next_round_check = now + _ROUND_CHECK_S
            round_, version, done = self.registry.eval_round()
            if done < round_ or pending < version + self.cfg.run.eval.every_versions:
                return
        before = self.version
        super()._maybe_swap()
        if self.version != before:  # swapped
            round_ = self.registry.begin_eval_round(self.version)
            self.rounds_started += 1
            self.log.info("evaluation round %d: weights v%d", round_, self.version)

    def _refresh_greedy(self) -> None:
        """Fixed: evaluation measures the policy's best actions (or its samples, asked for)."""


if __name__ == "__main__":
    main(EvalRolloutServer)
