"""Trainer role: PPO (or GRPO) on streamed trajectory chunks, publishing versioned weights.

Chunks arrive on a PULL socket from every env worker. In ``async`` mode the trainer consumes them
as they stream in: a chunk more than ``algo.max_staleness`` versions behind is dropped (counted),
the rest are corrected for lag (``algo.correction``), and an update runs whenever ``batch_steps``
env steps are buffered — it never waits for a rollout round. In ``sync`` and ``async_rollout``
modes training is per round: only chunks from the current version are used. With
``algo.kind: grpo`` chunks wait in a ``GroupAssembler`` until their group of episodes is
complete, and the staleness bound applies per sample when it is trained (``rlvla3/algo/grpo.py``).

After every ``algo.publish_every`` updates the weights go to the broadcaster as a new version.
Checkpoints (model, optimizer, version, update count) are written every ``algo.checkpoint_every``
updates and at exit; a restarted trainer resumes from the newest one, continuing the version
sequence. Metrics go to ``metrics.jsonl`` and TensorBoard (``tb/``) in the run dir, and to Redis.

A warm start (``policy.init_checkpoint``) loads its weights when there is no checkpoint of the
run's own; with ``algo.ref_kl_coef`` > 0 a frozen copy of them is the reference policy of the
loss's KL term, kept across restarts.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from rlvla3.algo.batch import build_batch, build_grpo_batch, chunk_staleness, keep_chunk
from rlvla3.algo.chunk_check import chunk_problem
from rlvla3.algo.grpo import GroupAssembler
from rlvla3.algo.optim import build_optimizer, scale_learning_rate
from rlvla3.algo.ppo import frozen_reference, ppo_update
from rlvla3.config.role_settings import TrainerSettings
from rlvla3.config.typed_load import ConfigError
from rlvla3.policy.base import ActorCritic
from rlvla3.policy.factory import build_policy, env_spaces
from rlvla3.runtime.checkpoints import load_checkpoint, resume_training
from rlvla3.runtime.chunk_ledger import buffered_field, received_field
from rlvla3.runtime.metrics_log import MetricsLog
from rlvla3.runtime.rate_meter import RateMeter
from rlvla3.runtime.role import main
from rlvla3.runtime.training_role import TrainingRole
from transport import sockets
from transport.messages import TrajectoryChunk

_DRAIN_S = 5.0  # the longest a stopping trainer takes chunks off its queue


_STALENESS_COUNTERS = (
    "trained_staleness_0",
    "trained_staleness_1",
    "trained_staleness_2",
    "trained_staleness_3plus",
)


class Trainer(TrainingRole[TrainerSettings]):
    """Consumes chunks, updates the policy with PPO or GRPO, publishes weights, checkpoints."""

    name = "trainer"

    def setup(self) -> None:
        torch.manual_seed(self.cfg.run.seed)
        torch.set_num_threads(self.settings.num_threads)
        self.device = torch.device(self.settings.device)
        spaces = env_spaces(self.cfg)
        self.policy = build_policy(self.cfg, spaces).to(self.device)
        self.obs_space, self.action_spec = spaces.observation, self.policy.action_spec()
        self.optimizer = build_optimizer(self.policy, self.cfg.algo)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.version, self.updates, self.samples_trained = -1, 0, 0
        self.reference: ActorCritic | None = None  # set by _resume when algo.ref_kl_coef > 0
        self._resume()
        self.version = self.catch_up_weights(self.policy, self.version)
        self.me = f"{self.name}/{self.index}"
        self._write_off_dead_buffer()
        self.chunks = self.own(
            sockets.pull(hwm=self.settings.chunk_queue_hwm, on_bad_frame=self.count_bad_frame)
        )
        self.bind("chunks", self.chunks)
        self._write_off_lost_chunks()
        self.publisher = self.start_weight_publisher(self.policy, self.version)
        self.buffer: list[TrajectoryChunk] = []
        self.advantages: list[float] = []  # GRPO: each buffered chunk's episode advantage
        self.groups = (
            GroupAssembler(self.cfg.algo.group_size) if self.cfg.algo.kind == "grpo" else None
        )
        self.buffered_steps = 0
        self.batch_steps = self.cfg.algo.batch_steps or self._round_steps()
        self.sample_rate = RateMeter(window_s=20.0)
        self.metrics = self.own(MetricsLog(self.run_dir, self.registry, "train"))
        self.frozen, self.next_freeze_check = False, 0.0
        self.last_chunk_at = time.monotonic()
        self._publish()

    def _write_off_dead_buffer(self) -> None:
        """Chunks an earlier process of this trainer held in its buffer when it was killed are
        lost: say so in the accounting (``chunks_lost_in_trainer``)."""
        held = self.registry.chunk_ledger().get(buffered_field(self.me), 0)
        if held > 0:
            self.count("chunks_lost_in_trainer", held)
            self.ledger_add(buffered_field(self.me), -held)
            self._flush_counters()
            self.log.warning("%d chunks died in the buffer of the trainer before this one", held)

    def _write_off_lost_chunks(self) -> None:
        """Chunks counted as pushed that no trainer will ever receive stop counting as queued,
        so the env workers' back-pressure (``max_chunks_queued``) cannot wait for them forever.

        Called at start (a killed trainer's queue died with it) and whenever nothing arrived
        for a second: an empty socket while Redis says chunks are queued means they are lost
        (or their counters lag; writing those off only relaxes the back-pressure a little).
        """
        self._flush_counters()  # our own chunks_received must not lag behind
        backlog = self.registry.chunk_backlog()
        if backlog > 0:
            self.count("chunks_written_off", backlog)
            self.log.info("%d chunks counted as pushed were never received: written off", backlog)

    def _round_steps(self) -> int:
        workers = self.cfg.roles["env_worker"].count if "env_worker" in self.cfg.roles else 1
        return workers * self.cfg.env.num_envs_per_worker * self.cfg.env.chunk_len

    # --- the loop --------------------------------------------------------------------------------
    def step(self) -> None:
        chunk = self.chunks.recv(timeout_s=0.2)
        if chunk is not None:
            self._accept(chunk)
            self.last_chunk_at = time.monotonic()
        elif time.monotonic() - self.last_chunk_at >= 1.0:
            self._write_off_lost_chunks()
            self.last_chunk_at = time.monotonic()
        if self.buffered_steps >= self.batch_steps and not self._frozen():
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

    def _accept(self, chunk: object) -> None:
        if not isinstance(chunk, TrajectoryChunk):
            self.drop("bad_frames", f"dropped a {type(chunk).__name__} on the chunk queue")
            return
        self.count("chunks_received")  # env workers' back-pressure reads this
        problem = (
            _producer_problem(chunk)
            or chunk_problem(chunk, self.obs_space, self.action_spec)
            or self._group_problem(chunk)
        )
        if problem is not None:  # dropped, and counted as such, so the chunk accounting adds up
            self.drop(
                "chunks_dropped",
                f"dropped chunk {chunk.chunk_id} of env worker {chunk.worker_index}: {problem}",
            )
            self.count("bad_chunks")  # (not in the ledger: its producer and number are not trusted)
            self.count("samples_dropped", int(np.size(chunk.rewards)))
            return
        self.ledger_high(received_field(chunk.producer, self.me), chunk.chunk_id)
        staleness = chunk_staleness(chunk, self.version)
        on_policy_only = self.cfg.run.mode != "async"
        # (GRPO holds stale steps until their group is complete: the bound applies per sample)
        max_staleness = 2**62 if self.groups is not None else self.cfg.algo.max_staleness
        if not keep_chunk(staleness, max_staleness=max_staleness, on_policy_only=on_policy_only):
            if staleness < 0:
                self.log.error(
                    "chunk from version %d is newer than the trainer's %d",
                    int(chunk.policy_versions.max()),
                    self.version,
                )
            self.drop(
                "chunks_dropped",
                f"dropped chunk {chunk.chunk_id} of {chunk.producer}: {staleness} versions behind "
                f"the trainer's v{self.version} (algo.max_staleness {self.cfg.algo.max_staleness}"
                f"{', and this mode trains the current version only' if on_policy_only else ''})",
            )
            self.count("samples_dropped", len(chunk.rewards))
            return
        self.ledger_add(buffered_field(self.me), 1)
        self.gauge("staleness", staleness)
        if self.groups is None:
            self.buffer.append(chunk)
            self.buffered_steps += len(chunk.rewards)
            return
        try:
            group = self.groups.add(chunk)
        except ValueError as err:
            self._drop_held([chunk], f"dropped chunk {chunk.chunk_id} of {chunk.producer}: {err}")
            return
        if group is not None:
            for chunks, advantage in group.episodes:
                self.buffer.extend(chunks)
                self.advantages.extend([advantage] * len(chunks))
                self.buffered_steps += sum(len(c.rewards) for c in chunks)

    def _count_staleness(self, chunks: list[TrajectoryChunk]) -> None:
        """How many versions behind the trainer each trained step was (the monitor's staleness
        distribution; GRPO's steps left out for staleness are not trained, so not counted)."""
        lags = np.concatenate([self.version - c.policy_versions for c in chunks])
        if self.groups is not None:
            lags = lags[lags <= self.cfg.algo.max_staleness]
        for lag, name in enumerate(_STALENESS_COUNTERS):
            n = int((lags == lag).sum()) if lag < 3 else int((lags >= 3).sum())
            if n:
                self.count(name, n)

    def _group_problem(self, chunk: TrajectoryChunk) -> str | None:
        if self.groups is not None and not chunk.group:
            return "group: empty (algo.kind grpo: env workers tag each episode's group)"
        return None

    def _drop_held(self, chunks: list[TrajectoryChunk], reason: str) -> None:
        """Drop chunks the trainer holds (buffered, or waiting for their group), counted."""
        self.drop("chunks_dropped", reason)
        if len(chunks) > 1:
            self.count("chunks_dropped", len(chunks) - 1)
        self.count("samples_dropped", sum(len(c.rewards) for c in chunks))
        self.ledger_add(buffered_field(self.me), -len(chunks))

    def _evict_stale_groups(self) -> None:
        """GRPO: groups that can no longer be trained (no step within the staleness bound: a
        producer died or stopped mid-group) are dropped."""
        if self.groups is None:
            return
        stale = self.groups.evict_stale(self.version, self.cfg.algo.max_staleness)
        if stale:
            self._drop_held(
                stale, f"dropped {len(stale)} chunks of incomplete GRPO groups: too stale"
            )

    def _train(self) -> None:
        chunks, self.buffer, self.buffered_steps = self.buffer, [], 0
        advantages, self.advantages = self.advantages, []
        started = time.perf_counter()
        a = self.cfg.algo
        left_out = 0
        if self.groups is None:
            batch = build_batch(chunks, self.policy, a, self.device)
        else:
            episodes = list(zip(chunks, advantages, strict=True))
            batch, left_out = build_grpo_batch(episodes, self.policy, a, self.device, self.version)
            if batch is None:
                self._drop_held(chunks, f"dropped {len(chunks)} GRPO chunks: every step too stale")
                return
        scale = self._lr_scale()
        scale_learning_rate(self.optimizer, scale)
        lr = a.lr * scale
        metrics = ppo_update(
            self.policy,
            self.optimizer,
            batch,
            epochs=a.epochs,
            minibatch_size=a.minibatch_size,
            clip_coef=a.clip_coef,
            vf_coef=0.0 if self.groups is not None else a.vf_coef,  # GRPO: no critic
            ent_coef=a.ent_coef,
            max_grad_norm=a.max_grad_norm,
            norm_adv=self.groups is None,  # GRPO's are normalised within their group
            policy_coef=0.0 if self.updates < a.value_warmup_updates else 1.0,
            reference=self.reference,
            ref_kl_coef=a.ref_kl_coef,
        )
        if metrics["skipped_minibatches"]:
            self.drop(
                "nonfinite_minibatches",
                f"update {self.updates + 1}: skipped "
                f"{metrics['skipped_minibatches']:.0f} minibatches with non-finite "
                "gradients (weights unchanged by them)",
            )
        self.updates += 1
        samples = sum(len(c.rewards) for c in chunks) - left_out
        if left_out:
            self.count("samples_dropped", left_out)
        self.samples_trained += samples
        self.sample_rate.add(samples)
        self._count_staleness(chunks)
        self.count("chunks_consumed", len(chunks))
        self.ledger_add(buffered_field(self.me), -len(chunks))
        self.count("samples_consumed", samples)
        self.count("updates")
        if self.updates % a.publish_every == 0:
            self._publish()
        if self.updates % a.checkpoint_every == 0:
            self._checkpoint()
        self._evict_stale_groups()
        staleness = [chunk_staleness(c, self.version - 1) for c in chunks]
        metrics.update(
            update=self.updates,
            version=self.version,
            samples=samples,
            lr=lr,
            mean_staleness=sum(staleness) / len(staleness),
            train_s=time.perf_counter() - started,
            t=time.time(),
        )
        self._log_metrics(metrics)

    def _lr_scale(self) -> float:
        """The learning rates' share of their full value (linear annealing, if configured)."""
        a = self.cfg.algo
        if not a.lr_anneal_samples:
            return 1.0
        return max(0.0, 1.0 - self.samples_trained / a.lr_anneal_samples)

    def _publish(self) -> None:
        self.version = self.publish_weights(self.publisher, self.policy)

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        self.metrics.log(self.updates, metrics)
        self.gauge("samples_per_s", self.sample_rate.rate())
        self.gauge("policy_loss", metrics.get("policy_loss", 0.0))

    # --- checkpoints -----------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        self.save_checkpoint(
            self.policy,
            self.optimizer,
            self.version,
            self.updates,
            samples_trained=self.samples_trained,
        )

    def _resume(self) -> None:
        resumed = resume_training(
            self.ckpt_dir,
            model=self.policy,
            optimizer=self.optimizer,
            device=self.device,
            log=self.log,
        )
        init = None
        if self.cfg.policy.init_checkpoint and (resumed is None or self.cfg.algo.ref_kl_coef > 0):
            init = load_checkpoint(self.cfg.policy.init_checkpoint, self.device)["model"]
        if init is not None and self.cfg.algo.ref_kl_coef > 0:
            # The KL regulariser's reference: the warm start's weights, frozen (also on resume).
            self.reference = frozen_reference(self.policy, init)
        if resumed is None:
            if init is not None:  # e.g. RL continuing from an SFT run
                self.policy.load_state_dict(init)
                self.log.info("initialised from %s", self.cfg.policy.init_checkpoint)
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
        self._drain()
        if self.updates:
            self._checkpoint()

    def _drain(self) -> None:
        """Take the chunks still queued at exit and count them with the buffered ones as in
        flight, so produced = consumed + dropped + these (+ lost). Bounded in time: a trainer
        that stops alone (it failed) has env workers still pushing, and what it leaves
        queued its successor writes off."""
        queued = 0
        deadline = time.monotonic() + _DRAIN_S
        while (
            time.monotonic() < deadline and (chunk := self.chunks.recv(timeout_s=0.5)) is not None
        ):
            if not isinstance(chunk, TrajectoryChunk):
                continue
            queued += 1
            # received now, so a restarted trainer does not write them off a second time
            self.count("chunks_received")
            if _producer_problem(chunk) is None:
                self.ledger_high(received_field(chunk.producer, self.me), chunk.chunk_id)
        held = len(self.buffer) + (self.groups.held if self.groups is not None else 0)
        self.ledger_add(buffered_field(self.me), -held)
        self.count("chunks_in_flight_at_exit", held + queued)


def _producer_problem(chunk: TrajectoryChunk) -> str | None:
    """Why the chunk's producer and number cannot go into the chunk ledger (None: they can)."""
    if not chunk.producer:
        return "producer: empty (the chunk accounting needs it)"
    if not 0 <= chunk.chunk_id < 2**53:
        return f"chunk_id: {chunk.chunk_id}, expected a sequence number from 0"
    return None


if __name__ == "__main__":
    main(Trainer)
