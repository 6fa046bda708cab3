"""Every shipped launch YAML loads, builds its policy for its env, and warm starts line up."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlvla3.config.run_config import load_config
from rlvla3.policy.factory import build_policy, env_spaces

LAUNCH = Path(__file__).resolve().parent.parent / "launch"
FILES = sorted(LAUNCH.glob("*.yaml"))


def _load(path: Path, models: Path):
    """The launch file's config; a token VLA's preset written to ``models`` (as ``rlvla3 launch``
    writes it to the file's own path, which a clean clone does not have)."""
    cfg = load_config(path)
    if cfg.policy.kind != "token_vla" or not cfg.policy.token_vla.preset:
        return cfg
    from rlvla3.policy.presets import ensure_preset

    model = models / cfg.policy.token_vla.preset
    ensure_preset(str(model), cfg.policy.token_vla.preset)
    return load_config(path, [f"policy.token_vla.path={model}"])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_launch_file_builds_its_policy(path: Path, models: Path) -> None:
    cfg = _load(path, models)
    policy = build_policy(cfg, env_spaces(cfg))
    assert sum(p.numel() for p in policy.parameters()) > 0


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ("sft_tabletop_easy.yaml", "vla_tabletop.yaml"),
        ("sft_tabletop.yaml", "sft_then_rl_tabletop.yaml"),
        ("sft_tabletop_weak.yaml", "vla_tabletop_weak.yaml"),
        ("sft_tabletop_full_weak.yaml", "vla_tabletop_full_weak.yaml"),
        ("sft_token_vla_tabletop.yaml", "token_vla_tabletop.yaml"),
    ],
)
def test_rl_yaml_loads_the_weights_its_sft_yaml_writes(first: str, then: str, models: Path) -> None:
    sft, rl = _load(LAUNCH / first, models), _load(LAUNCH / then, models)
    assert rl.policy.init_checkpoint == f"{sft.run.output_dir}/{sft.run.name}"
    assert rl.policy.init_launch == f"launch/{first}"  # one command runs both stages
    # Same architecture and env spaces, or the checkpoint's tensors would not fit.
    a, b = build_policy(sft, env_spaces(sft)), build_policy(rl, env_spaces(rl))
    shapes = {k: v.shape for k, v in a.state_dict().items()}
    assert shapes == {k: v.shape for k, v in b.state_dict().items()}
