"""The token VLA on a CUDA GPU: bfloat16 weights, LoRA and the state projector, as the
table-top YAMLs run it. Skipped without CUDA (CI has none; ``python -m pytest -m gpu``).

Tolerances: in float32 the rollout server's log-prob (act: KV-cached decoding) equals the
trainer's recomputation (evaluate: one teacher-forced forward) to 1e-4, as on the CPU. In
bfloat16 the two paths round differently (8 mantissa bits; other kernels, other summation
orders), so they agree to ``BF16_LOG_PROB_ATOL`` per action; PPO's ratio sees that gap as
off-policy noise of ``exp(gap)`` at most. The tests print the measured gaps (``-s``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from rlvla3.algo.batch import build_batch  # noqa: E402
from rlvla3.algo.learners import Objective  # noqa: E402
from rlvla3.algo.optim import build_optimizer  # noqa: E402
from rlvla3.config.lora import LoraConfig  # noqa: E402
from rlvla3.config.run_config import AlgoConfig, config_from_dict  # noqa: E402
from rlvla3.config.token_vla import TokenVLAConfig  # noqa: E402
from rlvla3.config.typed_load import ConfigError  # noqa: E402
from rlvla3.policy.device_inputs import PROBE_ATOL  # noqa: E402
from rlvla3.policy.lora import apply_lora  # noqa: E402
from rlvla3.policy.memory_check import check_role_memory  # noqa: E402
from rlvla3.policy.token_vla import TokenVLAPolicy, build_token_vla  # noqa: E402
from tests.test_token_vla import observations, tabletop_spaces  # noqa: E402
from tests.tiny_vlms import FAMILIES, write_tiny_vlm  # noqa: E402
from transport.messages import TrajectoryChunk  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
BF16_LOG_PROB_ATOL = 5e-2
"""act vs evaluate, per action's summed log-prob, in bfloat16 (module docstring)."""


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


def cuda_policy(path: Path, dtype: str) -> TokenVLAPolicy:
    """The table-top YAMLs' shape: state projector, LoRA on q/v, on the GPU in ``dtype``; the
    projector's last layer random so that the state moves the actions."""
    config = TokenVLAConfig(
        path=str(path), dtype=dtype, bins=16, value_hidden=16, state_projector=8,
        prompt="{instruction}\n",
    )  # fmt: skip
    env = tabletop_spaces()
    policy = build_token_vla(config, env.observation, env.action)
    apply_lora(policy, LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(3)
    torch.nn.init.normal_(policy.state_projector.net[-1].weight, std=1.0)
    return policy.to(CUDA).eval()


def on_cuda(obs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(CUDA) for k, v in obs.items()}


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-4), ("bfloat16", BF16_LOG_PROB_ATOL)])
def test_act_on_cuda_reports_the_log_probs_evaluate_recomputes(model_dir, dtype, atol) -> None:
    policy = cuda_policy(model_dir, dtype)
    assert policy.model.dtype == getattr(torch, dtype)
    obs = on_cuda(observations(16))
    torch.manual_seed(0)
    for deterministic in (False, True):
        out = policy.act(obs, deterministic=deterministic)
        assert out.action.device.type == CUDA.type and len(out.action) == 16
        again = policy.evaluate(obs, out.action)
        gap = (again.log_prob - out.log_prob).abs().max().item()
        print(f"{model_dir.name} {dtype} deterministic={deterministic}: max |gap| {gap:.2e}")
        assert torch.isfinite(out.log_prob).all() and gap <= atol
        torch.testing.assert_close(again.value, out.value, atol=atol, rtol=0)


def test_one_ppo_update_on_cuda_in_bfloat16_trains_the_adapters_and_stays_finite(
    model_dir,
) -> None:
    policy = cuda_policy(model_dir, "bfloat16")
    obs = observations(8, seed=1)
    out = policy.act(on_cuda(obs))
    n = len(out.action)
    chunk = TrajectoryChunk(
        worker_index=0,
        env_index=0,
        chunk_id=0,
        obs={k: v.numpy() for k, v in obs.items()},
        actions=out.action.cpu().numpy(),
        rewards=np.linspace(-1, 1, n).astype(np.float32),
        terminated=np.zeros(n, bool),
        truncated=np.zeros(n, bool),
        log_probs=out.log_prob.cpu().numpy(),
        values=out.value.cpu().numpy(),
        policy_versions=np.zeros(n, np.int64),
        bootstrap_value=0.0,
    )
    algo = AlgoConfig(epochs=1, minibatch_size=4, lr=1e-3, correction="truncated_is")
    batch = build_batch([chunk], policy, algo, CUDA)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    policy.train()
    metrics = Objective(algo, vf_coef=algo.vf_coef, norm_adv=True).update(
        policy, build_optimizer(policy, algo), batch, policy_coef=1.0, reference=None
    )
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    after = policy.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("lora_" in k for k in changed) and any("state_projector" in k for k in changed)
    assert not any(k.endswith("q_proj.base_layer.weight") for k in changed)  # frozen base
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())


def test_a_model_that_cannot_fit_the_gpu_is_refused_with_its_size_and_the_free_memory(
    model_dir,
) -> None:
    sections = {
        "policy": {"kind": "token_vla", "token_vla": {"path": str(model_dir)}},
        "roles": {"rollout_server": {"settings": {"device": "cuda"}}},
    }
    cfg = config_from_dict({"run": {"name": "fits"}, **sections})
    assert (
        check_role_memory(cfg, "rollout_server", CUDA, copies=2, trains=False) is not None
    )  # it fits
    free, _ = torch.cuda.mem_get_info(CUDA)
    with pytest.raises(ConfigError, match="is free there") as refused:
        # as many copies as make it larger than the free memory
        check_role_memory(cfg, "rollout_server", CUDA, copies=free // 1000 + 1, trains=False)
    print(refused.value)


def test_device_inputs_on_cuda_are_the_processors(model_dir) -> None:
    """The shortcut's inputs, built on the GPU from the observations there, equal the
    processor's (float32, to the probe's tolerance), and so do the actions and log-probs."""
    policy = cuda_policy(model_dir, "float32")
    assert policy.device_inputs is not None
    obs = on_cuda(observations(16))
    fast_inputs, fast_lengths = policy._prompt_inputs(obs)
    fast = policy.act(obs, deterministic=True)
    policy.device_inputs = None
    slow_inputs, slow_lengths = policy._prompt_inputs(obs)
    slow = policy.act(obs, deterministic=True)
    assert torch.equal(fast_lengths, slow_lengths) and set(fast_inputs) == set(slow_inputs)
    for key, value in slow_inputs.items():
        assert fast_inputs[key].device.type == CUDA.type, key
        if value.is_floating_point():
            assert (fast_inputs[key] - value).abs().max() <= PROBE_ATOL, key
        else:
            assert torch.equal(fast_inputs[key], value), key
    assert torch.equal(fast.action, slow.action)
    torch.testing.assert_close(fast.log_prob, slow.log_prob, atol=1e-4, rtol=0)
