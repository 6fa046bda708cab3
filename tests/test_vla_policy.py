"""VLAPolicy: head shapes, act/evaluate agreement, instruction conditioning, padding invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlvla3.policy.vla import (
    VLAConfig,
    VLAPolicy,
    bins_to_continuous,
    continuous_to_bins,
)
from sim.tokenizer import VOCAB_SIZE, encode_instruction
from tests.instructions import decode_instruction, encode_instructions

HEADS = ["discrete_bins", "gaussian", "categorical"]
B = 4


def _policy(head: str = "discrete_bins", **overrides) -> VLAPolicy:
    torch.manual_seed(0)
    kwargs = {
        "image_size": 32,
        "patch_size": 8,
        "d_model": 32,
        "num_layers": 2,
        "num_heads": 4,
        "max_instruction_len": 32,
        "proprio_dim": 5,
        "action_head": head,
        "action_dim": 3,
        "num_bins": 11,
        "num_actions": 4,
    }
    return VLAPolicy(VLAConfig(**(kwargs | overrides))).eval()


def _obs(policy: VLAPolicy, texts: list[str], instr_len: int | None = None, seed: int = 0):
    c = policy.config
    g = torch.Generator().manual_seed(seed)
    n = len(texts)
    obs = {
        "image": torch.randint(
            0, 256, (n, c.image_size, c.image_size, 3), generator=g, dtype=torch.uint8
        ),
        "instruction": torch.from_numpy(
            encode_instructions(texts, instr_len or c.max_instruction_len)
        ),
    }
    if c.proprio_dim:
        obs["proprio"] = torch.randn(n, c.proprio_dim, generator=g)
    return obs


TEXTS = ["pick up the red cube", "open the drawer", "push", "stack the blue block on top"]


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_act_shapes_and_evaluate_matches(head, deterministic):
    policy = _policy(head)
    obs = _obs(policy, TEXTS)
    out = policy.act(obs, deterministic=deterministic)
    expected = {
        "discrete_bins": ((B, 3), torch.int64),
        "gaussian": ((B, 3), torch.float32),
        "categorical": ((B,), torch.int64),
    }[head]
    assert (tuple(out.action.shape), out.action.dtype) == expected
    assert out.log_prob.shape == out.value.shape == (B,)
    assert out.log_prob.dtype == out.value.dtype == torch.float32
    ev = policy.evaluate(obs, out.action)
    torch.testing.assert_close(ev.log_prob, out.log_prob, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ev.value, out.value, atol=1e-6, rtol=1e-6)
    assert ev.entropy.shape == (B,) and bool((ev.entropy > 0).all())
    env_action = policy.to_env_action(out.action)
    assert env_action.shape[0] == B


@pytest.mark.parametrize("head", HEADS)
def test_evaluate_backpropagates_to_every_input_path(head):
    policy = _policy(head).train()
    obs = _obs(policy, TEXTS)
    action = policy.act(obs).action
    ev = policy.evaluate(obs, action)
    (ev.log_prob.sum() + ev.value.sum() + ev.entropy.sum()).backward()
    for name in (
        "patch_embed.weight",
        "instruction.embed.weight",
        "proprio_embed.weight",
        "cls_token",
        "image_pos",
        "instruction.pos",
        "action_head.weight",
        "value_head.weight",
    ):
        grad = policy.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_evaluate_rejects_wrong_action_shape():
    policy = _policy("discrete_bins")
    with pytest.raises(ValueError, match="action shape"):
        policy.evaluate(_obs(policy, TEXTS), torch.zeros(B, dtype=torch.int64))


def test_instruction_changes_the_policy():
    policy = _policy("discrete_bins")
    obs_a = _obs(policy, ["pick up the red cube"] * 2)
    obs_b = dict(obs_a, instruction=_obs(policy, ["open the drawer"] * 2)["instruction"])
    with torch.no_grad():
        logits_a = policy.distribution(obs_a)[0].logits
        logits_b = policy.distribution(obs_b)[0].logits
    assert not torch.allclose(logits_a, logits_b, atol=1e-6)


def test_padding_does_not_change_the_output():
    policy = _policy("gaussian")
    short = _obs(policy, TEXTS, instr_len=len(TEXTS[-1]))  # the longest text fills the row
    long = dict(short, instruction=_obs(policy, TEXTS, instr_len=32)["instruction"])
    assert short["instruction"].shape[1] < long["instruction"].shape[1]
    with torch.no_grad():
        torch.testing.assert_close(
            policy.features(short), policy.features(long), atol=1e-5, rtol=1e-5
        )


def test_features_read_the_cls_rows_of_the_full_trunk():
    """``features`` runs the last block on the CLS rows alone: same values, forward and backward,
    as the whole trunk indexed at those rows."""
    policy = _policy("gaussian")
    obs = _obs(policy, TEXTS)
    tokens, cu, max_len = policy.embed(obs)
    full = policy.trunk(tokens, cu, max_len)[cu[:-1].long()]
    torch.testing.assert_close(policy.features(obs), full, atol=1e-5, rtol=1e-5)
    grads = []
    for feat in (policy.features(obs), policy.trunk(*policy.embed(obs))[cu[:-1].long()]):
        policy.zero_grad()
        feat.square().sum().backward()
        grads.append(policy.transformer.blocks[0].attn.qkv.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_packed_trunk_matches_padded_trunk():
    policy = _policy()
    with torch.no_grad():
        tokens, cu, max_len = policy.embed(_obs(policy, TEXTS))
        packed = policy.trunk(tokens, cu, max_len)
        lengths = (cu[1:] - cu[:-1]).tolist()
        docs = list(tokens.split(lengths))
        padded = torch.nn.utils.rnn.pad_sequence(docs, batch_first=True)
        mask = torch.arange(padded.shape[1])[None] < torch.tensor(lengths)[:, None]
        out = policy.trunk_padded(padded, mask)
    torch.testing.assert_close(packed, out[mask], atol=1e-5, rtol=1e-5)


def test_bins_round_trip():
    kw = {"low": -2.0, "high": 3.0, "num_bins": 256}
    bins = torch.arange(256)
    centres = bins_to_continuous(bins, **kw)
    assert centres.dtype == torch.float32
    assert torch.equal(continuous_to_bins(centres, **kw), bins)
    x = torch.linspace(-2.0, 3.0, 1001)
    err = (bins_to_continuous(continuous_to_bins(x, **kw), **kw) - x).abs().max()
    assert err <= 5.0 / 256 / 2 + 1e-6
    assert continuous_to_bins(torch.tensor([-9.0, 9.0]), **kw).tolist() == [0, 255]


def test_no_proprio_and_wrong_inputs():
    policy = _policy(proprio_dim=0)
    obs = _obs(policy, TEXTS)
    assert "proprio" not in obs
    assert policy.act(obs).action.shape == (B, 3)
    policy = _policy()
    bad_image = dict(_obs(policy, TEXTS), image=torch.zeros(B, 16, 16, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="image"):
        policy.act(bad_image)
    too_long = dict(_obs(policy, TEXTS), instruction=torch.ones(B, 33, dtype=torch.int32))
    with pytest.raises(ValueError, match="instruction"):
        policy.act(too_long)


def test_config_validation():
    with pytest.raises(ValueError, match="patch_size"):
        VLAConfig(image_size=30, patch_size=8)
    with pytest.raises(ValueError, match="num_heads"):
        VLAConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="action_head"):
        VLAConfig(action_head="beta")  # type: ignore[arg-type]


def test_tokenizer_round_trip_and_padding():
    assert VOCAB_SIZE == 257
    tokens = encode_instruction("grasp the mug", 20)
    assert tokens.dtype == np.int32 and tokens.shape == (20,)
    assert tokens[13:].tolist() == [0] * 7 and tokens.min() >= 0 and tokens.max() < VOCAB_SIZE
    assert decode_instruction(tokens) == "grasp the mug"
    assert decode_instruction(torch.from_numpy(tokens)) == "grasp the mug"
    assert decode_instruction(encode_instruction("héllo wörld", 64)) == "héllo wörld"


def test_tokenizer_truncates_at_character_boundary():
    tokens = encode_instruction("aé", 2)  # 'é' is 2 bytes: only 'a' fits
    assert tokens.tolist() == [ord("a") + 1, 0]
    assert decode_instruction(encode_instruction("abcdef", 3)) == "abc"
    with pytest.raises(ValueError):
        decode_instruction([300])


# ------------------------------------------------------------------ word tokens and FiLM
COLOUR_SWAP = ["push the red block to the blue target", "push the blue block to the red target"]


@pytest.mark.parametrize("mode", ["bytes", "words"])
def test_instruction_token_counts_match_the_packed_tokens(mode):
    policy = _policy(instruction_tokens=mode, film=True)
    obs = _obs(policy, TEXTS + ["  two  spaces "])
    _, cu, _ = policy.embed(obs)
    counts = policy.config.instruction_token_counts(obs["instruction"].numpy())
    words = [len(t.split()) for t in TEXTS + ["  two  spaces "]]
    expected = words if mode == "words" else [len(t) for t in TEXTS + ["  two  spaces "]]
    assert counts.tolist() == expected
    assert (cu[1:] - cu[:-1]).tolist() == (counts + policy.config.num_fixed_tokens).tolist()


def test_word_tokens_are_padding_invariant_and_order_aware():
    policy = _policy("gaussian", instruction_tokens="words", film=True, max_instruction_len=40)
    torch.nn.init.normal_(policy.film.out.weight, std=0.5)  # FiLM starts as the identity
    short = _obs(policy, TEXTS, instr_len=len(TEXTS[-1]))
    long = dict(short, instruction=_obs(policy, TEXTS, instr_len=40)["instruction"])
    with torch.no_grad():
        torch.testing.assert_close(
            policy.features(short), policy.features(long), atol=1e-5, rtol=1e-5
        )
        swap = _obs(policy, COLOUR_SWAP)
        swap["image"][1] = swap["image"][0]
        swap["proprio"][1] = swap["proprio"][0]
        a, b = policy.features(swap)
    assert not torch.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("film", [False, True])
def test_film_conditions_the_patch_tokens_on_the_instruction(film):
    policy = _policy(instruction_tokens="words", film=film, max_instruction_len=40)
    if film:
        torch.nn.init.normal_(policy.film.out.weight, std=0.5)
    obs = _obs(policy, COLOUR_SWAP)
    obs["image"][1] = obs["image"][0]
    obs["proprio"][1] = obs["proprio"][0]
    c = policy.config
    with torch.no_grad():
        tokens, cu, _ = policy.embed(obs)
    first = 1 + (c.proprio_dim > 0)
    patches = [tokens[s + first : s + first + c.num_patches] for s in cu[:-1].tolist()]
    assert torch.allclose(patches[0], patches[1]) != film


def test_film_is_the_identity_at_init_and_trains():
    plain, filmed = _policy("gaussian"), _policy("gaussian", film=True)
    filmed.load_state_dict(plain.state_dict(), strict=False)
    obs = _obs(plain, TEXTS)
    with torch.no_grad():
        torch.testing.assert_close(plain.features(obs), filmed.features(obs))
    filmed.train()
    out = filmed.evaluate(obs, filmed.act(obs).action)
    (out.log_prob.sum() + out.value.sum()).backward()
    assert filmed.film.out.weight.grad.abs().sum() > 0


def test_keypoint_stem_token_follows_the_object():
    """With ``keypoints`` the stem adds one token; its soft-argmax moves with the image content."""
    policy = _policy("gaussian", keypoints=4, film=True, instruction_tokens="words")
    assert policy.config.num_fixed_tokens == 1 + 1 + 1 + 16
    obs = _obs(policy, TEXTS[:2])
    obs["image"][:] = 0
    obs["image"][0, 2:6, 2:6] = 255  # a bright square top-left / bottom-right
    obs["image"][1, 26:30, 26:30] = 255
    _, cu, _ = policy.embed(obs)
    assert (cu[1:] - cu[:-1]).tolist() == [1 + 1 + 1 + 16 + 5, 1 + 1 + 1 + 16 + 3]
    stem = policy.keypoint_stem
    pixels = obs["image"].permute(0, 3, 1, 2).float() * (2.0 / 255.0) - 1.0
    instr, real = policy.instruction(obs["instruction"].long())
    with torch.no_grad():
        a, b = stem(pixels, instr, real)
    assert not torch.allclose(a, b, atol=1e-4)
    policy.train()
    out = policy.evaluate(obs, policy.act(obs).action)
    (out.log_prob.sum() + out.value.sum()).backward()
    for name in ("conv1.weight", "conv2.weight", "maps.weight", "log_temperature", "out.weight"):
        grad = stem.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
