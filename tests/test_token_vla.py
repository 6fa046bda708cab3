"""The token-VLA policy family (rlvla3/policy/token_vla.py) on tiny random-weight checkpoints of
two model families written to a temp dir (tests/tiny_vlms.py): load, act, exact log-probs, a
PPO update, checkpoints, the weight path, and one clear error per wrong setup."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from gymnasium import spaces  # noqa: E402

from rlvla3.algo.batch import build_batch  # noqa: E402
from rlvla3.algo.learners import Objective  # noqa: E402
from rlvla3.algo.optim import build_optimizer  # noqa: E402
from rlvla3.config.run_config import AlgoConfig, load_config  # noqa: E402
from rlvla3.config.token_vla import ObservationMapping, PlanConfig, TokenVLAConfig  # noqa: E402
from rlvla3.config.typed_load import ConfigError  # noqa: E402
from rlvla3.policy import token_decode  # noqa: E402
from rlvla3.policy.factory import EnvSpaces, build_policy  # noqa: E402
from rlvla3.policy.token_vla import TokenVLAPolicy, build_token_vla  # noqa: E402
from rlvla3.policy.vla_prompt import decode_instruction  # noqa: E402
from sim.tokenizer import encode_instruction  # noqa: E402
from tests.tiny_vlms import IMAGE_SIZE, write_tiny_vlm  # noqa: E402
from transport.messages import TrajectoryChunk  # noqa: E402
from transport.weights import FlatLayout, WeightTarget  # noqa: E402

FAMILIES = ["llava", "idefics3"]
INSTRUCTIONS = ["push the red block to the blue target", "go", "push the green block left", "é"]


def tabletop_spaces() -> EnvSpaces:
    """The table-top env's spaces at the tiny processors' image size."""
    return EnvSpaces(
        observation=spaces.Dict(
            {
                "image": spaces.Box(0, 255, (IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8),
                "instruction": spaces.Box(0, 256, (48,), np.int32),
                "proprio": spaces.Box(-4.0, 4.0, (4,), np.float32),
            }
        ),
        action=spaces.Box(-1.0, 1.0, (2,), np.float32),
    )


def observations(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    instr = np.stack(
        [encode_instruction(INSTRUCTIONS[i % len(INSTRUCTIONS)], 48) for i in range(n)]
    )
    return {
        "image": torch.from_numpy(rng.integers(0, 256, (n, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)),
        "instruction": torch.from_numpy(instr),
        "proprio": torch.from_numpy(rng.normal(size=(n, 4)).astype(np.float32)),
    }


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


def make_policy(path: Path, space_changes: dict | None = None, **fields) -> TokenVLAPolicy:
    config = TokenVLAConfig(
        **{"path": str(path), "dtype": "float32", "bins": 16, "value_hidden": 16, **fields}
    )
    env = tabletop_spaces()
    if space_changes:
        env = EnvSpaces(**{"observation": env.observation, "action": env.action, **space_changes})
    return build_token_vla(config, env.observation, env.action)


def test_instruction_bytes_decode_back_to_text() -> None:
    for text in INSTRUCTIONS:
        assert decode_instruction(encode_instruction(text, 64)) == text


def test_act_is_batched_and_its_log_probs_are_what_evaluate_recomputes(model_dir) -> None:
    policy = make_policy(model_dir)
    assert policy.action_spec().shape == (2,) and policy.action_spec().num_choices == 16
    obs = observations(5)
    torch.manual_seed(0)
    sampled = policy.act(obs)
    greedy = policy.act(obs, deterministic=True)
    for out in (sampled, greedy):
        assert out.action.shape == (5, 2) and out.action.dtype == torch.int64
        assert ((out.action >= 0) & (out.action < 16)).all()
        assert out.log_prob.shape == (5,) and out.value.shape == (5,)
        assert torch.isfinite(out.log_prob).all() and (out.log_prob <= 0).all()
        # the trainer's recomputation at the same weights (one teacher-forced forward)
        again = policy.evaluate(obs, out.action)
        torch.testing.assert_close(again.log_prob, out.log_prob, atol=1e-4, rtol=0)
        torch.testing.assert_close(again.value, out.value, atol=1e-4, rtol=0)
        assert (again.entropy > 0).all()
    # greedy is deterministic, and a row's result does not depend on its batch mates (padding)
    assert torch.equal(policy.act(obs, deterministic=True).action, greedy.action)
    alone = policy.act({k: v[1:2] for k, v in obs.items()}, deterministic=True)
    assert torch.equal(alone.action[0], greedy.action[1])
    torch.testing.assert_close(alone.log_prob[0], greedy.log_prob[1], atol=1e-4, rtol=0)
    env_action = policy.to_env_action(greedy.action)
    assert env_action.dtype == torch.float32 and (env_action.abs() < 1).all()
    assert torch.equal(policy.from_env_action(env_action), greedy.action)


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_temperature_narrows_sampling_and_keeps_log_probs_exact(
    model_dir, cached, monkeypatch
) -> None:
    """``temperature``: act's log-probs (either decoding loop) are evaluate's at the same
    temperature, the entropy falls with it, and greedy actions stay those of temperature 1."""
    if not cached:
        monkeypatch.setattr(token_decode, "CACHED_FAMILIES", frozenset())
    plain, cold = make_policy(model_dir), make_policy(model_dir, temperature=0.5)
    obs = observations(4)
    torch.manual_seed(0)
    sampled = cold.act(obs)
    again = cold.evaluate(obs, sampled.action)
    torch.testing.assert_close(again.log_prob, sampled.log_prob, atol=1e-4, rtol=0)
    assert (again.entropy < plain.evaluate(obs, sampled.action).entropy).all()
    greedy = cold.act(obs, deterministic=True).action
    assert torch.equal(greedy, plain.act(obs, deterministic=True).action)


@pytest.mark.parametrize("detach", [False, True])
def test_detach_value_keeps_the_critics_loss_out_of_the_model(model_dir, detach) -> None:
    policy = make_policy(model_dir, detach_value=detach)
    obs = observations(3)
    out = policy.evaluate(obs, policy.act(obs).action)
    out.value.square().sum().backward()
    model_grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
    assert all(p.grad is not None for p in policy.value_parameters())
    assert (not model_grads) == detach
    policy.zero_grad()
    out = policy.evaluate(obs, policy.act(obs).action)
    out.log_prob.sum().backward()  # the actor's loss still trains the model
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.model.parameters())


def test_a_mapped_critic_observation_moves_the_value_and_never_the_actions(model_dir) -> None:
    """``observation.critic``: the value head reads the privileged vector beside the hidden
    state; the action tokens' log-probs do not depend on it."""
    env = tabletop_spaces()
    with_state = spaces.Dict(
        dict(env.observation.spaces) | {"state": spaces.Box(-1.0, 1.0, (5,), np.float32)}
    )
    mapping = ObservationMapping(critic="state")
    policy = make_policy(model_dir, {"observation": with_state}, observation=mapping)
    obs = observations(3) | {"state": torch.zeros(3, 5)}
    action = policy.act(obs, deterministic=True).action
    moved = obs | {"state": torch.ones(3, 5)}
    first, second = policy.evaluate(obs, action), policy.evaluate(moved, action)
    assert torch.equal(first.log_prob, second.log_prob)
    assert not torch.allclose(first.value, second.value)
    assert torch.allclose(policy.act(moved, deterministic=True).value, second.value, atol=1e-5)


def _chunk(policy: TokenVLAPolicy, n: int, extra: dict | None = None) -> TrajectoryChunk:
    obs = {**observations(n, seed=1), **(extra or {})}
    out = policy.act(obs)
    return TrajectoryChunk(
        worker_index=0,
        env_index=0,
        chunk_id=0,
        obs={k: v.numpy() for k, v in obs.items()},
        actions=out.action.numpy(),
        rewards=np.linspace(-1, 1, n).astype(np.float32),
        terminated=np.zeros(n, bool),
        truncated=np.zeros(n, bool),
        log_probs=out.log_prob.numpy(),
        values=out.value.numpy(),
        policy_versions=np.zeros(n, np.int64),
        bootstrap_value=0.0,
    )


def ppo_update(policy: TokenVLAPolicy) -> list[str]:
    """One PPO update of ``policy`` on a chunk it acted; asserts its metrics and weights are
    finite and returns the names of the tensors that changed."""
    return ppo_update_metrics(policy)[0]


def ppo_update_metrics(policy: TokenVLAPolicy, extra: dict | None = None):
    """``ppo_update`` on a chunk whose observations also hold ``extra`` (torch[8, ...] each);
    returns the changed names and the update's metrics."""
    algo = AlgoConfig(epochs=1, minibatch_size=4, lr=1e-3, correction="truncated_is")
    batch = build_batch([_chunk(policy, 8, extra)], policy, algo, torch.device("cpu"))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    optimizer = build_optimizer(policy, algo)
    policy.train()
    metrics = Objective(algo, vf_coef=algo.vf_coef, norm_adv=True).update(
        policy, optimizer, batch, policy_coef=1.0, reference=None
    )
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    after = policy.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    return [k for k in before if not torch.equal(before[k], after[k])], metrics


def test_one_ppo_update_changes_the_model_and_stays_finite(model_dir) -> None:
    changed = ppo_update(make_policy(model_dir))
    assert any(k.startswith("model.") and "q_proj" in k for k in changed), changed
    assert any(k.startswith("value_head.") for k in changed)


def test_checkpoint_and_weight_path_round_trip_to_the_same_actions(model_dir) -> None:
    trained = make_policy(model_dir)
    with torch.no_grad():  # weights that differ from what the directory holds
        for p in trained.parameters():
            p.add_(0.05 * torch.randn_like(p))
    obs = observations(4)
    expected = trained.act(obs, deterministic=True)
    buffer = io.BytesIO()
    torch.save(trained.state_dict(), buffer)
    buffer.seek(0)
    restored = make_policy(model_dir)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    got = restored.act(obs, deterministic=True)
    assert torch.equal(got.action, expected.action)
    torch.testing.assert_close(got.log_prob, expected.log_prob)
    # the weight path: a rollout server's copy bound to a flat buffer, filled from the trainer's
    server = make_policy(model_dir)
    layout = FlatLayout.of(trained)
    assert layout == FlatLayout.of(server) and any("q_proj" in n for n in layout.names)
    layout.bind(server).copy_(layout.flatten(trained))
    assert torch.equal(server.act(obs, deterministic=True).action, expected.action)


def test_a_discrete_action_space_is_one_token_of_n(model_dir) -> None:
    policy = make_policy(model_dir, {"action": spaces.Discrete(5)})
    assert policy.action_spec().shape == (1,) and policy.action_spec().num_choices == 5
    out = policy.act(observations(3))
    env_action = policy.to_env_action(out.action)
    assert env_action.shape == (3,) and ((env_action >= 0) & (env_action < 5)).all()
    assert torch.equal(policy.from_env_action(env_action), out.action)


def test_plan_tokens_come_before_the_actions_and_the_env_never_sees_them(model_dir) -> None:
    policy = make_policy(model_dir, plan=PlanConfig(key="goal", dims=4))
    assert policy.action_spec().shape == (6,) and policy.action_spec().num_choices == 16
    obs = observations(3)
    torch.manual_seed(0)
    out = policy.act(obs)
    greedy = policy.act(obs, deterministic=True)
    assert out.action.shape == (3, 6)
    # the plan is greedy even when the actions are sampled, and the log-prob is the actions'
    assert torch.equal(out.action[:, :4], greedy.action[:, :4])
    evaluated = policy.evaluate(obs, out.action)
    torch.testing.assert_close(evaluated.log_prob, out.log_prob, atol=1e-4, rtol=0)
    # behaviour cloning scores the plan's tokens too; both tokens' log-probs are below 0
    assert (policy.demo_evaluate(obs, out.action).log_prob < evaluated.log_prob - 1e-3).all()
    # a sampled plan is the policy's choice: sampled, and part of the log-prob
    sampling = make_policy(model_dir, plan=PlanConfig(sampled=True))
    sampling.load_state_dict(policy.state_dict())
    draws = [sampling.act(obs) for _ in range(8)]
    assert any(not torch.equal(d.action[:, :4], greedy.action[:, :4]) for d in draws)
    for d in draws[:2]:
        again = sampling.evaluate(obs, d.action).log_prob
        torch.testing.assert_close(again, d.log_prob, atol=1e-4, rtol=0)
        torch.testing.assert_close(
            sampling.demo_evaluate(obs, d.action).log_prob, again, atol=1e-6, rtol=0
        )
    # the env steps with the last two tokens' bins; the plan's four change nothing there
    env_action = policy.to_env_action(out.action)
    replanned = out.action.clone()
    replanned[:, :4] = (replanned[:, :4] + 5) % 16
    assert env_action.shape == (3, 2) and torch.equal(policy.to_env_action(replanned), env_action)
    # demos: the plan's bins from the frames' goal (16 bins over [-1, 1]), then the action's
    goal = torch.tensor([[-1.0, -0.99, 0.0, 0.99]] * 3)
    demo = policy.demo_action({**obs, "goal": goal}, env_action)
    assert demo[0, :4].tolist() == [0, 0, 8, 15] and torch.equal(demo[:, 4:], out.action[:, 4:])
    # SFT on the plan needs demos that have it
    with pytest.raises(ConfigError, match=r"plan.key: the demos have no 'goal'"):
        policy.demo_action(obs, env_action)
    with pytest.raises(ConfigError, match=r"plan.dims: 4, but the observations' 'goal' has 2"):
        policy.demo_action({**obs, "goal": goal[:, :2]}, env_action)
    # plan.rl_coef: RL's loss holds the plan to privileged labels where the observations have
    # them: the plan tokens' negative log-likelihood of the labels' bins, weighted
    with_goal = spaces.Dict(
        {**tabletop_spaces().observation.spaces, "goal": spaces.Box(-1, 1, (4,), np.float32)}
    )
    held = make_policy(model_dir, {"observation": with_goal}, plan=PlanConfig(rl_coef=0.5))
    held.load_state_dict(policy.state_dict())
    labelled = policy.demo_action({**obs, "goal": goal}, env_action)
    assert held.evaluate(obs, labelled).aux_loss is None
    scored = held.evaluate({**obs, "goal": goal}, labelled)
    demo = held.demo_evaluate(obs, labelled).log_prob
    torch.testing.assert_close(scored.aux_loss, -0.5 * (demo - scored.log_prob), atol=1e-5, rtol=0)
    changed, metrics = ppo_update_metrics(held, {"goal": goal[:1].expand(8, 4)})
    assert metrics["aux_loss"] > 0 and any("q_proj" in k for k in changed)
    # a plan held to labels the env does not give is refused at setup
    with pytest.raises(ConfigError, match=r"plan.rl_coef: 0.5 holds the plan to .*'goal'"):
        make_policy(model_dir, plan=PlanConfig(rl_coef=0.5))
    # one plan per call: with action chunks, or a discrete action, the YAML is refused
    with pytest.raises(ValueError, match="plan: plan tokens need action_steps 1"):
        TokenVLAConfig(path="x", plan=PlanConfig(), action_steps=2)
    with pytest.raises(ConfigError, match="plan: plan tokens need a continuous action space"):
        make_policy(model_dir, {"action": spaces.Discrete(5)}, plan=PlanConfig())


def test_state_mapping_writes_the_state_into_the_prompt(model_dir) -> None:
    policy = make_policy(model_dir)
    prompts = policy.prompt.prompts(np.stack([encode_instruction("go", 8)]), np.array([[0.5, -1]]))
    assert prompts[0].endswith("take to go? State: 0.500 -1.000\nOut:")
    assert prompts[0].startswith(policy.processor.image_token)


def projected_policy(path: Path) -> TokenVLAPolicy:
    """A policy with a state projector whose last layer is random (it starts at zero)."""
    policy = make_policy(path, state_projector=8, prompt="{instruction}{state}\n")
    torch.manual_seed(3)
    torch.nn.init.normal_(policy.state_projector.net[-1].weight, std=1.0)
    return policy


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_a_state_projector_feeds_the_state_as_an_embedding_and_keeps_log_probs_exact(
    model_dir, cached, monkeypatch
) -> None:
    """``state_projector``: the state leaves the prompt's text and enters through the
    projector; act's log-probs are still evaluate's, a row's do not depend on its batch mates,
    and the actor's loss trains the projector."""
    if not cached:
        monkeypatch.setattr(token_decode, "CACHED_FAMILIES", frozenset())
    policy = projected_policy(model_dir)
    prompts = policy.prompt.prompts(np.stack([encode_instruction("go", 8)]), None)
    assert prompts[0] == f"{policy.processor.image_token}go\n"  # no state in the text
    obs = observations(5)
    torch.manual_seed(0)
    for deterministic in (False, True):
        out = policy.act(obs, deterministic=deterministic)
        again = policy.evaluate(obs, out.action)
        torch.testing.assert_close(again.log_prob, out.log_prob, atol=1e-4, rtol=0)
        torch.testing.assert_close(again.value, out.value, atol=1e-4, rtol=0)
    greedy = policy.act(obs, deterministic=True)
    alone = policy.act({k: v[2:3] for k, v in obs.items()}, deterministic=True)
    torch.testing.assert_close(alone.log_prob[0], greedy.log_prob[2], atol=1e-4, rtol=0)
    # the state moves the actions' log-probs, through the projector only
    moved = obs | {"proprio": obs["proprio"] + 1.0}
    assert not torch.allclose(policy.evaluate(moved, greedy.action).log_prob, greedy.log_prob)
    policy.evaluate(obs, greedy.action).log_prob.sum().backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0 for p in policy.state_projector.parameters()
    )
    assert "state_projector" in policy.head_parameter_prefixes()


def test_a_state_projector_starts_at_zero_and_needs_a_mapped_state(model_dir) -> None:
    """Its last layer starts at zero: the model's log-probs are those of the same prompt
    without the state, whatever the state; a projector with no state mapped is refused."""
    policy = make_policy(model_dir, state_projector=8)
    plain = make_policy(model_dir, observation=ObservationMapping(state=None))
    obs = observations(3)
    action = plain.act(obs, deterministic=True).action
    for state in (obs["proprio"], obs["proprio"] * 3):
        got = policy.evaluate(obs | {"proprio": state}, action).log_prob
        torch.testing.assert_close(got, plain.evaluate(obs, action).log_prob, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="state_projector: it projects observation.state"):
        TokenVLAConfig(path="x", state_projector=8, observation=ObservationMapping(state=None))


def test_the_image_goes_where_the_prompt_says(model_dir) -> None:
    policy = make_policy(model_dir, prompt="Task: {instruction}.{image}{state}\n")
    image = policy.processor.image_token
    prompts = policy.prompt.prompts(np.stack([encode_instruction("go", 8)]), np.array([[0.5, -1]]))
    assert prompts[0] == f"Task: go.{image} State: 0.500 -1.000\n"
    # after the instruction, in a batch of rows of other lengths: act's log-probs are evaluate's
    obs = observations(4)
    out = policy.act(obs)
    again = policy.evaluate(obs, out.action)
    torch.testing.assert_close(again.log_prob, out.log_prob, atol=1e-4, rtol=0)
    # and the instruction still steers the actions from before the image
    first = policy.act(obs, deterministic=True)
    changed = dict(obs, instruction=observations(4, seed=1)["instruction"].roll(1, 0))
    assert not torch.allclose(policy.evaluate(changed, first.action).log_prob, first.log_prob)


def test_the_factory_builds_it_from_yaml_keys(model_dir) -> None:
    cfg = load_config(
        None,
        [
            "policy.kind=token_vla",
            f"policy.token_vla.path={model_dir}",
            "policy.token_vla.bins=8",
            "policy.token_vla.dtype=float32",
            "policy.token_vla.action_low=[-0.5]",
        ],
    )
    policy = build_policy(cfg, tabletop_spaces())
    assert isinstance(policy, TokenVLAPolicy) and policy.action_spec().num_choices == 8
    assert policy.to_env_action(torch.tensor([[0, 7]])).tolist()[0][0] == pytest.approx(-0.40625)


# --------------------------------------------------------------------------------- wrong setups
@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp("llava_errors"), "llava")


def _copy_without(src: Path, dst: Path, *names: str) -> Path:
    shutil.copytree(src, dst)
    for name in names:
        (dst / name).unlink()
    return dst


@pytest.mark.parametrize(
    ("setup", "field", "words"),
    [
        (lambda d, t: t / "nowhere", "policy.token_vla.path", "no such directory"),
        (
            lambda d, t: _copy_without(d, t / "c", "config.json"),
            "policy.token_vla.path",
            "config.json",
        ),
        (
            lambda d, t: _copy_without(d, t / "p", "processor_config.json", "tokenizer.json"),
            "policy.token_vla.path",
            "processor",
        ),
    ],
)
def test_a_bad_model_directory_is_one_clear_error(llava_dir, tmp_path, setup, field, words) -> None:
    with pytest.raises(ConfigError, match=field) as err:
        make_policy(setup(llava_dir, tmp_path))
    assert words in str(err.value)


def test_a_text_only_model_is_refused(tmp_path) -> None:
    from transformers import LlamaForCausalLM

    from tests.tiny_vlms import _llama, byte_tokenizer

    LlamaForCausalLM(_llama(300)).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="policy.token_vla.path: .*not an image-text-to-text"):
        make_policy(tmp_path)


@pytest.mark.parametrize(
    ("changes", "fields", "match"),
    [
        ({"action": spaces.Box(-1, 1, (2, 2))}, {}, r"policy.token_vla: .*cannot be action tokens"),
        (
            {"action": spaces.Box(-np.inf, np.inf, (2,))},
            {},
            r"policy.token_vla.action_low: .*unbounded",
        ),
        ({}, {"action_low": [0.0, 0.0, 0.0]}, r"policy.token_vla.action_low: one value or 2"),
        ({"action": spaces.Discrete(1000)}, {}, r"policy.token_vla.bins: .*do not fit"),
        (
            {"observation": spaces.Dict({"image": spaces.Box(0, 255, (32, 32, 3), np.uint8)})},
            {},
            r"policy.token_vla.observation.instruction: the env has no observation 'instruction'",
        ),
        (
            {},
            {"observation": ObservationMapping(critic="state")},
            r"policy.token_vla.observation.critic: the env has no observation 'state'",
        ),
        (
            {},
            {"observation": ObservationMapping(critic="instruction")},
            r"policy.token_vla.observation.critic: 'instruction' is .*not a float vector",
        ),
    ],
)
def test_a_wrong_action_or_observation_space_is_one_clear_error(
    llava_dir, changes, fields, match
) -> None:
    with pytest.raises(ConfigError, match=match):
        make_policy(llava_dir, changes, **fields)


def test_a_yaml_without_path_or_with_a_bad_prompt_is_refused() -> None:
    with pytest.raises(ConfigError, match="policy.token_vla.path"):
        load_config(None, ["policy.kind=token_vla"])
    with pytest.raises(ConfigError, match=r"policy.token_vla: prompt: \{image\} may appear once"):
        load_config(
            None,
            [
                "policy.kind=token_vla",
                "policy.token_vla.path=/x",
                "policy.token_vla.prompt='Do {image}{instruction}{image}{state}'",
            ],
        )
    with pytest.raises(ConfigError, match=r"policy.token_vla: prompt: .*\{state\}"):
        load_config(
            None,
            [
                "policy.kind=token_vla",
                "policy.token_vla.path=/x",
                "policy.token_vla.prompt=Do {instruction}",
            ],
        )


# --------------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_a_run_trains_a_token_vla_end_to_end(llava_dir, tmp_path, redis_url) -> None:
    """env worker -> rollout server -> trainer -> broadcaster on the table-top task with a tiny
    LLaVA checkpoint: several versions trained and served, a checkpoint, summary.json."""
    from rlvla3.runtime.registry import Registry
    from tests.launching import launcher_output
    from tests.test_rl_loop import run_to_end
    from tests.tiny_vlms import tabletop_run_config

    name = "token_vla_run"
    run_dir = run_to_end(tmp_path, tabletop_run_config(name, redis_url, llava_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "max_env_steps" in summary["stop_reason"]
    registry = Registry(redis_url, name)
    counters = registry.counters()
    assert counters["updates"] >= 2 and registry.weight_version() >= 2, counters
    assert not counters.get("bad_chunks") and not counters.get("bad_requests"), counters
    assert list((run_dir / "checkpoints").glob("ckpt_*.pt")), launcher_output(run_dir)


def test_a_bfloat16_model_takes_float32_versions_exactly(model_dir) -> None:
    """A full bfloat16 token VLA (no LoRA) on the weight path: the trainer's float32 buffer
    holds its values exactly, and a receiver's bfloat16 copy, which cannot be a view of it,
    takes them on commit: the same tensors, bit for bit, and the same greedy actions."""
    keys = [
        "roles.rollout_server.count=1",
        "roles.trainer.count=1",
        "roles.weight_broadcaster.count=1",
    ]
    keys += ["policy.kind=token_vla", f"policy.token_vla.path={model_dir}"]
    cfg = load_config(None, [*keys, "policy.token_vla.dtype=bfloat16"])  # rollout servers, no LoRA
    assert cfg.policy.token_vla.dtype == "bfloat16" and cfg.policy.lora.rank == 0
    trainer = make_policy(model_dir, dtype="bfloat16")
    server = make_policy(model_dir, dtype="bfloat16")
    with torch.no_grad():  # a trained version: every weight moved
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    layout = FlatLayout.of(trainer)
    target = WeightTarget.of(layout, server)
    assert not target.bound and target.flat.dtype == torch.float32
    target.flat.copy_(layout.flatten(trainer))  # what a receive writes
    target.commit()
    theirs, ours = trainer.state_dict(), server.state_dict()
    for name in layout.names:
        assert ours[name].dtype == theirs[name].dtype
        assert torch.equal(ours[name], theirs[name]), name
    obs = observations(6)
    mine = server.eval().act(obs, deterministic=True).action
    assert torch.equal(mine, trainer.eval().act(obs, deterministic=True).action)
