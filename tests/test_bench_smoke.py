"""Every benchmark in its smoke mode: a broken benchmark fails here, not on the day it is run.

Each writes its JSON through ``bench.harness.provenance.write_result``; the test checks the stamp and
that results are there. (bench/gpu_suite.sh drives the GPU ones on a GPU machine;
bench/sdpa_backends.py says it needs one and exits 0 here.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launching import REPO

FROM_SCRATCH = [
    "--set",
    "policy.init_checkpoint=null",
    "--set",
    "policy.init_launch=null",
    "--set",
    "algo.ref_kl_coef=0",
    "--set",
    "algo.value_warmup_updates=0",
]
BENCHMARKS = {
    "async_vs_sync.py": [],
    "async_vs_sync_sim.py": ["--sims", "libero"],
    "checkpoint_curve.py": [],
    "codec_sockets.py": [],
    "critic_probe.py": ["launch/vla_tabletop.yaml", *FROM_SCRATCH],
    "data_parallel.py": [],
    "faults.py": [],
    "lora_sync.py": [],
    "main_job.py": [],
    "multi_node.py": [],
    "packing.py": [],
    "redis_fsync.py": [],
    "ppo_cartpole_reference.py": [],
    "rl_tabletop_probe.py": ["launch/vla_tabletop.yaml", *FROM_SCRATCH],
    "rollout_server.py": [],
    "round_trip_floor.py": [],
    "sft_tabletop_probe.py": ["--demo-dir", "{tmp}/demos"],
    "sim_throughput.py": [],
    "tabletop_failures.py": [],
    "stale_drops.py": [],
    "throughput.py": [],
    "token_vla_packing.py": [],
    "token_vla_scale.py": [],
    "token_vla_tabletop.py": [],
    "vla_step.py": [],
    "weight_sync.py": [],
}


def test_every_benchmark_script_is_covered() -> None:
    scripts = {p.name for p in (REPO / "bench").glob("*.py")}
    assert scripts - {"sdpa_backends.py"} == set(BENCHMARKS)


def run_bench(script: str, *args: str, timeout: float = 600, env=None):
    """``python bench/<script> <args>`` from the repository root; asserts it exits 0, showing
    its output's tail if not, and returns the finished process."""
    done = subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done


@pytest.mark.parametrize("script", sorted(BENCHMARKS))
def test_benchmark_smoke_mode_runs_and_writes_its_json(tmp_path, script: str) -> None:
    out = tmp_path / "result.json"
    extra = [a.replace("{tmp}", str(tmp_path)) for a in BENCHMARKS[script]]
    run_bench(script, *extra, "--smoke", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["benchmark"] == script.removesuffix(".py") and result["results"]
    stamp = result["provenance"]
    assert stamp["cpus"] and stamp["date_utc"] and "torch" in stamp["libraries"]
    assert result["settings"].get("smoke", True) is True  # (the PPO reference records its settings)


def test_the_gpu_only_benchmark_says_so_in_smoke_mode() -> None:
    run_bench("sdpa_backends.py", "--smoke", timeout=300)


def test_the_learning_run_with_plan_tokens_runs_both_stages(tmp_path) -> None:
    """``--plan``: the plan-token launch files, SFT on demos that carry the plan's labels (it
    would stop at its first batch without them) and RL with them in the loss."""
    pytest.importorskip("transformers")
    out = tmp_path / "result.json"
    run_bench("token_vla_tabletop.py", "--plan", "--smoke", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["settings"]["plan"] is True
    sft, rl = result["results"]["sft"], result["results"]["rl"]
    assert "sft finished" in sft["stop_reason"] and rl["env_steps"] >= 300


def test_the_sft_probe_takes_any_policy_family_from_a_launch_yaml(tmp_path) -> None:
    pytest.importorskip("transformers")
    from rlvla3.policy.presets import write_vlm

    model = write_vlm(tmp_path / "model", "llava", "test")
    out = tmp_path / "result.json"
    args = ["--config", "launch/sft_token_vla_tabletop.yaml", "--demo-dir", str(tmp_path)]
    args += ["--set", f"policy.token_vla.path={model}", "--set", "policy.token_vla.bins=3"]
    done = run_bench("sft_tabletop_probe.py", *args, "--smoke", "--json", str(out), timeout=300)
    result = json.loads(out.read_text())["results"]
    assert result["args"]["env_id"] == "rlvla3/TableTopEasy-v0"  # the YAML's task, not the flag's
    assert "token_vla" in done.stdout and result["curve"][-1]["step"] == 3


def test_the_simulator_benchmark_skips_absent_simulators_and_says_so(tmp_path) -> None:
    """Where LIBERO and ManiSkill are not installed (the README's test command on a clean
    machine), the smoke says so for each, writes its JSON and exits 0."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.util as u\n"
        "_find = u.find_spec\n"
        "u.find_spec = lambda name, *a: None if name in ('libero', 'mani_skill') else _find(name, *a)\n"
    )
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), str(REPO)])}
    done = run_bench("async_vs_sync_sim.py", "--smoke", "--json", str(out), timeout=300, env=env)
    assert done.stdout.count("not installed") == 2
    for sim in ("libero", "maniskill"):
        assert f"{sim}: skipped: " in done.stdout
        assert "not installed" in json.loads(out.read_text())["results"][sim]["skipped"]
