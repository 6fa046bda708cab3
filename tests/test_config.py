"""Config loading: typed, strict, errors name the key path, overrides, resolved dump."""

from __future__ import annotations

import os

import pytest
import yaml

from rlvla3.config.run_config import (
    Config,
    config_from_dict,
    dump_config,
    dump_config_with_defaults,
    load_config,
)
from rlvla3.config.typed_load import ConfigError
from rlvla3.runtime.cpu_pinning import pin_to_cpus


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return str(info.value)


def test_defaults_load_without_a_file() -> None:
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    assert cfg.run.mode == "async" and cfg.nodes[0].name == "local"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"roles": {"trainer": {"cuont": 2}}}, "roles.trainer.cuont: unknown key"),
        ({"run": {"mode": "fast"}}, "run.mode: 'fast' is not one of"),
        ({"run": {"seed": "zero"}}, "run.seed: expected int"),
        ({"run": {"stop": {"max_env_steps": 1.5}}}, "run.stop.max_env_steps: expected int"),
        ({"roles": {"nope": {}}}, "roles.nope: unknown role"),
        ({"roles": {"trainer": {"node": "gpu9"}}}, "roles.trainer.node: no node or group named"),
        (
            {"roles": {"env_worker": {"settings": {"rate": 1}}}},
            "roles.env_worker.settings.rate: unknown key",
        ),
        ({"nodes": [{"host": "a"}]}, "nodes[0].name: missing required key"),
        ({"bogus": 1}, "bogus: unknown key"),
        ({"policy": {"vla": {"d_modle": 64}}}, "policy.vla.d_modle: unknown key"),
        ({"policy": {"vla": {"film": "yes"}}}, "policy.vla.film: expected bool"),
        (
            {"policy": {"vla": {"d_model": 96, "num_heads": 5}}},
            "policy.vla: invalid VLAConfig: d_model must",
        ),
        ({"sft": {"expert_noise": -0.1}}, "sft.expert_noise: must be >= 0"),
        ({"roles": {"trainer": {"cpus": []}}}, "roles.trainer.cpus: a non-empty list"),
        ({"roles": {"trainer": {"cpus": [-1]}}}, "roles.trainer.cpus: a non-empty list"),
        ({"roles": {"trainer": {"cpus": ["a"]}}}, "roles.trainer.cpus[0]: expected int"),
        ({"algo": {"lr": -1}}, "algo.lr: must be > 0, got -1"),
        ({"algo": {"gamma": 2}}, "algo.gamma: must be <= 1, got 2"),
        ({"run": {"stop": {"return_window": 0}}}, "run.stop.return_window: must be >= 1"),
        (
            {"roles": {"trainer": {"restart": {"max_restarts": -1}}}},
            "roles.trainer.restart.max_restarts: must be >= 0",
        ),
        (
            {"roles": {"rollout_server": {"settings": {"max_batch": 0}}}},
            "roles.rollout_server.settings.max_batch: must be >= 1",
        ),
        ({"run": {"name": "my run"}}, "run.name: 'my run' must be non-empty, not start with"),
        ({"run": {"name": ".."}}, "run.name: '..' must be non-empty, not start with '.'"),
        ({"algo": {"ent_coef": float("nan")}}, "algo.ent_coef: must be a finite number"),
        ({"algo": {"lr": 10**400}}, "algo.lr: a 401-digit number is too large"),
        ({"run": {"seed": 2**64}}, "run.seed: must be <= 9223372036854775807"),
        ({"roles": {"trainer": {"count": 10**20}}}, "roles.trainer.count: must be <= 4096"),
        ({"run": {"name": "a/b"}}, "run.name: 'a/b' must be non-empty"),
    ],
)
def test_errors_name_the_key_path(raw: dict, message: str) -> None:
    assert _error(raw).startswith(message)


def test_overrides_are_typed_and_validated(tmp_path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"roles": {"trainer": {"count": 1}}}))
    cfg = load_config(path, ["roles.env_worker.count=3", "run.mode=sync", "run.stop.max_wall_s=2"])
    assert cfg.roles["env_worker"].count == 3 and cfg.run.mode == "sync"
    assert cfg.run.stop.max_wall_s == 2.0
    with pytest.raises(ConfigError, match="roles.trainer.count: expected int"):
        load_config(path, ["roles.trainer.count=many"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(path, ["run.mode"])


def test_yaml_anchors_merge_keys_and_aliases_are_copies(tmp_path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "roles:\n"
        "  env_worker: &worker {count: 2, restart: {max_restarts: 5}}\n"
        "  trainer:\n    <<: *worker\n    count: 1\n"
        "  rollout_server: *worker\n"
        "  weight_broadcaster: {count: 1}\n"
    )
    cfg = load_config(path, ["roles.env_worker.restart.max_restarts=9"])
    assert cfg.roles["trainer"].count == 1 and cfg.roles["rollout_server"].count == 2
    assert cfg.roles["env_worker"].restart.max_restarts == 9
    assert cfg.roles["rollout_server"].restart.max_restarts == 5  # an alias is a copy
    assert cfg.roles["trainer"].restart.max_restarts == 5


def test_yaml_reads_scalars_as_yaml_1_2_does(tmp_path) -> None:
    """``3e-4`` is a float (PyYAML's YAML 1.1 reads a string), ``on`` is a string (not True)."""
    path = tmp_path / "cfg.yaml"
    path.write_text("algo: {lr: 3e-4, gamma: 1e0}\nrun: {name: on, seed: 017}\n")
    cfg = load_config(path, ["sft.lr=1e-3", "run.stop.max_env_steps=1_000"])
    assert (cfg.algo.lr, cfg.algo.gamma, cfg.sft.lr) == (3e-4, 1.0, 1e-3)
    assert cfg.run.name == "on" and cfg.run.seed == 17  # not YAML 1.1's octal 15
    assert cfg.run.stop.max_env_steps == 1000
    with pytest.raises(ConfigError, match="run.stop.max_wall_s: expected float, got str '1:30'"):
        load_config(path, ["run.stop.max_wall_s=1:30"])  # not YAML 1.1's sexagesimal 90


def test_unreadable_or_misshapen_files_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"nope.yaml: cannot read the launch YAML \(No such"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="cannot read the launch YAML"):
        load_config(tmp_path)  # a directory
    listed = tmp_path / "list.yaml"
    listed.write_text("- run\n- roles\n")
    with pytest.raises(ConfigError, match="list.yaml: the top level must be a mapping"):
        load_config(listed)
    twice = tmp_path / "twice.yaml"
    twice.write_text("algo:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(
        ConfigError, match="twice.yaml: not valid YAML: line 3, column 3: duplicate"
    ):
        load_config(twice)
    with pytest.raises(ConfigError, match="not valid YAML: line 1, column 4: a key must be"):
        load_config(None, ["run={? [a, b] : 1}"])
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(ConfigError, match="deep.yaml: not valid YAML: nested too deeply"):
        load_config(deep)
    with pytest.raises(ConfigError, match="--set 'run.name=\\[': the value is not valid YAML"):
        load_config(None, ["run.name=["])


def test_resolved_dump_round_trips() -> None:
    cfg = load_config(None, ["roles.env_worker.count=2", "roles.env_worker.node=[local]"])
    again = config_from_dict(yaml.safe_load(dump_config(cfg)))
    assert again == cfg
    assert again.placement("env_worker") == ["local", "local"]


def test_config_command_prints_every_default_and_loads_back() -> None:
    cfg = load_config("launch/vla_tabletop.yaml", ["roles.trainer.settings.keep_checkpoints=3"])
    shown = yaml.safe_load(dump_config_with_defaults(cfg))
    assert shown["roles"]["trainer"]["settings"] == {
        "device": "cpu",
        "num_threads": 1,
        "chunk_queue_hwm": 256,
        "keep_checkpoints": 3,
        "shard": False,
    }
    assert shown["roles"]["env_worker"]["settings"]["request_timeout_s"] == 10.0
    vla = shown["policy"]["vla"]
    assert vla["d_model"] == 64 and vla["stem_channels"] == 16  # given / default
    assert "image_size" not in vla and "action_dim" not in vla  # the env's spaces decide them
    again = config_from_dict(shown)
    assert again.role_settings("trainer") == cfg.role_settings("trainer")
    assert again.run == cfg.run and again.algo == cfg.algo


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["roles.eval_env_worker.count=1"], "roles.eval_env_worker: periodic evaluation is off"),
        (["run.stop.target_eval_success_rate=0.9"], "needs periodic evaluation"),
        (["run.eval.every_versions=5"], "roles.eval_env_worker.count: .* needs exactly one"),
        (
            ["run.eval.every_versions=5", "roles.eval_env_worker.count=1"],
            "roles.eval_rollout_server.count",
        ),
        (
            [
                "run.eval.every_versions=5",
                "roles.eval_env_worker.count=2",
                "roles.eval_rollout_server.count=1",
            ],
            r"roles.eval_env_worker.count: .* \(has 2\)",
        ),
    ],
)
def test_periodic_evaluation_needs_one_of_each_eval_role(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("launch/cartpole.yaml", sets)
    ok = [
        "run.eval.every_versions=5",
        "roles.eval_env_worker.count=1",
        "roles.eval_rollout_server.count=1",
    ]
    assert load_config("launch/cartpole.yaml", ok).run.eval.every_versions == 5


def test_placement_spreads_round_robin() -> None:
    cfg = config_from_dict(
        {
            "nodes": [{"name": "a"}, {"name": "b"}],
            "roles": {"env_worker": {"count": 3, "node": ["a", "b"]}},
        }
    )
    assert cfg.placement("env_worker") == ["a", "b", "a"]


def test_a_settings_value_check_names_where_it_failed() -> None:
    with pytest.raises(
        ConfigError, match=r"^roles\.env_worker\.settings\.max_chunks_queued: must be >= 0"
    ):
        config_from_dict({"roles": {"env_worker": {"settings": {"max_chunks_queued": -1}}}})


def test_pinning_to_a_cpu_the_node_lacks_names_the_field() -> None:
    before = os.sched_getaffinity(0)
    pin_to_cpus(None)  # no pinning: nothing changes
    with pytest.raises(ConfigError, match=r"roles.trainer.cpus: this node has no CPU \[100000\]"):
        pin_to_cpus([0, 100_000], "roles.trainer.cpus")
    assert os.sched_getaffinity(0) == before  # refused before anything changed


def test_launch_refuses_a_run_without_roles_or_with_a_missing_checkpoint(tmp_path) -> None:
    from rlvla3.launch.command import launch

    with pytest.raises(ConfigError, match="roles: no role processes to start in this config"):
        launch(None, out=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="policy.init_checkpoint: no checkpoint at /nowhere"):
        launch(
            None,
            ["roles.trainer.count=1", "policy.init_checkpoint=/nowhere"],
            out=str(tmp_path / "run"),
        )
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["roles.weight_broadcaster.count=0"], "roles.weight_broadcaster: a trainer's weights"),
        (["env.envs_per_request=3"], "env.envs_per_request: 3 does not divide"),
        (["env.vectorized=true", "algo.kind=grpo"], "env.vectorized: a vector env resets"),
        (["env.id=rlvla3/TableTop-v0", "env.vectorized=true"], "is not a gymnasium env"),
    ],
)
def test_env_groups_and_the_weight_path_are_checked_at_load(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("launch/cartpole.yaml", sets)
    inference_only = ["roles.trainer.count=0", "roles.weight_broadcaster.count=0"]
    assert load_config("launch/cartpole.yaml", inference_only).roles["trainer"].count == 0


def test_policy_vla_is_typed_and_the_env_decides_what_it_leaves_out() -> None:
    cfg = load_config(None, ["policy.kind=vla", "policy.vla={d_model: 32, channels: 1}"])
    vla = cfg.policy.vla
    assert vla.d_model == 32 and vla.channels == 1 and vla.image_size is None
    built = vla.resolved({"image_size": 96, "channels": 3, "action_head": "categorical"})
    assert (built.image_size, built.channels, built.action_head) == (96, 1, "categorical")
    assert built.proprio_dim == 8  # the env has no such space: the value without an env
    assert config_from_dict(yaml.safe_load(dump_config(cfg))) == cfg


def test_sync_mode_takes_one_round_per_update_or_says_what_a_round_is() -> None:
    """In sync mode the envs pause after each round until the next version: a batch other
    than one round would leave the trainer waiting for steps that never come."""
    cfg = load_config("launch/cartpole.yaml", ["run.mode=sync"])
    round_steps = cfg.round_steps()
    env = cfg.env
    assert round_steps == cfg.num_processes("env_worker") * env.num_envs_per_worker * env.chunk_len
    for steps in (0, round_steps):
        load_config("launch/cartpole.yaml", ["run.mode=sync", f"algo.batch_steps={steps}"])
    for steps in (round_steps // 2, 2 * round_steps):
        with pytest.raises(
            ConfigError,
            match=rf"algo.batch_steps: {steps} in run.mode sync, .* round of "
            rf"{round_steps} env steps .*set 0 \(one round\) or {round_steps}",
        ):
            load_config("launch/cartpole.yaml", ["run.mode=sync", f"algo.batch_steps={steps}"])
        for mode in ("async", "async_rollout"):  # their envs never wait for a version
            load_config("launch/cartpole.yaml", [f"run.mode={mode}", f"algo.batch_steps={steps}"])
