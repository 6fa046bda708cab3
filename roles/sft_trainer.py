"""SFT trainer role: supervised training of the policy on demonstrations.

Reads a LeRobot-layout dataset (generating it from the env's scripted expert first when
``sft.generate_demos`` > 0 and it does not exist), and trains the same policy the RL roles use:
each step takes as many samples as fit ``sft.token_budget`` tokens and minimises the negative
log-likelihood of the demonstrated actions (for a token VLA: the cross-entropy of their action
tokens). How a frame counts in tokens, and how a batch is evaluated, is the policy family's
(``rlvla3/policy/sft_tokens.py``): the VLA packs samples without padding, attention per sample
(variable-length: flash-attn varlen on GPU, SDPA per segment on CPU); a token VLA's
``transformers`` model takes the frames back to back in rows with position ids restarting per
frame (``sft.packing``; right-padded batches for a family that cannot pack). bf16 autocast on GPU and FP8 where the GPU has it (``sft.fp8_backend``: Transformer
Engine or ``torch._scaled_mm``).

Weights go to the broadcaster every ``sft.publish_every`` steps, so rollout servers serve — and
env workers evaluate — the pretrained policy while it trains. After ``sft.max_steps`` it publishes
the final weights, checkpoints, and asks the launcher to end the run (which then evaluates the
final weights on fresh episodes when ``run.stop.eval_episodes`` is set).

With ``count`` > 1 the ranks are one group (docs/data-parallel.md): each reads its own episodes,
the loss is the global batch's, and rank 0 alone publishes and checkpoints. ``settings.shard``
shards the policy over the ranks (``rlvla3/algo/group_state.py``); the publish and checkpoint
steps are every rank's to know, and at each the ranks join rank 0's gathering. Rank 0 says
each step before the ranks take it (``sft_step``), and ``stop`` when it stops: a follower asked to
stop takes the steps rank 0 has said until then, so no rank is left in a collective alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from rlvla3.algo.data_parallel import DataParallel
from rlvla3.algo.group_state import GroupState
from rlvla3.algo.optim import trainable_parameters
from rlvla3.algo.sft_update import sft_update
from rlvla3.algo.sharding import run_as_forward
from rlvla3.config.role_settings import SftTrainerSettings
from rlvla3.config.sections import SymmetryConfig
from rlvla3.policy.factory import build_policy
from rlvla3.policy.memory_check import check_role_memory
from rlvla3.policy.sft_tokens import frame_tokens
from rlvla3.runtime.group_watch import GroupWatch
from rlvla3.runtime.metrics_log import MetricsLog
from rlvla3.runtime.rate_meter import RateMeter
from rlvla3.runtime.role_main import main
from rlvla3.runtime.train_group import (
    POLL_IDLE_S,
    STOP,
    GroupError,
    Message,
    join_group,
)
from rlvla3.runtime.training_role import TrainingRole
from sft.data import DemoSet, DemoStream
from sft.precision import autocast_context, enable_fp8, fp8_backends
from sft.symmetry import PlanarSymmetry, augment

_FINAL_BROADCAST_WAIT_S = 60.0
SFT_STEP = "sft_step"
"""The kind of rank 0's message before each step: every rank takes that step now."""


class SftTrainer(TrainingRole[SftTrainerSettings]):
    """Supervised (behaviour-cloning) training with packed batches; publishes weight versions."""

    name = "sft_trainer"

    def setup(self) -> None:
        self.device = self.start_torch()
        # before the demos are made: a model that cannot fit is refused at once
        estimate = check_role_memory(self.cfg, self.name, self.device, copies=1, trains=True)
        if estimate is not None:
            self.log.info("policy memory: %s", estimate.describe())
        dataset = self._dataset()  # (rank 0 generates it; the others wait for it)
        # sft_trainer.count > 1: one data-parallel group; each rank reads episodes of its own
        self.group = join_group(self, self.device)
        self.leader = self.group is None or self.group.leader
        shard = {"rank": self.index, "world_size": self.group.world_size} if self.group else {}
        self.policy = build_policy(self.cfg).to(self.device).train()
        s = self.cfg.sft
        # the policy family's sequence per frame, and its packed or padded evaluation
        counting = frame_tokens(self.policy, packing=s.packing, row_tokens=s.token_budget)
        self.evaluate = counting.evaluate
        self._said_padded = False
        tokens = {
            "fixed_tokens": counting.fixed_tokens,
            "variable_tokens": counting.variable_tokens,
            "action_steps": self.cfg.policy.action_steps,  # a frame's target: K actions
        }
        if s.stream_buffer_frames:
            self.data: DemoSet | DemoStream = DemoStream(
                dataset,
                **tokens,
                buffer_frames=s.stream_buffer_frames,
                seed=self.cfg.run.seed,
                **shard,
            )
        else:
            self.data = DemoSet(dataset, **tokens, **shard)
        self.own(self.data)
        self.log.info(
            "%d demo frames from %d episodes (%s, %s batches)",
            len(self.data),
            self.data.num_episodes,
            type(self.data).__name__,
            "packed" if counting.packed else "right-padded",
        )
        if counting.padded_because is not None:
            self.log.info("right-padded batches: %s", counting.padded_because)
        self.data.check_budget(s.token_budget)
        self.symmetry = planar_symmetry(s.symmetry)
        self.precision = autocast_context(self.device)
        if s.fp8 and self.device.type == "cuda":
            if s.fp8_backend in fp8_backends(self.device):
                self.precision = enable_fp8(self.policy, s.fp8_backend)
                self.log.info("training in FP8 (%s)", s.fp8_backend)
            else:
                self.log.info(
                    "FP8 off: sft.fp8_backend=%s is not usable on %s (available: %s)",
                    s.fp8_backend,
                    self.device,
                    fp8_backends(self.device) or "none",
                )
        # after enable_fp8, which may give the linears new parameters (Transformer Engine)
        self.optimizer = self._optimizer(self.policy)
        self.steps, self.version = 0, -1
        self.last_loss: float | None = None
        self.finish_deadline: float | None = None
        self._resume()
        # settings.shard: the ranks shard the policy once they hold the leader's state
        self.state = GroupState(
            self.group,
            self.policy,
            self.optimizer,
            self._optimizer if self.settings.shard else None,
        )
        self.data_parallel = DataParallel(self.group, self.state.sharded) if self.group else None
        self.watch = GroupWatch(self, self.group) if self.group is not None else None
        self.finished = False
        self.told_to_stop = False  # a follower: rank 0 said ``stop``
        self.token_rate = RateMeter(window_s=20.0)
        if not self.leader:  # rank 0 alone publishes, checkpoints and logs metrics
            self.steps = int(self._share_state()["steps"])
            # each rank its own packing and augmentation draws
            self.rng = np.random.default_rng([self.cfg.run.seed + self.steps, self.index])
            return
        self.version = self.catch_up_weights(self.policy, self.version)
        self.publisher = self.start_weight_publisher(self.policy, self.version)
        self.metrics = self.own(MetricsLog(self.run_dir, self.registry, "sft"))
        self.rng = np.random.default_rng(self.cfg.run.seed + self.steps)
        # the first version from the whole weights, before any rank shards them
        self.version = self.publish_weights(self.publisher, self.policy)
        self._share_state({"steps": self.steps})

    def _optimizer(self, policy: torch.nn.Module) -> torch.optim.Optimizer:
        s = self.cfg.sft  # fused: one kernel per step (see build_optimizer)
        return torch.optim.AdamW(
            trainable_parameters(policy), lr=s.lr, weight_decay=s.weight_decay, fused=True
        )

    def _share_state(self, info: dict | None = None) -> dict:
        """Every rank takes the leader's state (``info``: where it stands), then, sharded,
        keeps its shard; returns the leader's ``info``."""
        shared = self.state.share(self.stop_event.is_set, info)
        self.optimizer = self.state.optimizer
        if self.state.sharded:
            # The family's evaluation (captured before sharding) as a forward of the sharded
            # policy: the token VLA's packed one calls its model and value head directly.
            self.evaluate = run_as_forward(self.policy, "sft_evaluate", self.evaluate)
            self.state.say_sharded(self.log)
        return shared

    def _dataset(self) -> Path:
        root = Path(self.cfg.sft.dataset)
        if self.index > 0 and self.cfg.sft.generate_demos:
            while not (root / "meta" / "info.json").exists():  # rank 0 writes it
                if self.stop_event.wait(0.5):
                    raise InterruptedError("stopped while waiting for rank 0's demonstrations")
        if not (root / "meta" / "info.json").exists():
            if not self.cfg.sft.generate_demos:
                raise FileNotFoundError(
                    f"sft.dataset: no LeRobot dataset at {root} "
                    "(run `rlvla3 demos` or set sft.generate_demos)"
                )
            from sft.demos import generate_demos

            s = self.cfg.sft
            self.log.info(
                "generating %d demonstrations into %s (expert noise %g)",
                s.generate_demos,
                root,
                s.expert_noise,
            )
            generate_demos(
                self.cfg.env.id,
                s.generate_demos,
                root,
                s.demo_seed,
                expert_noise=s.expert_noise,
                **self.cfg.env.kwargs,
            )
        return root

    def step(self) -> None:
        if self.watch is not None:
            self.watch.check()
        if not self.leader:
            self._follower_step()
            return
        self.publisher.resend_if_due()  # the last send failed, or the broadcaster restarted
        if self.finished:
            self.stop_event.wait(0.5)  # the launcher evaluates and stops the run
            return
        if self.steps >= self.cfg.sft.max_steps:  # (also when resumed after the end)
            self._ask_to_end()
            return
        if self.group is not None:  # the followers take this step with us
            self.group.post(SFT_STEP, {"step": self.steps}, {})
        with self.busy("SFT step"):
            metrics = self._train_step()
        self._say_when_padded()
        self.steps += 1
        if self._publish_due():
            self._publish()
        # logged before the checkpoint: a kill between them would leave a checkpoint of this
        # step and no record of it (the successor resumes after it); this way round it is
        # recorded twice at worst, as every step after the last checkpoint is
        self.metrics.log(self.steps, {**metrics, "step": self.steps, "version": self.version})
        if self._checkpoint_due():
            self._checkpoint()
        self.gauge("steps", self.steps)
        self.gauge("loss", metrics["loss"])
        self.gauge("tokens_per_s", self.token_rate.rate())
        self.last_loss = metrics["loss"]

    def _say_when_padded(self) -> None:
        """Log once that packed batches fell back to padding: a frame longer than the model's
        sliding attention window (``PackedEvaluator.padded_batches``)."""
        padded = getattr(self.evaluate, "padded_batches", 0)
        if padded and not self._said_padded:
            self._said_padded = True
            self.log.info(
                "right-padded batches: a frame is longer than the language model's sliding "
                "window (%d tokens); batches holding one are evaluated padded",
                self.evaluate.window,
            )

    def _follower_step(self) -> None:
        """A rank other than 0: the step rank 0 said it takes next, or a moment's wait."""
        assert self.group is not None
        message = self.group.poll(POLL_IDLE_S)  # (seen as soon as it is posted)
        if message is None:
            return
        if message.kind == STOP:
            self.told_to_stop = True
            self.stop_event.set()
        else:
            self._follow(message)

    def _follow(self, message: Message) -> None:
        """Take the step rank 0 said (``SFT_STEP``), and join its gatherings after it."""
        if message.kind != SFT_STEP or message.info.get("step") != self.steps:
            raise GroupError(
                f"sft_trainer/{self.index} at step {self.steps}: rank 0 said "
                f"{message.kind} {message.info!r:.80}"
            )
        with self.busy("SFT step"):
            self._train_step()
        self.steps += 1
        if self.state.sharded:  # join the leader's gatherings after this step
            for _ in range(self._publish_due() + self._checkpoint_due()):
                self._join_gather()

    def _join_gather(self) -> None:
        assert self.group is not None
        # (not cut short by a stop: rank 0 gathers right after the step, whatever it was
        # asked; a rank 0 that is gone fails the poll)
        message = self.group.wait()
        assert message is not None
        with self.busy("gathering the sharded weights"):
            self.state.join(message)

    def shutdown(self) -> None:
        """A clean stop of a group (a failure leaves at once: the group restarts): rank 0 says
        ``stop``; a follower takes the steps rank 0 said until then, and leaves at once when
        rank 0 is gone."""
        if self.group is None or self.failed:
            return
        if self.leader:
            if not self.group.say_stop(timeout_s=self.cfg.run.heartbeat_ttl_s):
                self.log.warning("not every rank read stop (one is gone)")
        elif not self.told_to_stop:
            timeout_s = self.cfg.run.stall_timeout_s
            if not self.group.follow_to_stop(self._follow, timeout_s):
                self.log.info("rank 0 is gone (or said nothing in %.0fs): leaving", timeout_s)
        self.log.info("trained %d steps as rank %d", self.steps, self.index)

    def _publish_due(self) -> bool:
        """Whether the weights are published after step ``steps`` (every rank knows it)."""
        s = self.cfg.sft
        return self.steps % s.publish_every == 0 or self.steps >= s.max_steps

    def _checkpoint_due(self) -> bool:
        """Whether a checkpoint is written after step ``steps`` (every rank knows it)."""
        s = self.cfg.sft
        return self.steps % s.checkpoint_every == 0 or self.steps >= s.max_steps

    def _ask_to_end(self) -> None:
        """Ask for the stop (and the evaluation) once the final weights are on the servers: the
        launcher evaluates the broadcast version, which must be this last one. Gives up waiting
        after ``_FINAL_BROADCAST_WAIT_S`` (a broadcaster that is down), saying so."""
        if self.finish_deadline is None:
            self.finish_deadline = time.monotonic() + _FINAL_BROADCAST_WAIT_S
        broadcast = self.registry.weight_version()
        if broadcast < self.version and time.monotonic() < self.finish_deadline:
            self.stop_event.wait(0.1)
            return
        if broadcast < self.version:
            self.log.warning(
                "final weights v%d not broadcast after %.0fs (servers hold v%d)",
                self.version,
                _FINAL_BROADCAST_WAIT_S,
                broadcast,
            )
        self.finished = True
        loss = f" (loss {self.last_loss:.3f})" if self.last_loss is not None else ""
        self.registry.request_stop(f"sft finished {self.steps} steps{loss}")

    def _train_step(self) -> dict[str, float]:
        started = time.perf_counter()
        batch = self.data.packed_batch(self.cfg.sft.token_budget, self.rng)
        frames, env_actions = batch.obs, batch.actions
        if self.symmetry is not None:
            frames, env_actions = augment(frames, env_actions, self.symmetry, self.rng)
        obs = {k: torch.from_numpy(v).to(self.device) for k, v in frames.items()}
        actions = self.policy.demo_action(obs, torch.from_numpy(env_actions).to(self.device))
        loss, grad_norm = sft_update(
            self.policy,
            self.optimizer,
            self.evaluate,
            obs,
            actions.to(self.device),
            precision=self.precision,
            data_parallel=self.data_parallel,
        )
        self.token_rate.add(batch.num_tokens)
        self.count("sft_samples", batch.num_samples)  # every rank its own: the run's total
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "samples": batch.num_samples,
            "tokens": batch.num_tokens,
            "packing_efficiency": batch.efficiency,
            "step_s": time.perf_counter() - started,
            "t": time.time(),
        }

    def _publish(self) -> None:
        module, _ = self.state.whole()  # (sharded: gathered, every rank joining)
        self.version = self.publish_weights(self.publisher, module)

    def _checkpoint(self) -> None:
        module, optimizer = self.state.whole(optimizer=True)
        self.save_checkpoint(module, optimizer, self.version, self.steps)

    def _resume(self) -> None:
        if not self.leader:  # the leader's state overwrites whatever it loads
            return
        resumed = self.resume_checkpoint(self.policy, self.optimizer, self.device)
        if resumed is None:
            return
        self.steps = resumed.updates
        self.version = resumed.version
        self.log.info("resumed from %s (step %d)", resumed.path.name, self.steps)


def planar_symmetry(cfg: SymmetryConfig) -> PlanarSymmetry | None:
    """The augmentation ``sft.symmetry`` asks for (None: ``kind: none``)."""
    if cfg.kind == "none":
        return None
    return PlanarSymmetry(cfg.image_key, cfg.obs_pairs, cfg.action_pairs)


if __name__ == "__main__":
    main(SftTrainer)
