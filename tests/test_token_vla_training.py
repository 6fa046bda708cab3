"""The token VLA through the rest of RL's path, on tiny checkpoints of two model families
(tests/tiny_vlms.py): one GRPO update, LoRA-only weight sync through the weight path's own
objects, resume from a LoRA checkpoint, the merged export reloading without LoRA, and a rollout
server that acts in inference mode with dropout off and refuses a model that cannot fit."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rlvla3.algo.learners import GrpoLearner  # noqa: E402
from rlvla3.algo.optim import build_optimizer  # noqa: E402
from rlvla3.config.lora import checkpoint_record  # noqa: E402
from rlvla3.config.run_config import AlgoConfig, Config, dump_config, load_config  # noqa: E402
from rlvla3.config.typed_load import ConfigError  # noqa: E402
from rlvla3.export import export_checkpoint  # noqa: E402
from rlvla3.policy import memory_check  # noqa: E402
from rlvla3.policy.base import ActorCritic  # noqa: E402
from rlvla3.policy.factory import build_policy  # noqa: E402
from rlvla3.runtime.checkpoints import resume_training, save_training  # noqa: E402
from tests.test_token_vla import observations, tabletop_spaces  # noqa: E402
from tests.tiny_vlms import IMAGE_SIZE, write_tiny_vlm  # noqa: E402
from transport.messages import ObsRequest, TrajectoryChunk  # noqa: E402
from transport.weights import FlatLayout  # noqa: E402

LOG = logging.getLogger("test")
LORA = ["policy.lora.rank=4", "policy.lora.alpha=8", "policy.lora.target_modules=[q_proj, v_proj]"]


@pytest.fixture(scope="module", params=["llava", "idefics3"])
def model_dir(request, tmp_path_factory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


def token_vla(path: Path, *extra: str) -> Config:
    """A run config of a token VLA on the table-top task at the tiny processors' image size."""
    keys = [
        "env.id=rlvla3/TableTopEasy-v0",
        f"env.kwargs={{image_size: {IMAGE_SIZE}, instruction_max_len: 48}}",
        "policy.kind=token_vla",
        f"policy.token_vla.path={path}",
        "policy.token_vla.bins=16",
        "policy.token_vla.value_hidden=16",
    ]
    return load_config(None, [*keys, *extra])


def build(cfg: Config) -> ActorCritic:
    return build_policy(cfg, tabletop_spaces())


def greedy(policy: ActorCritic, obs) -> tuple[torch.Tensor, torch.Tensor]:
    out = policy.eval().act(obs, deterministic=True)
    return out.action, out.log_prob


def perturb_trained(policy: ActorCritic, scale: float = 0.3) -> None:
    """Move every trained tensor (a fresh adapter's B is zero: it changes nothing)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in policy.parameters():
            if param.requires_grad:
                param.add_(scale * torch.randn(param.shape, generator=gen))


# --- GRPO ------------------------------------------------------------------------------------
def grpo_group(policy: ActorCritic, steps: int = 4) -> list[TrajectoryChunk]:
    """One group of two episodes with different returns, acted by ``policy``."""
    obs = observations(2 * steps, seed=2)
    out = policy.act(obs)
    done = np.arange(steps) == steps - 1
    chunks = []
    for episode in range(2):
        rows = slice(episode * steps, (episode + 1) * steps)
        chunks.append(
            TrajectoryChunk(
                worker_index=0,
                env_index=episode,
                chunk_id=0,
                obs={k: v[rows].numpy() for k, v in obs.items()},
                actions=out.action[rows].numpy(),
                rewards=np.full(steps, float(episode), np.float32),
                terminated=done,
                truncated=np.zeros(steps, bool),
                log_probs=out.log_prob[rows].numpy(),
                values=np.zeros(steps, np.float32),
                policy_versions=np.zeros(steps, np.int64),
                bootstrap_value=0.0,
                producer=f"0/{episode}#t",
                group="g0",
            )
        )
    return chunks


@pytest.mark.parametrize("lora", [[], LORA], ids=["full", "lora"])
def test_one_grpo_update_changes_the_weights_and_stays_finite(model_dir, lora) -> None:
    policy = build(token_vla(model_dir, *lora))
    algo = AlgoConfig(kind="grpo", group_size=2, epochs=1, minibatch_size=4, lr=1e-3)
    learner = GrpoLearner(algo, on_policy_only=False, batch_steps=8, device=torch.device("cpu"))
    for chunk in grpo_group(policy):
        assert learner.chunk_problem(chunk) is None and learner.accept(chunk) is None
    assert learner.ready
    taken = learner.take_batch(policy, version=0)
    assert taken.batch is not None and taken.samples == 8
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    metrics = learner.objective.update(
        policy.train(), build_optimizer(policy, algo), taken.batch, policy_coef=1.0, reference=None
    )
    # (explained_variance is NaN: GRPO's returns are zeros, there is no critic to explain them)
    losses = [metrics[k] for k in ("loss", "policy_loss", "entropy", "approx_kl", "grad_norm")]
    assert np.isfinite(losses).all() and not metrics["skipped_minibatches"], metrics
    after = policy.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    assert not any(k.startswith("value_head.") for k in changed)  # GRPO trains no critic
    if lora:
        assert any("lora_B" in k for k in changed) and changed <= set(policy.trained_state_names())
    else:
        assert any(k.startswith("model.") and "q_proj" in k for k in changed), changed


# --- LoRA-only weight sync -------------------------------------------------------------------
def test_lora_weight_sync_ships_only_adapters_and_gives_the_same_actions(model_dir) -> None:
    cfg = token_vla(model_dir, *LORA)
    trainer, server = build(cfg), build(cfg)
    perturb_trained(trainer)
    obs = observations(4)
    layout = FlatLayout.of(trainer)  # what the trainer publishes
    assert set(layout.names) == set(trainer.trained_state_names())
    full = FlatLayout.of(build(token_vla(model_dir)))
    shipped, whole = layout.numel * 4, full.numel * 4  # float32 bytes per version
    assert shipped * 20 < whole, (shipped, whole)
    server_layout = FlatLayout.of(server)
    assert server_layout.digest == layout.digest  # both sides agree before any byte moves
    flat = server_layout.bind(server)  # a rollout server's copy: views of its flat buffer
    assert not torch.allclose(greedy(server, obs)[1], greedy(trainer, obs)[1], atol=1e-3)
    flat.copy_(layout.flatten(trainer))  # what the broadcast writes
    action, log_prob = greedy(server, obs)
    want_action, want_log_prob = greedy(trainer, obs)
    assert torch.equal(action, want_action)
    torch.testing.assert_close(log_prob, want_log_prob, rtol=0, atol=1e-5)


# --- checkpoints and export ------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_run(model_dir, tmp_path_factory) -> tuple[Config, ActorCritic, Path]:
    """A LoRA run dir as the trainer leaves it: config.yaml and one checkpoint of adapters
    and value head (moved away from their initial values)."""
    cfg = token_vla(model_dir, *LORA)
    policy = build(cfg)
    perturb_trained(policy)
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    save_training(
        run_dir / "checkpoints",
        model=policy,
        optimizer=build_optimizer(policy, cfg.algo),
        version=3,
        updates=7,
        keep=2,
        lora=checkpoint_record(cfg.policy.lora, cfg.policy.init_checkpoint),
    )
    return cfg, policy, run_dir


def test_a_lora_token_vla_resumes_from_its_checkpoint(lora_run) -> None:
    cfg, policy, run_dir = lora_run
    state = torch.load(next((run_dir / "checkpoints").glob("*.pt")), weights_only=True)
    assert set(state["model"]) == set(policy.trained_state_names())  # adapters and value head
    restarted = build(cfg)  # as a restarted trainer does: the base from the folder, then this
    optimizer, cpu = build_optimizer(restarted, cfg.algo), torch.device("cpu")
    kwargs = {"model": restarted, "optimizer": optimizer, "device": cpu, "log": LOG}
    resumed = resume_training(run_dir / "checkpoints", **kwargs)
    assert resumed is not None and (resumed.version, resumed.updates) == (3, 7)
    obs = observations(4)
    action, log_prob = greedy(restarted, obs)
    want_action, want_log_prob = greedy(policy, obs)
    assert torch.equal(action, want_action)
    torch.testing.assert_close(log_prob, want_log_prob, rtol=0, atol=0)


def test_the_merged_export_loads_into_a_token_vla_without_lora(lora_run, tmp_path) -> None:
    cfg, policy, run_dir = lora_run
    out = export_checkpoint(run_dir, tmp_path / "merged.pt")
    merged = torch.load(out, weights_only=True)
    assert not any("lora_" in name for name in merged["model"]) and merged["version"] == 3
    plain = build(token_vla(Path(cfg.policy.token_vla.path)))
    plain.load_state_dict(merged["model"])
    obs = observations(4)
    action, log_prob = greedy(plain, obs)
    want_action, want_log_prob = greedy(policy, obs)
    assert torch.equal(action, want_action)
    torch.testing.assert_close(log_prob, want_log_prob, rtol=0, atol=1e-5)


# --- on a rollout server ---------------------------------------------------------------------
def serving_config(model_dir: Path, redis_url: str) -> Config:
    run = [f"run.redis_url={redis_url}", "run.name=token_vla_serving"]
    return token_vla(
        model_dir, *LORA, "policy.lora.dropout=0.5", "roles.rollout_server.count=1", *run
    )


def test_a_rollout_server_acts_in_inference_mode_with_dropout_off(
    model_dir, tmp_path, redis_url
) -> None:
    from roles.rollout_server import RolloutServer

    role = RolloutServer(serving_config(model_dir, redis_url), 0, node="local", run_dir=tmp_path)
    role.setup()
    try:
        for copy in (role.active, role.standby):  # LoRA's dropout would make greedy random
            assert not any(module.training for module in copy.modules())
        seen, act = [], role.active.act

        def recording_act(obs, deterministic=False):
            seen.append(torch.is_inference_mode_enabled())
            return act(obs, deterministic)

        role.active.act = recording_act
        sent = []
        role.requests.send_to = lambda identity, msg: sent.append(msg) or True
        obs = {k: v[0].numpy() for k, v in observations(1).items()}
        assert role._serve([(b"env0", ObsRequest(env_key="0/0", request_id=1, obs=obs))]) == 1
        assert seen == [True] and sent[0].request_id == 1 and np.isfinite(sent[0].log_prob)
    finally:
        role.requests.close()


@pytest.mark.parametrize("role_name", ["rollout_server", "trainer"])
def test_a_role_refuses_a_model_that_cannot_fit_at_setup(
    model_dir, tmp_path, redis_url, monkeypatch, role_name
) -> None:
    from roles.rollout_server import RolloutServer
    from roles.trainer import Trainer

    role_class = {"rollout_server": RolloutServer, "trainer": Trainer}[role_name]
    monkeypatch.setattr(memory_check, "device_free_bytes", lambda device: 1024)
    role = role_class(serving_config(model_dir, redis_url), 0, node="local", run_dir=tmp_path)
    refusal = rf"^policy.token_vla.path: .* on cpu \(roles.{role_name}.settings.device\)"
    with pytest.raises(ConfigError, match=refusal + r".* 9.54e-07 GiB is free"):
        role.setup()  # before any model is loaded or any socket bound
