"""Every shipped launch YAML loads, builds its policy for its env, and warm starts line up.

The LIBERO and ManiSkill recipes always load; their policies are built for the simulator's own
spaces where it is installed and steps here (``sim/env_probe.py``), and skipped, saying why,
elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlvla3.config.run_config import load_config
from rlvla3.policy.factory import EnvSpaces, build_policy, env_spaces
from sim.env_probe import env_unavailable

LAUNCH = Path(__file__).resolve().parent.parent / "launch"
FILES = sorted(LAUNCH.glob("*.yaml"))
SIMULATORS = {"libero/": pytest.mark.libero, "maniskill/": pytest.mark.maniskill}
"""Env id prefix of an optional simulator -> its test marker."""
PROTOCOL_FLAG = {"libero/": "--suite libero_", "maniskill/": "--env maniskill/"}
"""How a recipe's ``rlvla3 eval`` line names the simulator's protocol (docs/evaluation.md)."""


def _simulator(path: Path) -> str | None:
    env_id = load_config(path).env.id
    return next((prefix for prefix in SIMULATORS if env_id.startswith(prefix)), None)


SIM_FILES = [p for p in FILES if _simulator(p)]
PLAIN_FILES = [p for p in FILES if not _simulator(p)]


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


@pytest.mark.parametrize("path", PLAIN_FILES, ids=lambda p: p.name)
def test_launch_file_builds_its_policy(path: Path, models: Path) -> None:
    cfg = _load(path, models)
    policy = build_policy(cfg, env_spaces(cfg))
    assert sum(p.numel() for p in policy.parameters()) > 0


def test_there_are_libero_and_maniskill_recipes() -> None:
    assert {_simulator(p) for p in SIM_FILES} == set(SIMULATORS)


@pytest.mark.parametrize("path", SIM_FILES, ids=lambda p: p.name)
def test_simulator_recipe_starts_only_from_its_init_checkpoint(path: Path) -> None:
    """A LIBERO / ManiSkill recipe learns only from a pretrained start: ``init_checkpoint`` is
    set (the one knob a user with a checkpoint changes, as its header says), nothing would
    silently train from scratch, and its header names the ``rlvla3 eval`` protocol."""
    cfg = load_config(path)
    assert cfg.policy.init_checkpoint and cfg.policy.init_launch is None
    assert cfg.policy.kind in ("vla", "token_vla")
    header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    assert "pretrained start" in header and "policy.init_checkpoint" in header
    assert f"rlvla3 eval runs/{cfg.run.name} {PROTOCOL_FLAG[_simulator(path)]}" in header


@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=SIMULATORS[_simulator(p)], id=p.name) for p in SIM_FILES],
)
def test_simulator_recipe_builds_its_policy_for_the_simulators_spaces(
    path: Path, models: Path
) -> None:
    cfg = _load(path, models)
    why = env_unavailable(cfg.env.id, json.dumps(cfg.env.kwargs))
    if why is not None:
        pytest.skip(why)
    from sim.envs import make_env

    env = make_env(cfg.env.id, seed=0, **cfg.env.kwargs)
    try:
        obs, _ = env.reset(seed=0)
        policy = build_policy(
            cfg, EnvSpaces(observation=env.observation_space, action=env.action_space)
        )
        with torch.no_grad():
            out = policy.act({k: torch.as_tensor(v[None]) for k, v in obs.items()})
            env_action = policy.to_env_action(out.action)[0].numpy()
        assert env_action.shape == env.action_space.shape  # one step of the simulator's action
        env.step(env_action)
    finally:
        env.close()
