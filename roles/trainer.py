"""Trainer role: PPO (or GRPO) on streamed trajectory chunks, publishing versioned weights.

Chunks arrive on a PULL socket from every env worker. In ``async`` mode the trainer consumes them
as they stream in: a chunk more than ``algo.max_staleness`` versions behind is dropped (counted),
the rest are corrected for lag (``algo.correction``), and an update runs whenever ``batch_steps``
env steps are buffered — it never waits for a rollout round. In ``sync`` and ``async_rollout``
modes training is per round: only chunks from the current version are used. With
``algo.kind: grpo`` chunks wait in a ``GroupAssembler`` until their group of episodes is
complete, and the staleness bound applies per sample when it is trained (``rlvla3/algo/grpo.py``).

Each step reads top to bottom: receive a chunk, account for it (``ChunkAccounting``: counters and
chunk ledger), hand it to the learner of ``algo.kind`` (``rlvla3/algo/learners.py``), update once
the learner holds a batch, publish.

After every ``algo.publish_every`` updates the weights go to the broadcaster as a new version.
Checkpoints (model, optimizer, version, update count) are written every ``algo.checkpoint_every``
updates and at exit; a restarted trainer resumes from the newest one, continuing the version
sequence. Metrics go to ``metrics.jsonl`` and TensorBoard (``tb/``) in the run dir, and to Redis.

A warm start (``policy.init_checkpoint``) loads its weights when there is no checkpoint of the
run's own; with ``algo.ref_kl_coef`` > 0 a frozen copy of them is the reference policy of the
loss's KL term, kept across restarts. With ``policy.lora`` the policy trains adapters and heads
on a frozen base that ``build_policy`` loads (``rlvla3/policy/lora.py``), and only those tensors
are published and checkpointed.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlvla3.algo.batch import chunk_staleness
from rlvla3.algo.chunk_check import chunk_problem, observation_bytes
from rlvla3.algo.group_updates import GroupUpdates
from rlvla3.algo.learners import Objective, TakenBatch, build_learner
from rlvla3.algo.optim import build_optimizer, scale_learning_rate
from rlvla3.algo.ppo import frozen_reference
from rlvla3.config.role_settings import TrainerSettings
from rlvla3.config.typed_load import ConfigError
from rlvla3.policy.base import ActorCritic
from rlvla3.policy.factory import build_policy, env_spaces
from rlvla3.policy.lora import load_init_weights
from rlvla3.policy.memory_check import check_role_memory
from rlvla3.runtime.chunk_accounting import ChunkAccounting
from rlvla3.runtime.group_watch import GroupWatch
from rlvla3.runtime.metrics_log import MetricsLog
from rlvla3.runtime.rate_meter import RateMeter
from rlvla3.runtime.role_main import main
from rlvla3.runtime.train_group import join_group
from rlvla3.runtime.training_role import TrainingRole
from roles.trainer_rank import FollowerRank
from transport import sockets
from transport.messages import TrajectoryChunk
from transport.socket_limits import chunk_limits


class Trainer(TrainingRole[TrainerSettings]):
    """Consumes chunks, updates the policy with PPO or GRPO, publishes weights, checkpoints."""

    name = "trainer"

    def setup(self) -> None:
        self.device = self.start_torch()
        spaces = env_spaces(self.cfg)
        # with a warm start and a KL term, the trainer also holds the frozen reference copy
        reference = bool(self.cfg.policy.init_checkpoint) and self.cfg.algo.ref_kl_coef > 0
        estimate = check_role_memory(
            self.cfg, self.name, self.device, copies=1 + reference, trains=True
        )
        if estimate is not None:
            self.log.info("policy memory: %s", estimate.describe())
        self.policy = build_policy(self.cfg, spaces).to(self.device)
        self.obs_space, self.action_spec = spaces.observation, self.policy.action_spec()
        self.optimizer = build_optimizer(self.policy, self.cfg.algo)
        self.version, self.updates, self.samples_trained = -1, 0, 0
        self.reference: ActorCritic | None = None  # set by _resume when algo.ref_kl_coef > 0
        self._resume()
        # trainer.count > 1: one data-parallel group; rank 0 alone receives, publishes, saves
        self.group = join_group(self, self.device)
        self.follower: FollowerRank | None = None
        if self.group is not None and not self.group.leader:
            objective = build_learner(
                self.cfg.algo, on_policy_only=False, batch_steps=1, device=self.device
            ).objective
            updates = self._group_updates(objective)
            self.follower = FollowerRank(self, updates, self.reference)
            self.optimizer = updates.optimizer  # (sharded: over the shards)
            updates.state.say_sharded(self.log)
            return
        self.version = self.catch_up_weights(self.policy, self.version)
        resent = self.cfg.role_settings("env_worker").resend_buffer_chunks > 0
        self.accounting = ChunkAccounting(self, self._flush_counters, resent=resent)
        self.accounting.write_off_dead_buffer()
        self.chunks = self.own(
            sockets.pull(
                hwm=self.settings.chunk_queue_hwm,
                on_bad_frame=self.count_bad_frame,
                limits=chunk_limits(observation_bytes(self.obs_space), self.cfg.env.chunk_len),
            )
        )
        self.bind("chunks", self.chunks)
        self.accounting.start_taking_chunks()
        self.publisher = self.start_weight_publisher(self.policy, self.version)
        # sync and async_rollout train per round: on the current version's chunks only
        self.on_policy_only = self.cfg.run.mode != "async"
        self.learner = build_learner(
            self.cfg.algo,
            on_policy_only=self.on_policy_only,
            batch_steps=self.cfg.algo.batch_steps or self.cfg.round_steps(),
            device=self.device,
        )
        self.group_updates = self._group_updates(self.learner.objective)
        self.group_updates.share_state()
        self.optimizer = self.group_updates.optimizer  # (sharded: over the shards)
        self.group_updates.state.say_sharded(self.log)
        self.group_watch = GroupWatch(self, self.group) if self.group is not None else None
        self.sample_rate = RateMeter(window_s=20.0)
        self.metrics = self.own(MetricsLog(self.run_dir, self.registry, "train"))
        self.frozen, self.next_freeze_check = False, 0.0
        self._publish()

    def _group_updates(self, objective: Objective) -> GroupUpdates:
        """The rank's updates; ``settings.shard``: the policy is sharded over the group."""
        rebuild = None
        if self.settings.shard:
            rebuild = lambda policy: build_optimizer(policy, self.cfg.algo)  # noqa: E731
        return GroupUpdates(self.group, objective, self.policy, self.optimizer, rebuild)

    # --- the loop --------------------------------------------------------------------------------
    def step(self) -> None:
        if self.follower is not None:
            self.follower.step()
            return
        if self.group_watch is not None:
            self.group_watch.check()
        chunk = self.accounting.receive(self.chunks.recv(timeout_s=0.2))
        if chunk is not None:
            self._accept(chunk)
        if self.learner.ready and not self._frozen():
            with self.busy("PPO update"):
                self._train()
        if not self.frozen:  # the last send failed, or the broadcaster restarted
            self.publisher.resend_if_due()

    def _frozen(self) -> bool:
        """True once the launcher started the end-of-run evaluation (checked at most 1/s)."""
        now = time.monotonic()
        if not self.frozen and now >= self.next_freeze_check:
            self.frozen = self.registry.evaluation_version() is not None
            self.next_freeze_check = now + 1.0
        return self.frozen

    def _accept(self, chunk: TrajectoryChunk) -> None:
        """Check a received chunk, then hand it to the learner if it is fresh enough."""
        problem = chunk_problem(
            chunk, self.obs_space, self.action_spec, chunk_len=self.cfg.env.chunk_len
        ) or self.learner.chunk_problem(chunk)
        if problem is not None:
            self.accounting.refuse(chunk, problem)
            return
        self.accounting.record(chunk)
        staleness = chunk_staleness(chunk, self.version)
        if not self.learner.admits(staleness):
            self._drop_stale(chunk, staleness)
            return
        self.accounting.hold()
        self.gauge("staleness", staleness)
        refusal = self.learner.accept(chunk)
        if refusal is not None:
            reason = f"dropped chunk {chunk.chunk_id} of {chunk.producer}: {refusal}"
            self.accounting.drop_held([chunk], reason)

    def _drop_stale(self, chunk: TrajectoryChunk, staleness: int) -> None:
        if staleness < 0:
            self.log.error(
                "chunk from version %d is newer than the trainer's %d",
                int(chunk.policy_versions.max()),
                self.version,
            )
        self.accounting.drop_received(
            chunk,
            f"dropped chunk {chunk.chunk_id} of {chunk.producer}: {staleness} versions behind "
            f"the trainer's v{self.version} (algo.max_staleness {self.cfg.algo.max_staleness}"
            f"{', and this mode trains the current version only' if self.on_policy_only else ''})",
        )

    def _train(self) -> None:
        started = time.perf_counter()
        taken = self.learner.take_batch(self.group_updates.batch_policy(), self.version)
        if taken.batch is None:
            reason = f"dropped {len(taken.chunks)} {self.learner.name} chunks: every step too stale"
            self.accounting.drop_held(taken.chunks, reason)
            return
        scale = self._lr_scale()
        scale_learning_rate(self.optimizer, scale)
        metrics = self.group_updates.lead(
            taken.batch,
            policy_coef=0.0 if self.updates < self.cfg.algo.value_warmup_updates else 1.0,
            reference=self.reference,
        )
        if metrics["skipped_minibatches"]:
            self.drop(
                "nonfinite_minibatches",
                f"update {self.updates + 1}: skipped "
                f"{metrics['skipped_minibatches']:.0f} minibatches with non-finite "
                "gradients (weights unchanged by them)",
            )
        self.updates += 1
        self.samples_trained += taken.samples
        self.sample_rate.add(taken.samples)
        self.accounting.trained(taken.chunks, taken.samples, taken.left_out, taken.trained_lags)
        self.count("updates")
        if self.updates % self.cfg.algo.publish_every == 0:
            self._publish()
        # before the checkpoint, so that a kill between them cannot leave the update
        # checkpointed and unrecorded (the SFT trainer's order too)
        self._log_metrics(metrics, taken, lr=self.cfg.algo.lr * scale, started=started)
        if self.updates % self.cfg.algo.checkpoint_every == 0:
            self._checkpoint()
        for_good = self.learner.evict_stale(self.version)
        if for_good:
            reason = f"dropped {len(for_good)} chunks of incomplete GRPO groups: too stale"
            self.accounting.drop_held(for_good, reason)

    def _lr_scale(self) -> float:
        """The learning rates' share of their full value (linear annealing, if configured)."""
        a = self.cfg.algo
        if not a.lr_anneal_samples:
            return 1.0
        return max(0.0, 1.0 - self.samples_trained / a.lr_anneal_samples)

    def _publish(self) -> None:
        module, _ = self.group_updates.whole()
        self.version = self.publish_weights(self.publisher, module)

    def _log_metrics(
        self, metrics: dict[str, float], taken: TakenBatch, *, lr: float, started: float
    ) -> None:
        """One ``metrics.jsonl`` record of the update just done, and the monitor's gauges."""
        staleness = [chunk_staleness(c, self.version - 1) for c in taken.chunks]
        metrics.update(
            update=self.updates,
            version=self.version,
            samples=taken.samples,
            lr=lr,
            mean_staleness=sum(staleness) / len(staleness),
            train_s=time.perf_counter() - started,
            t=time.time(),
        )
        self.metrics.log(self.updates, metrics)
        self.gauge("samples_per_s", self.sample_rate.rate())
        self.gauge("policy_loss", metrics.get("policy_loss", 0.0))

    # --- checkpoints -----------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        module, optimizer = self.group_updates.whole(optimizer=True)
        self._save(module, optimizer)

    def _save(self, module: Any, optimizer: Any) -> None:
        self.save_checkpoint(
            module, optimizer, self.version, self.updates, samples_trained=self.samples_trained
        )

    def _resume(self) -> None:
        init = self.cfg.policy.init_checkpoint
        if init and not self.cfg.policy.lora.enabled:  # (with LoRA the base holds it already)
            load_init_weights(self.policy, init)  # e.g. RL continuing from an SFT run
            self.log.info("initialised from %s", init)
        if init and self.cfg.algo.ref_kl_coef > 0:
            # The KL regulariser's reference: the warm start's weights, frozen (also on resume).
            self.reference = frozen_reference(self.policy)
        if self.index > 0:  # a follower rank: the leader's state overwrites whatever it loads
            return
        resumed = self.resume_checkpoint(self.policy, self.optimizer, self.device)
        if resumed is None:
            self._set_initial_log_std()
            return
        self.updates = resumed.updates
        self.samples_trained = int(resumed.extra.get("samples_trained", 0))
        self.version = resumed.version
        self.log.info(
            "resumed from %s (update %d, version %d)", resumed.path.name, self.updates, self.version
        )

    def _set_initial_log_std(self) -> None:
        """``algo.init_log_std``: RL explores with this Gaussian log-std, not the warm start's
        (behaviour cloning fits the std to the demos' spread, too wide to exploit)."""
        value = self.cfg.algo.init_log_std
        log_std = getattr(self.policy, "log_std", None)
        if value is None:
            return
        if not isinstance(log_std, torch.nn.Parameter):
            raise ConfigError("algo.init_log_std: the policy has no Gaussian head (log_std)")
        with torch.no_grad():
            log_std.fill_(value)
        self.log.info("exploring with log-std %.2f (algo.init_log_std)", value)

    def shutdown(self) -> None:
        if self.follower is not None:  # the leader holds the chunks and writes the checkpoints
            if not self.failed:  # a clean stop (a failure leaves at once)
                self.follower.finish(timeout_s=self.cfg.run.stall_timeout_s)
            self.log.info("trained %d updates as rank %d", self.follower.done, self.index)
            return
        self._last_checkpoint_and_stop(clean=not self.failed)
        if self.failed and not self.stop_event.is_set() and self.accounting.resent:
            # a successor takes over: it gets what this one held resent, as after a kill
            self.accounting.hand_back()
        else:
            self.accounting.drain(self.chunks, held=self.learner.held)

    def _last_checkpoint_and_stop(self, clean: bool) -> None:
        """The last checkpoint, and (a clean stop) ``stop`` to the other ranks as soon as they
        are no longer needed: after the sharded gathering, before the write, so that no rank
        waits on the disk. Sharded, a failed leader writes none: the gathering would need
        peers that may be gone (a failure after a stop was asked too); the group restarts
        from the last one written."""
        saving = self.updates > 0 and (clean or not self.group_updates.sharded)
        module, optimizer = self.group_updates.whole(optimizer=True) if saving else (None, None)
        if self.group is not None and clean:
            if not self.group.say_stop(timeout_s=self.cfg.run.heartbeat_ttl_s):
                self.log.warning("not every rank read stop (one is gone)")
        if saving:
            self._save(module, optimizer)


if __name__ == "__main__":
    main(Trainer)
