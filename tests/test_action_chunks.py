"""Action chunks (``policy.token_vla.action_steps``): a token VLA decoding K steps of actions per
call with its KV cache, exact log-probs, and the config's checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rlvla3.config.run_config import load_config  # noqa: E402
from rlvla3.config.typed_load import ConfigError  # noqa: E402
from rlvla3.policy import token_decode  # noqa: E402
from tests.test_token_vla import make_policy, observations  # noqa: E402
from tests.tiny_vlms import write_tiny_vlm  # noqa: E402


@pytest.fixture(scope="module", params=["llava", "idefics3"])
def model_dir(request, tmp_path_factory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("steps", [1, 3])
def test_cached_decoding_gives_the_log_probs_evaluate_recomputes(model_dir, steps) -> None:
    policy = make_policy(model_dir, action_steps=steps)
    assert policy.action_spec().env_steps == steps
    shape = (2,) if steps == 1 else (steps, 2)
    assert policy.action_spec().shape == shape
    decoder = token_decode.ActionDecoder(policy.model, policy.action_ids, policy._score)
    assert decoder.cached  # both test families decode with the cache
    obs = observations(4)  # instructions of different lengths: prompts of different lengths
    torch.manual_seed(0)
    for deterministic in (False, True):
        out = policy.act(obs, deterministic=deterministic)
        assert out.action.shape == (4, *shape) and out.action.dtype == torch.int64
        assert ((out.action >= 0) & (out.action < 16)).all()
        again = policy.evaluate(obs, out.action)
        torch.testing.assert_close(again.log_prob, out.log_prob, atol=1e-4, rtol=0)
        torch.testing.assert_close(again.value, out.value, atol=1e-4, rtol=0)
    # a row alone decodes what it decodes in its batch
    greedy = policy.act(obs, deterministic=True)
    alone = policy.act({k: v[1:2] for k, v in obs.items()}, deterministic=True)
    assert torch.equal(alone.action[0], greedy.action[1])
    torch.testing.assert_close(alone.log_prob[0], greedy.log_prob[1], atol=1e-4, rtol=0)


def test_the_cached_and_uncached_loops_decode_the_same_chunk(model_dir, monkeypatch) -> None:
    policy = make_policy(model_dir, action_steps=3)
    obs = observations(3, seed=4)
    cached = policy.act(obs, deterministic=True)
    monkeypatch.setattr(token_decode, "CACHED_FAMILIES", frozenset())
    uncached = policy.act(obs, deterministic=True)
    assert torch.equal(cached.action, uncached.action)
    torch.testing.assert_close(cached.log_prob, uncached.log_prob, atol=1e-4, rtol=0)
    torch.testing.assert_close(cached.value, uncached.value, atol=1e-4, rtol=0)


def test_an_action_chunk_maps_to_env_actions_and_back(model_dir) -> None:
    from gymnasium import spaces

    policy = make_policy(model_dir, action_steps=3)
    out = policy.act(observations(2))
    env_action = policy.to_env_action(out.action)
    assert env_action.shape == (2, 3, 2) and env_action.dtype == torch.float32
    assert torch.equal(policy.from_env_action(env_action), out.action)
    discrete = make_policy(model_dir, {"action": spaces.Discrete(5)}, action_steps=3)
    out = discrete.act(observations(2))
    assert out.action.shape == (2, 3, 1)
    index = discrete.to_env_action(out.action)
    assert index.shape == (2, 3) and torch.equal(discrete.from_env_action(index), out.action)


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        (["policy.token_vla.action_steps=0"], r"policy.token_vla.action_steps: must be >= 1"),
        (
            ["policy.kind=vla", "policy.token_vla.action_steps=2"],
            r"policy.token_vla.action_steps: .*need policy.kind: token_vla",
        ),
        (
            [
                "policy.kind=token_vla",
                "policy.token_vla.path=/x",
                "policy.token_vla.action_steps=2",
                "env.vectorized=true",
            ],
            r"policy.token_vla.action_steps: .*env.vectorized",
        ),
    ],
)
def test_action_steps_that_cannot_run_are_one_clear_error(keys, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, keys)
    ok = load_config(None, ["policy.kind=token_vla", "policy.token_vla.path=/x"])
    assert ok.policy.action_steps == 1


# --------------------------------------------------------------------------------- env side
def _chunk_run(steps: int, episode_limit: int, requests: int):
    """Two CartPoles (one group) stepped by an ``EnvRunner`` whose policy answers with action
    chunks of ``steps`` actions (alternating pushes: the pole stays up, so every episode runs to
    its time limit); what the runner recorded."""
    import numpy as np

    from rlvla3.config.run_config import config_from_dict
    from roles.env.action_chunks import ActionChunkEnvs
    from roles.env.chunk_sink import ChunkStream
    from roles.env.env_runner import EnvRunner
    from roles.env.env_slot import EnvSlot
    from roles.env.pacing import Pacing
    from tests.test_vector_runner import _Client, _Host, runner_parts
    from transport.messages import ActionBatchReply

    class ChunkClient(_Client):
        def ask(self, obs, rows):
            reply = super().ask(obs, rows)
            n = len(reply.log_probs)
            env_actions = np.tile(np.arange(steps) % 2, (n, 1)).astype(np.int64)  # [n, K]
            return ActionBatchReply(
                request_id=reply.request_id,
                actions=env_actions[..., None],  # the policy's int64[n, K, 1]
                env_actions=env_actions,
                log_probs=reply.log_probs,
                values=reply.values,
                policy_version=reply.policy_version,
            )

    cfg = config_from_dict(
        {
            "env": {
                "id": "CartPole-v1",
                "num_envs_per_worker": 2,
                "envs_per_request": 2,
                "chunk_len": 8,
                "kwargs": {"max_episode_steps": episode_limit},
            },
            "policy": {"kind": "token_vla", "token_vla": {"path": "/x", "action_steps": steps}},
            "roles": {"env_worker": {"count": 1}},
        }
    )
    host = _Host(requests)
    indices = [0, 1]
    pacing = Pacing(host.stop_event, groups=1, lock_step=False, version=0)
    parts = runner_parts(host, cfg, indices, ChunkClient(host), pacing, vector=False)
    envs = parts.make_envs()
    assert isinstance(envs, ActionChunkEnvs)
    slots = [EnvSlot(i, ChunkStream(i, f"0/{i}#test"), None) for i in indices]
    EnvRunner(parts, slots, chunk_len=8).run(envs)
    return host, slots


def test_an_env_runner_executes_action_chunks_and_counts_real_steps() -> None:
    """K = 3 and episodes of 7 steps: each episode is 3 transitions (3 + 3 + 1 steps; the last
    chunk's other 2 actions dropped at the time limit), rewards summed per transition."""
    import numpy as np

    host, slots = _chunk_run(steps=3, episode_limit=7, requests=40)
    assert host.episodes and all(length == 7 and ret == 7.0 for ret, length, *_ in host.episodes)
    transitions = host.chunks
    rewards = np.concatenate([c.rewards for c in transitions])
    truncated = np.concatenate([c.truncated for c in transitions])
    ends = np.flatnonzero(truncated)
    assert len(ends) == len(host.episodes)
    for end in ends:  # every episode: [3, 3, 1], truncated on its last transition only
        assert rewards[end - 2 : end + 1].tolist() == [3.0, 3.0, 1.0]
        assert not truncated[end - 2 : end].any()
    assert all(c.actions.shape[1:] == (3, 1) for c in transitions)
    assert not any(c.terminated.any() for c in transitions)
    # env_steps counts simulator steps (CartPole's reward is 1 a step): the pushed transitions'
    # and those still unsent at the stop
    unsent = sum(step.sim_steps for slot in slots for step in slot.steps)
    assert unsent == sum(step.reward for slot in slots for step in slot.steps)
    assert host.counters["env_steps"] == int(rewards.sum()) + unsent > len(rewards)


class _ScriptedSim:
    """A simulator whose step ``k`` (1-based) is terminal from ``terminal_at`` on and reports
    success only at ``success_at``."""

    def __init__(self, terminal_at: int, success_at: int) -> None:
        self.terminal_at, self.success_at, self.steps = terminal_at, success_at, 0

    def step(self, action):
        import numpy as np

        self.steps += 1
        info = {"success": self.steps == self.success_at}
        return {"x": np.zeros(1)}, 1.0, self.steps >= self.terminal_at, False, info


def test_a_chunk_plays_through_terminations_an_episode_ignores_and_keeps_a_middle_success():
    """ManiSkill's fair evaluation: a chunk of 4 whose second step is terminal and the only
    successful one runs all 4 steps when terminations are ignored, and the success is kept."""
    from roles.env.action_chunks import SUCCESS_IN_CHUNK, execute_chunk

    chunk = [[0.0]] * 4
    played = execute_chunk(_ScriptedSim(2, 2), chunk, 4, ignore_terminations=True)
    assert played.sim_steps == 4 and played.reward == 4.0
    assert played.info["success"] is False and played.info[SUCCESS_IN_CHUNK] is True
    ended = execute_chunk(_ScriptedSim(2, 2), chunk, 4)
    assert ended.sim_steps == 2 and ended.terminated and ended.info[SUCCESS_IN_CHUNK]


def test_a_protocol_episode_counts_a_success_inside_a_chunk_as_success_once() -> None:
    from roles.env.action_chunks import SUCCESS_IN_CHUNK
    from roles.env.protocol_runner import _Outcome
    from sim.env_group import Stepped
    from sim.protocols import maniskill_protocol

    episode = maniskill_protocol("maniskill/PickCube-v1", episodes=1).episodes[0]
    outcome = _Outcome()
    step = Stepped({"x": torch.zeros(1).numpy()}, 0.0, True, False, {"success": False})
    assert not outcome.add(step, episode)  # terminal, ignored
    middle = Stepped(step.obs, 0.0, True, False, {"success": False, SUCCESS_IN_CHUNK: True})
    assert not outcome.add(middle, episode)
    result = outcome.result(episode, "eval_env_worker/0")
    assert result["success"] is True and result["success_at_end"] is False
    assert result["length"] == 2


# --------------------------------------------------------------------------------- SFT targets
def test_a_frames_target_is_its_next_k_actions_padded_with_the_last() -> None:
    import numpy as np

    from sft.data import action_windows

    actions = np.arange(8, dtype=np.float32).reshape(4, 2)  # 4 steps of 2 dims
    windows = action_windows(actions, 3)
    assert windows.shape == (4, 3, 2)
    assert windows[0].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert windows[2].tolist() == [[4, 5], [6, 7], [6, 7]]  # past the end: the last repeated
    assert windows[3].tolist() == [[6, 7]] * 3
    assert action_windows(actions[:1], 2).tolist() == [[[0, 1], [0, 1]]]


def test_sft_data_reads_action_chunks_from_a_lerobot_dataset(tmp_path) -> None:
    import numpy as np

    from sft.data import DemoSet, DemoStream
    from sft.lerobot import LeRobotWriter
    from tests.test_lerobot import FEATURES, _episode

    rng = np.random.default_rng(0)
    episodes = [_episode(rng, n) for n in (4, 2)]
    with LeRobotWriter(tmp_path / "ds", FEATURES) as writer:
        for episode in episodes:
            writer.add_episode(episode, "push")
    demos = DemoSet(tmp_path / "ds", fixed_tokens=1, action_steps=3)
    assert demos.actions.shape == (6, 3, 2)
    second = episodes[1]["action"]  # frames 4, 5: the second episode's, padded at its end
    np.testing.assert_array_equal(demos.actions[4], second[[0, 1, 1]])
    np.testing.assert_array_equal(demos.actions[5], second[[1, 1, 1]])
    stream = DemoStream(tmp_path / "ds", fixed_tokens=1, buffer_frames=6, action_steps=3)
    try:
        batch = stream.packed_batch(budget=100, rng=np.random.default_rng(1), timeout_s=30)
    finally:
        stream.close()
    assert batch.actions.shape[1:] == (3, 2)
    firsts = {tuple(a[0]) for a in batch.actions}
    assert firsts <= {tuple(a) for e in episodes for a in e["action"]}


def test_a_token_vla_frame_counts_k_times_d_action_tokens(model_dir) -> None:
    from rlvla3.policy.sft_tokens import frame_tokens

    one = frame_tokens(make_policy(model_dir)).fixed_tokens
    three = frame_tokens(make_policy(model_dir, action_steps=3)).fixed_tokens
    assert three - one == 2 * 2  # two more steps of D = 2 tokens


# --------------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_a_run_trains_a_token_vla_with_action_chunks(tmp_path, redis_url) -> None:
    """env worker -> rollout server -> trainer -> broadcaster with ``action_steps: 2`` on a tiny
    LLaVA: chunks of [2, D] actions accepted and trained, env steps counted as real steps
    (more than the transitions trained on)."""
    import json

    from rlvla3.runtime.registry import Registry
    from tests.test_rl_loop import run_to_end
    from tests.tiny_vlms import tabletop_run_config

    model_dir = write_tiny_vlm(tmp_path / "model", "llava")
    name = "token_vla_chunks"
    cfg = tabletop_run_config(name, redis_url, model_dir, action_steps=2)
    cfg["algo"] = {"batch_steps": 16, "minibatch_size": 8, "epochs": 1}
    summary = json.loads((run_to_end(tmp_path, cfg) / "summary.json").read_text())
    assert "max_env_steps" in summary["stop_reason"]
    counters = Registry(redis_url, name).counters()
    assert counters["updates"] >= 2, counters
    assert not counters.get("bad_chunks") and not counters.get("bad_requests"), counters
    assert counters["env_steps"] >= 160
