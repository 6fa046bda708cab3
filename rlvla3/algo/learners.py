"""The trainer's learners: what PPO and GRPO do with the chunks the trainer accepts.

A learner holds the accepted chunks until it has enough to train (``ready``), turns them into one
batch (``take_batch``), and trains on it with its ``objective`` (the loss's terms, and
``Objective.update`` that minimises it). The trainer picks one learner from ``algo.kind`` at
start (``build_learner``) and calls only this interface; the chunk accounting (what was
received, dropped, trained: ``rlvla3/runtime/chunk_accounting.py``) stays with the trainer.

- ``PpoLearner``: chunks are buffered as they come; advantages from GAE (or V-trace) on the
  critic; a chunk beyond ``algo.max_staleness`` is refused on arrival.
- ``GrpoLearner``: chunks wait in a ``GroupAssembler`` until their group of episodes is complete
  (``rlvla3/algo/grpo.py``); no critic; the staleness bound applies per sample when the group is
  trained, so stale steps are held on arrival and left out of the batch.

In ``sync`` and ``async_rollout`` modes (``on_policy_only``) both accept chunks of the current
version only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from rlvla3.algo.batch import Batch, build_batch, build_grpo_batch, keep_chunk
from rlvla3.algo.data_parallel import DataParallel
from rlvla3.algo.grpo import GroupAssembler
from rlvla3.algo.ppo import ppo_update
from rlvla3.config.run_config import AlgoConfig
from rlvla3.policy.base import ActorCritic
from transport.messages import TrajectoryChunk

_NO_BOUND = 2**62  # a staleness no chunk reaches: GRPO bounds it per sample, at training time


@dataclass(frozen=True, slots=True)
class TakenBatch:
    """What a learner took off its buffer for one update."""

    chunks: list[TrajectoryChunk]
    """Every chunk taken, trained or not: the accounting settles all of them."""
    batch: Batch | None
    """The flat training batch; None when no step of ``chunks`` is fresh enough to train."""
    left_out: int
    """Env steps of ``chunks`` left out of ``batch`` as too stale (GRPO's per-sample bound)."""
    trained_lags: np.ndarray
    """int64[samples]: how many versions behind the trainer each trained step is."""

    @property
    def samples(self) -> int:
        """Env steps trained on."""
        return sum(len(c.rewards) for c in self.chunks) - self.left_out


@dataclass(frozen=True, slots=True)
class Objective:
    """A learner's PPO objective (``rlvla3/algo/ppo.py``): the ``algo`` settings and how the
    learner weighs the loss's terms."""

    algo: AlgoConfig
    """The ``algo`` config section (epochs, minibatches, clipping, coefficients)."""
    vf_coef: float
    """Weight of the value loss (0: no critic to train)."""
    norm_adv: bool
    """Normalise advantages per minibatch (False where they come normalised, as GRPO's do)."""

    def update(
        self,
        policy: ActorCritic,
        optimizer: torch.optim.Optimizer,
        batch: Batch,
        *,
        policy_coef: float,
        reference: ActorCritic | None,
        generator: torch.Generator | None = None,
        data_parallel: DataParallel | None = None,
    ) -> dict[str, float]:
        """One update on ``batch`` (``ppo_update``); returns its metrics.

        Args:
            policy_coef: weight of the policy terms (0 during the value warm-up).
            reference: the frozen policy of the KL regulariser (used when ``ref_kl_coef`` > 0).
            generator: the RNG of the minibatch shuffles (the same seed on every rank).
            data_parallel: the training group's ranks share each minibatch
                (``rlvla3/algo/data_parallel.py``).
        """
        a = self.algo
        return ppo_update(
            policy,
            optimizer,
            batch,
            epochs=a.epochs,
            minibatch_size=a.minibatch_size,
            clip_coef=a.clip_coef,
            vf_coef=self.vf_coef,
            ent_coef=a.ent_coef,
            max_grad_norm=a.max_grad_norm,
            norm_adv=self.norm_adv,
            policy_coef=policy_coef,
            reference=reference,
            ref_kl_coef=a.ref_kl_coef,
            target_kl=a.target_kl,
            generator=generator,
            data_parallel=data_parallel,
        )


class Learner(Protocol):
    """The one interface the trainer trains through, whatever the algorithm."""

    name: str
    """The algorithm, as logs name it (``PPO``, ``GRPO``)."""
    objective: Objective
    """The loss it trains with, and the update that minimises it."""

    def chunk_problem(self, chunk: TrajectoryChunk) -> str | None:
        """Why this algorithm cannot use ``chunk`` at all (None: it can)."""

    def admits(self, staleness: int) -> bool:
        """Whether a chunk whose oldest step is ``staleness`` versions behind is accepted."""

    def accept(self, chunk: TrajectoryChunk) -> str | None:
        """Hold ``chunk`` for training; returns why it could not be held (None: held)."""

    @property
    def ready(self) -> bool:
        """Whether enough env steps are held for an update (``batch_steps``)."""

    @property
    def held(self) -> int:
        """Chunks held, buffered or still waiting to be trainable (the accounting's share)."""

    def take_batch(self, policy: ActorCritic, version: int) -> TakenBatch:
        """Take every trainable chunk off the buffer and build the batch for trainer ``version``."""

    def evict_stale(self, version: int) -> list[TrajectoryChunk]:
        """Give up and return held chunks that can never be trained any more."""


def build_learner(
    algo: AlgoConfig, *, on_policy_only: bool, batch_steps: int, device: torch.device
) -> Learner:
    """The learner of ``algo.kind``.

    Args:
        algo: the ``algo`` config section.
        on_policy_only: accept chunks of the current version only (``sync`` and
            ``async_rollout`` modes, which train per round).
        batch_steps: env steps per update.
        device: where batches are built.
    """
    if algo.kind == "grpo":
        return GrpoLearner(algo, on_policy_only, batch_steps, device)
    return PpoLearner(algo, on_policy_only, batch_steps, device)


class _StepBuffer:
    """Chunks waiting for the next update, and how many env steps they hold.

    Args:
        batch_steps: env steps per update.
    """

    def __init__(self, batch_steps: int) -> None:
        self.batch_steps = batch_steps
        self.chunks: list[TrajectoryChunk] = []  # in arrival order
        self.steps = 0  # env steps in ``chunks``

    @property
    def full(self) -> bool:
        """Whether it holds ``batch_steps`` env steps or more."""
        return self.steps >= self.batch_steps

    def add(self, chunks: list[TrajectoryChunk]) -> None:
        self.chunks.extend(chunks)
        self.steps += sum(len(c.rewards) for c in chunks)

    def take(self) -> list[TrajectoryChunk]:
        """Every buffered chunk, leaving the buffer empty."""
        chunks, self.chunks, self.steps = self.chunks, [], 0
        return chunks


def _lags(chunks: list[TrajectoryChunk], version: int) -> np.ndarray:
    """int64[steps]: how many versions behind ``version`` each step of ``chunks`` is."""
    return np.concatenate([version - np.asarray(c.policy_versions, np.int64) for c in chunks])


class PpoLearner:
    """PPO on a critic: chunks buffered as they arrive, advantages per chunk (``build_batch``)."""

    name = "PPO"

    def __init__(
        self, algo: AlgoConfig, on_policy_only: bool, batch_steps: int, device: torch.device
    ) -> None:
        self.algo, self.on_policy_only, self.device = algo, on_policy_only, device
        self.objective = Objective(algo, vf_coef=algo.vf_coef, norm_adv=True)
        self._buffer = _StepBuffer(batch_steps)

    @property
    def ready(self) -> bool:
        return self._buffer.full

    @property
    def held(self) -> int:
        return len(self._buffer.chunks)

    def chunk_problem(self, chunk: TrajectoryChunk) -> str | None:
        return None

    def admits(self, staleness: int) -> bool:
        return keep_chunk(
            staleness, max_staleness=self.algo.max_staleness, on_policy_only=self.on_policy_only
        )

    def accept(self, chunk: TrajectoryChunk) -> str | None:
        self._buffer.add([chunk])
        return None

    def take_batch(self, policy: ActorCritic, version: int) -> TakenBatch:
        chunks = self._buffer.take()
        batch = build_batch(chunks, policy, self.algo, self.device)
        return TakenBatch(chunks, batch, left_out=0, trained_lags=_lags(chunks, version))

    def evict_stale(self, version: int) -> list[TrajectoryChunk]:
        return []  # a buffered chunk is trained at the next update, however old by then


class GrpoLearner:
    """GRPO: chunks held until their group is complete, then buffered with their episode's
    group-relative advantage; no critic (``rlvla3/algo/grpo.py``)."""

    name = "GRPO"

    def __init__(
        self, algo: AlgoConfig, on_policy_only: bool, batch_steps: int, device: torch.device
    ) -> None:
        self.algo, self.on_policy_only, self.device = algo, on_policy_only, device
        # no critic to train, and the group advantages come normalised within their group
        self.objective = Objective(algo, vf_coef=0.0, norm_adv=False)
        self._groups = GroupAssembler(algo.group_size)
        self._buffer = _StepBuffer(batch_steps)
        self._advantages: list[float] = []  # each buffered chunk's episode advantage

    @property
    def ready(self) -> bool:
        return self._buffer.full

    @property
    def held(self) -> int:
        return len(self._buffer.chunks) + self._groups.held  # buffered, or awaiting their group

    def chunk_problem(self, chunk: TrajectoryChunk) -> str | None:
        if not chunk.group:
            return "group: empty (algo.kind grpo: env workers tag each episode's group)"
        return None

    def admits(self, staleness: int) -> bool:
        # stale steps are held until their group is complete: the bound applies per sample
        return keep_chunk(staleness, max_staleness=_NO_BOUND, on_policy_only=self.on_policy_only)

    def accept(self, chunk: TrajectoryChunk) -> str | None:
        try:
            group = self._groups.add(chunk)
        except ValueError as err:
            return str(err)
        if group is not None:
            for chunks, advantage in group.episodes:
                self._buffer.add(chunks)
                self._advantages.extend([advantage] * len(chunks))
        return None

    def take_batch(self, policy: ActorCritic, version: int) -> TakenBatch:
        chunks, advantages, self._advantages = self._buffer.take(), self._advantages, []
        episodes = list(zip(chunks, advantages, strict=True))
        batch, left_out = build_grpo_batch(episodes, policy, self.algo, self.device, version)
        lags = _lags(chunks, version)
        # steps left out as too stale are not trained, so not among the trained lags
        return TakenBatch(chunks, batch, left_out, lags[lags <= self.algo.max_staleness])

    def evict_stale(self, version: int) -> list[TrajectoryChunk]:
        """Incomplete groups with no step within the staleness bound (a producer died or stopped
        mid-group) can never be trained."""
        return self._groups.evict_stale(version, self.algo.max_staleness)
