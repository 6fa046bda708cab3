"""The base of the roles that train and publish weights (the RL and the SFT trainer).

What both do alike lives here once: publish versioned weights through the weight broadcaster,
catch up with the run when they (re)start behind it, and write checkpoints that a full disk
cannot turn into a crash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from rlvla3.config.lora import checkpoint_record
from rlvla3.config.role_settings import SftTrainerSettings, TrainerSettings
from rlvla3.config.typed_load import ConfigError
from rlvla3.runtime.checkpoints import Resumed, resume_training, save_training
from rlvla3.runtime.role import Role
from transport.socket_limits import MIB, weights_limits

TrainingSettingsT = TypeVar("TrainingSettingsT", TrainerSettings, SftTrainerSettings)


class TrainingRole(Role[TrainingSettingsT]):
    """A ``Role`` that trains a module and publishes its weights as versions."""

    def start_torch(self) -> Any:
        """Seed torch with ``run.seed`` and give it ``settings.num_threads`` CPU threads; returns
        the ``torch.device`` of ``settings.device``, where the role trains."""
        import torch  # only the trainers need it

        torch.manual_seed(self.cfg.run.seed)
        torch.set_num_threads(self.settings.num_threads)
        device = torch.device(self.settings.device)
        if device.type == "cuda" and device.index is not None:
            # as torchrun's ranks do: NCCL, caching allocator and any bare ``cuda`` tensor on
            # this rank's GPU, not every rank's context on cuda:0
            torch.cuda.set_device(device)
        return device

    def start_weight_publisher(self, module: Any, version: int) -> Any:
        """A ``transport.weight_publisher.WeightPublisher`` to the live weight broadcaster: it
        follows the broadcaster across restarts, records each version in Redis before sending
        it (the broadcaster accepts no version above that) and signs it with the run's weights
        key."""
        from transport.weight_publisher import WeightPublisher  # torch: only the trainers need it

        def broadcaster() -> str | None:
            found = self.registry.endpoints("weight_broadcaster", "updates")
            return found[0] if found else None

        self.wait_for_endpoints("weight_broadcaster", "updates")
        publisher = self.own(
            WeightPublisher(
                module,
                broadcaster,
                version,
                announce=self.registry.set_trained_version,
                key=self.weights_key,
            )
        )
        weights_bytes = publisher.layout.numel * 4  # (float32 on the wire)
        if weights_bytes > self.max_weights_bytes:
            raise ConfigError(
                f"roles.weight_broadcaster.settings.max_weights_mb: the weights that travel are "
                f"{weights_bytes / MIB:.0f} MiB, over {self.max_weights_bytes // MIB} MiB"
            )
        return publisher

    @property
    def max_weights_bytes(self) -> int:
        """The largest weights update the broadcaster takes
        (``roles.weight_broadcaster.settings.max_weights_mb``)."""
        return self.cfg.role_settings("weight_broadcaster").max_weights_mb * MIB

    def catch_up_weights(self, module: Any, version: int) -> int:
        """Bring a (re)starting trainer up to where the run stands; returns its version.

        ``version`` is what the trainer restored itself (its checkpoint's, -1 for none). When
        the run has gone further (the broadcaster holds, or a trainer announced, a newer
        version), the weights the broadcaster holds are loaded into ``module`` if they are newer
        and pass ``_held_weights_problem`` (signed with the run's weights key, produced by a
        trainer, finite; otherwise the checkpoint's weights stay), and the version count continues after the newest the run has seen: versions only move
        forward, so the servers take the next publish and the chunks they make are not
        "newer than the trainer" (which would be refused for ever).
        """
        trained = self.registry.trained_version()
        run_version = max(self.registry.weight_version(), trained)
        if run_version <= version:
            return version
        held = self._held_weights(version)
        if held is not None and held.version > version:
            problem = self._held_weights_problem(module, held, version, trained)
            if problem is None:
                import torch

                from transport.weights import FlatLayout

                FlatLayout.of(module).load(module, torch.from_numpy(held.flat.copy()))
                self.log.info(
                    "took weights v%d held by the weight broadcaster (newer than v%d)",
                    held.version,
                    version,
                )
                version = held.version
            else:
                self.drop(
                    "weights_rejected",
                    f"the broadcaster's weights v{held.version} not taken: {problem}; "
                    f"keeping those of v{version}",
                )
        if run_version > version:
            self.log.warning(
                "the run has reached v%d; continuing the version count from there "
                "with the weights of v%d",
                run_version,
                version,
            )
        return max(version, run_version)

    def _held_weights_problem(self, module: Any, held: Any, version: int, trained: int) -> Any:
        """Why the broadcaster's ``WeightsUpdate`` ``held`` must not replace the weights of
        ``version`` the trainer restored (None: it may): another layout, or a copy that is not
        newer, that no trainer produced, not signed with the run's weights key, or not finite
        (``transport/weight_auth.py``). The trainer's own checkpoint passed its digest check;
        the broadcaster's copy must pass this one to be preferred."""
        from transport.weight_auth import VersionGate
        from transport.weights import FlatLayout

        layout = FlatLayout.of(module)
        if (held.layout, held.flat.size) != (layout.digest, layout.numel):
            return f"layout {held.layout} of {held.flat.size} values, not {layout.digest}"
        return VersionGate(self.weights_key, newest=version).problem(
            held.version, held.flat, held.tag, trained
        )

    def _held_weights(self, after_version: int, timeout_s: float = 10.0) -> Any:
        """The broadcaster's ``WeightsUpdate`` if newer than ``after_version``, else None
        (also when no broadcaster answers within ``timeout_s``)."""
        from transport import sockets
        from transport.messages import WeightsRequest, WeightsUpdate

        try:
            address = self.wait_for_endpoints("weight_broadcaster", "current", timeout_s=timeout_s)
        except TimeoutError:
            self.log.warning("no weight broadcaster to ask for the run's weights")
            return None
        asker = sockets.dealer(
            hwm=1, on_bad_frame=self.count_bad_frame, limits=weights_limits(self.max_weights_bytes)
        )
        try:
            asker.connect(address[0])
            asker.send(WeightsRequest(after_version=after_version), timeout_s=timeout_s)
            held = asker.recv(timeout_s=timeout_s)
        finally:
            asker.close()
        if held is None:
            self.log.warning("the weight broadcaster did not answer within %.0fs", timeout_s)
        if held is not None and not isinstance(held, WeightsUpdate):
            self.log.warning("the weight broadcaster answered with a %s", type(held).__name__)
            return None
        return held if held is not None and held.version > after_version else None

    def publish_weights(self, publisher: Any, module: Any) -> int:
        """Publish ``module``'s weights as the next version; returns it."""
        version = publisher.publish(module)
        self.gauge("policy_version", version)
        if not publisher.last_sent:
            self.drop(
                "weights_unsent",
                f"weights v{version}: the weight broadcaster took nothing "
                "for a second (busy, down or restarting); publishing again shortly",
            )
        return version

    @property
    def checkpoint_dir(self) -> Path:
        """``RUN_DIR/checkpoints``: where the role's checkpoints go, and where it resumes from."""
        return self.run_dir / "checkpoints"

    def resume_checkpoint(self, model: Any, optimizer: Any, device: Any) -> Resumed | None:
        """Load the newest complete checkpoint of ``checkpoint_dir`` into ``model`` and
        ``optimizer`` (``rlvla3/runtime/checkpoints.py``); None when there is none."""
        return resume_training(
            self.checkpoint_dir, model=model, optimizer=optimizer, device=device, log=self.log
        )

    def save_checkpoint(
        self, model: Any, optimizer: Any, version: int, updates: int, **extra: Any
    ) -> None:
        """Checkpoint into ``checkpoint_dir`` (``rlvla3/runtime/checkpoints.py``), keeping
        ``settings.keep_checkpoints``. A failed write (a full disk) is counted and logged, and
        training goes on: the older checkpoints stay. With ``policy.lora`` it holds the
        adapters and heads, and what rebuilds the whole model from them."""
        policy = self.cfg.policy
        if policy.lora.enabled:  # what rebuilds the whole model (rlvla3 export)
            extra["lora"] = checkpoint_record(policy.lora, policy.init_checkpoint)
        try:
            save_training(
                self.checkpoint_dir,
                model=model,
                optimizer=optimizer,
                version=version,
                updates=updates,
                keep=self.settings.keep_checkpoints,
                **extra,
            )
        except OSError as err:
            self.drop("checkpoint_failures", f"checkpoint v{version} not written: {err}")
