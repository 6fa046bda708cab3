"""LoRA on any policy (rlvla3/policy/lora.py): config errors, what trains, the trainable-only
weight sync, checkpoints and resume, and ``rlvla3 export`` merging the adapters back.

Two policies: our VLA (``policy.kind: vla``, adapters on ``qkv``/``proj``/``mlp.*``) and a tiny
``transformers`` causal LM (Llama layout: ``q_proj``/``v_proj``), saved to a temp dir and
loaded back from it, wrapped in a minimal ``ActorCritic``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributions import Categorical

from rlvla3.algo.optim import build_optimizer
from rlvla3.algo.ppo import ppo_update
from rlvla3.config.lora import LoraConfig, checkpoint_record
from rlvla3.config.run_config import Config, dump_config, load_config
from rlvla3.config.typed_load import ConfigError
from rlvla3.export import export_checkpoint
from rlvla3.policy.base import ActionSpec, ActorCritic, ActOutput, EvalOutput, ObsBatch
from rlvla3.policy.factory import build_policy, env_spaces
from rlvla3.policy.lora import apply_lora, load_init_weights, merge_lora
from rlvla3.runtime.checkpoints import resume_training, save_training
from transport.weights import FlatLayout

VLA = [
    "policy.kind=vla",
    "env.id=rlvla3/TableTopEasy-v0",
    "env.kwargs={image_size: 32}",
    "policy.vla={d_model: 32, num_layers: 2, num_heads: 2, action_head: gaussian, "
    "instruction_tokens: words, film: true, keypoints: 4}",
]
LORA = ["policy.lora.rank=4", "policy.lora.alpha=8"]
PPO_KW = dict(epochs=1, minibatch_size=8, clip_coef=0.2, vf_coef=0.5, ent_coef=0.01)


def vla_config(*extra: str) -> Config:
    return load_config(None, [*VLA, *extra])


@pytest.fixture(scope="module")
def spaces():
    return env_spaces(vla_config())


@pytest.fixture(scope="module")
def obs(spaces) -> ObsBatch:
    """Eight real table-top observations (the env's own images, instructions and proprio)."""
    return _tabletop_obs(vla_config(), 8)


def greedy(policy: ActorCritic, batch: ObsBatch) -> torch.Tensor:
    return policy.eval().act(batch, deterministic=True).action


def perturb_trained(policy: ActorCritic, seed: int = 1) -> None:
    """Move every trained tensor (a fresh adapter's B is zero: it would change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=gen))


# --- config ----------------------------------------------------------------------------------
def test_lora_is_off_by_default_and_checks_its_fields():
    assert not load_config(None).policy.lora.enabled
    with pytest.raises(ConfigError, match="policy.lora.rank: must be >= 0"):
        load_config(None, ["policy.lora.rank=-1"])
    with pytest.raises(ConfigError, match="policy.lora.ranks: unknown key"):
        load_config(None, ["policy.lora.ranks=4"])
    with pytest.raises(ConfigError, match="policy.lora.dropout: must be <= 1"):
        load_config(None, ["policy.lora.dropout=2"])


def test_unknown_target_module_is_one_config_error_with_candidates(spaces):
    cfg = vla_config(*LORA, "policy.lora.target_modules=[qkv, q_proj]")
    with pytest.raises(ConfigError) as err:
        build_policy(cfg, spaces)
    message = str(err.value)
    assert message.startswith("policy.lora.target_modules: 'q_proj' names no")
    assert "candidates:" in message and "qkv" in message and "mlp.0" in message
    with pytest.raises(ConfigError, match="'action_head' names no"):  # a head is not adapted
        build_policy(vla_config(*LORA, "policy.lora.target_modules=[action_head]"), spaces)


def test_launch_refuses_an_unknown_target_before_starting_anything(tmp_path):
    from rlvla3.launch.command import launch

    overrides = [*VLA, *LORA, "policy.lora.target_modules=[q_proj]", "roles.trainer.count=1"]
    with pytest.raises(ConfigError, match="policy.lora.target_modules: 'q_proj' names no"):
        launch(None, overrides, out=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


# --- what trains -----------------------------------------------------------------------------
def test_only_adapters_and_heads_require_grad(spaces):
    policy = build_policy(vla_config(*LORA, "policy.lora.target_modules=[qkv, proj]"), spaces)
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    heads = ("action_head.", "value_head.", "log_std")
    assert trained == set(policy.trained_state_names())
    assert all("lora_" in n or n.startswith(heads) for n in trained)
    assert {n for n in trained if "lora_" in n} == {
        f"transformer.blocks.{i}.attn.{m}.lora_{ab}.default.weight"
        for i in range(2)
        for m in ("qkv", "proj")
        for ab in "AB"
    }
    assert any(n.startswith("value_head.") for n in trained)
    frozen = [n for n, p in policy.named_parameters() if not p.requires_grad]
    assert "transformer.blocks.0.attn.qkv.base_layer.weight" in frozen and "cls_token" in frozen


def test_one_ppo_update_changes_only_trained_tensors(spaces, obs):
    policy = build_policy(vla_config(*LORA), spaces).train()
    optimizer = build_optimizer(policy, load_config(None).algo)
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in policy.parameters() if p.requires_grad}
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    with torch.no_grad():
        out = policy.act(obs)
    advantages = torch.linspace(-1, 1, len(out.value))
    batch = {
        "obs": obs,
        "actions": out.action,
        "log_probs": out.log_prob,
        "values": out.value,
        "advantages": advantages,
        "returns": out.value + advantages,
    }
    ppo_update(policy, optimizer, batch, max_grad_norm=0.5, **PPO_KW)
    after = policy.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    trained = set(policy.trained_state_names())
    assert changed and changed <= trained
    assert any("lora_B" in k for k in changed)  # the adapters learn, not just the heads


# --- weight sync -----------------------------------------------------------------------------
def test_layout_ships_only_trained_tensors_and_round_trips(spaces, obs):
    cfg = vla_config(*LORA)
    trainer, server = build_policy(cfg, spaces), build_policy(cfg, spaces)
    perturb_trained(trainer)
    layout = FlatLayout.of(trainer)
    assert set(layout.names) == set(trainer.trained_state_names())
    assert layout.numel < FlatLayout.of(build_policy(vla_config(), spaces)).numel / 5
    assert FlatLayout.of(server).digest == layout.digest  # both sides agree on the layout
    flat_view = FlatLayout.of(server).bind(server)  # as a rollout server's copy does
    assert not torch.equal(greedy(server, obs), greedy(trainer, obs))
    flat_view.copy_(layout.flatten(trainer))  # what the broadcast writes
    torch.testing.assert_close(greedy(server, obs), greedy(trainer, obs), rtol=0, atol=1e-6)


# --- checkpoints and export ------------------------------------------------------------------
def _lora_run(tmp_path: Path, spaces, *extra: str) -> tuple[Config, ActorCritic, Path]:
    """A LoRA run dir as the trainer leaves it: config.yaml and one checkpoint."""
    cfg = vla_config(*LORA, *extra)
    policy = build_policy(cfg, spaces)
    perturb_trained(policy)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    record = checkpoint_record(cfg.policy.lora, cfg.policy.init_checkpoint)
    optimizer = build_optimizer(policy, cfg.algo)
    save_training(
        run_dir / "checkpoints",
        model=policy,
        optimizer=optimizer,
        version=3,
        updates=7,
        keep=2,
        lora=record,
    )
    return cfg, policy, run_dir


def test_checkpoint_holds_trained_tensors_and_resumes(tmp_path, spaces, obs):
    cfg, policy, run_dir = _lora_run(tmp_path, spaces)
    state = torch.load(next((run_dir / "checkpoints").glob("*.pt")), weights_only=True)
    assert set(state["model"]) == set(policy.trained_state_names())
    restarted = build_policy(cfg, spaces)
    resumed = resume_training(
        run_dir / "checkpoints",
        model=restarted,
        optimizer=build_optimizer(restarted, cfg.algo),
        device=torch.device("cpu"),
        log=logging.getLogger("test"),
    )
    assert resumed is not None and (resumed.version, resumed.updates) == (3, 7)
    torch.testing.assert_close(greedy(restarted, obs), greedy(policy, obs), rtol=0, atol=0)
    plain = build_policy(vla_config(), spaces)
    with pytest.raises(RuntimeError):  # a LoRA checkpoint is not a whole model
        plain.load_state_dict(state["model"])


@pytest.mark.parametrize("warm_start", [False, True])
def test_export_merges_adapters_into_a_plain_checkpoint(tmp_path, spaces, obs, warm_start):
    extra: list[str] = []
    if warm_start:  # the base under the adapters is an earlier run's (whole) checkpoint
        base = build_policy(vla_config(), spaces)
        perturb_trained(base, seed=5)
        torch.save({"model": base.state_dict()}, tmp_path / "base.pt")
        extra = [f"policy.init_checkpoint={tmp_path / 'base.pt'}"]
    _, policy, run_dir = _lora_run(tmp_path, spaces, *extra)
    out = export_checkpoint(run_dir, tmp_path / "merged.pt")
    plain = build_policy(vla_config(), spaces)
    plain.load_state_dict(torch.load(out, weights_only=True)["model"])
    torch.testing.assert_close(greedy(plain, obs), greedy(policy, obs), rtol=0, atol=1e-5)
    # and the LoRA checkpoint itself serves as a warm start: adapters merged on load
    warm = build_policy(vla_config(), spaces)
    load_init_weights(warm, run_dir)
    torch.testing.assert_close(greedy(warm, obs), greedy(policy, obs), rtol=0, atol=1e-5)


def test_a_lora_checkpoint_whose_base_is_gone_is_one_clear_error(tmp_path, spaces):
    base = build_policy(vla_config(), spaces)
    torch.save({"model": base.state_dict()}, tmp_path / "base.pt")
    _, _, run_dir = _lora_run(tmp_path, spaces, f"policy.init_checkpoint={tmp_path / 'base.pt'}")
    (tmp_path / "base.pt").unlink()
    with pytest.raises(ConfigError, match="base is not there any more: .*base.pt"):
        export_checkpoint(run_dir, tmp_path / "merged.pt")
    with pytest.raises(ConfigError, match="policy.init_checkpoint: no checkpoint at"):
        load_init_weights(build_policy(vla_config(), spaces), tmp_path / "nowhere.pt")


def test_export_without_a_config_says_so(tmp_path, spaces):
    _, _, run_dir = _lora_run(tmp_path, spaces)
    (run_dir / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="no config.yaml beside"):
        export_checkpoint(run_dir, tmp_path / "x.pt")
    with pytest.raises(ConfigError, match="export: no checkpoint at"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "x.pt")


# --- a transformers model -------------------------------------------------------------------
class TokenPolicy(ActorCritic):
    """The least ActorCritic over a causal LM: the last token's hidden state -> a categorical
    over ``num_actions`` and a value."""

    def __init__(self, model_dir: Path, num_actions: int = 5) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        hidden = self.lm.config.hidden_size
        self.action_head = nn.Linear(hidden, num_actions)
        self.value_head = nn.Linear(hidden, 1)

    def head_parameter_prefixes(self) -> tuple[str, ...]:
        return ("action_head", "value_head")

    def _heads(self, obs: ObsBatch) -> tuple[Categorical, torch.Tensor]:
        out = self.lm(input_ids=obs["tokens"], output_hidden_states=True)
        last = out.hidden_states[-1][:, -1]
        return Categorical(logits=self.action_head(last)), self.value_head(last).squeeze(-1)

    @torch.no_grad()
    def act(self, obs: ObsBatch, deterministic: bool = False) -> ActOutput:
        dist, value = self._heads(obs)
        action = dist.mode if deterministic else dist.sample()
        return ActOutput(action=action, log_prob=dist.log_prob(action), value=value)

    def evaluate(self, obs: ObsBatch, action: torch.Tensor) -> EvalOutput:
        dist, value = self._heads(obs)
        return EvalOutput(log_prob=dist.log_prob(action), entropy=dist.entropy(), value=value)

    def action_spec(self) -> ActionSpec:
        return ActionSpec((), num_choices=5)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_lora_on_a_transformers_model(llama_dir):
    lora = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    tokens = {"tokens": torch.randint(1, 64, (6, 7), generator=torch.Generator().manual_seed(0))}
    trainer, server = TokenPolicy(llama_dir), TokenPolicy(llama_dir)
    server.load_state_dict(trainer.state_dict())  # the heads start alike, as from a checkpoint
    apply_lora(trainer, lora)
    apply_lora(server, lora)
    trained = set(trainer.trained_state_names())
    assert {n.rsplit(".", 4)[-4] for n in trained if "lora_" in n} == {"q_proj", "v_proj"}
    assert all("lora_" in n or n.startswith(("action_head", "value_head")) for n in trained)
    perturb_trained(trainer)
    layout = FlatLayout.of(trainer)
    assert layout.names == FlatLayout.of(server).names and set(layout.names) == trained
    layout.load(server, layout.flatten(trainer))
    torch.testing.assert_close(greedy(server, tokens), greedy(trainer, tokens), rtol=0, atol=0)
    want = trainer.eval()._heads(tokens)[0].logits
    merge_lora(trainer)
    assert not any("lora_" in n for n in trainer.state_dict())
    torch.testing.assert_close(trainer._heads(tokens)[0].logits, want, rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match=r"'qkv' names no.*candidates: .*q_proj"):
        apply_lora(TokenPolicy(llama_dir), LoraConfig(rank=2, target_modules=["qkv"]))


# --- a real run ------------------------------------------------------------------------------
@pytest.mark.slow  # ~20 s on the 2-core CI host: four role processes and a few PPO updates
def test_tabletop_run_with_lora_trains_syncs_checkpoints_and_exports(tmp_path):
    """launch/vla_tabletop.yaml with ``policy.lora.rank=4`` (from scratch, no warm start): the
    servers act with the versions the trainer publishes (trained samples of staleness 0), the
    checkpoints hold the adapters and heads, and ``rlvla3 export`` reloads into a plain policy
    that acts as the run's LoRA policy did."""
    from tests.launching import REPO, launcher_output, start_launcher

    run_dir = tmp_path / "run"
    overrides = [
        "run.name=lora_e2e",
        "policy.lora.rank=4",
        "policy.init_checkpoint=null",
        "policy.init_launch=null",
        "algo.ref_kl_coef=0",
        "algo.value_warmup_updates=0",
        "algo.checkpoint_every=2",
        "run.stop.max_env_steps=1300",
        "run.stop.eval_episodes=0",
        "run.stop.max_wall_s=150",
    ]
    extra = [arg for item in overrides for arg in ("--set", item)]
    launcher = start_launcher(REPO / "launch/vla_tabletop.yaml", run_dir, *extra)
    try:
        assert launcher.wait(timeout=240) == 0, launcher_output(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    counters = summary["counters"]
    assert counters["updates"] >= 3 and summary["weight_version"] >= 3
    assert counters.get("trained_staleness_0", 0) > 0 and summary["chunks_lost"] == 0
    cfg = load_config(run_dir / "config.yaml")
    lora_policy = build_policy(cfg)
    newest = sorted((run_dir / "checkpoints").glob("ckpt_*.pt"))[-1]
    state = torch.load(newest, weights_only=True)
    assert set(state["model"]) == set(lora_policy.trained_state_names())
    lora_policy.load_state_dict(state["model"], strict=False)
    merged = export_checkpoint(run_dir, tmp_path / "merged.pt")
    plain = build_policy(load_config(run_dir / "config.yaml", ["policy.lora.rank=0"]))
    plain.load_state_dict(torch.load(merged, weights_only=True)["model"])
    batch = _tabletop_obs(cfg)
    torch.testing.assert_close(greedy(plain, batch), greedy(lora_policy, batch), rtol=0, atol=1e-5)


def _tabletop_obs(cfg: Config, n: int = 4) -> ObsBatch:
    """``n`` real observations of the run's env (its own images, instructions, proprio)."""
    from sim.envs import make_env

    env = make_env(cfg.env.id, seed=0, **cfg.env.kwargs)
    try:
        frames = [env.reset(seed=seed)[0] for seed in range(n)]
    finally:
        env.close()
    return {k: torch.stack([torch.as_tensor(f[k]) for f in frames]) for k in frames[0]}
