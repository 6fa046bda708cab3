"""Every shipped launch YAML loads, builds its policy for its env, and warm starts line up."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlvla3.config.run_config import load_config
from rlvla3.policy.factory import build_policy, env_spaces

LAUNCH = Path(__file__).resolve().parent.parent / "launch"
FILES = sorted(LAUNCH.glob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_launch_file_builds_its_policy(path: Path) -> None:
    cfg = load_config(path)
    policy = build_policy(cfg, env_spaces(cfg))
    assert sum(p.numel() for p in policy.parameters()) > 0


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ("sft_tabletop_easy.yaml", "vla_tabletop.yaml"),
        ("sft_tabletop.yaml", "sft_then_rl_tabletop.yaml"),
        ("sft_tabletop_weak.yaml", "vla_tabletop_weak.yaml"),
        ("sft_tabletop_full_weak.yaml", "vla_tabletop_full_weak.yaml"),
    ],
)
def test_rl_yaml_loads_the_weights_its_sft_yaml_writes(first: str, then: str) -> None:
    sft, rl = load_config(LAUNCH / first), load_config(LAUNCH / then)
    assert rl.policy.init_checkpoint == f"{sft.run.output_dir}/{sft.run.name}"
    assert rl.policy.init_launch == f"launch/{first}"  # one command runs both stages
    # Same architecture and env spaces, or the checkpoint's tensors would not fit.
    a, b = build_policy(sft, env_spaces(sft)), build_policy(rl, env_spaces(rl))
    shapes = {k: v.shape for k, v in a.state_dict().items()}
    assert shapes == {k: v.shape for k, v in b.state_dict().items()}
