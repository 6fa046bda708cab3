"""Which device each role instance runs on: ``settings.device`` against its node's ``devices``
(``rlvla3/config/devices.py``), and the launcher handing it to the process. No GPU needed: the
plan is strings, the spawn is recorded, not run."""

from __future__ import annotations

import threading

import pytest

from rlvla3.config.role_settings import TrainerSettings
from rlvla3.config.run_config import load_config
from rlvla3.config.typed_load import ConfigError
from rlvla3.launch import processes
from rlvla3.launch.processes import SpawnContext
from rlvla3.launch.supervisor import RoleSupervisor
from rlvla3.runtime.role import Role

TWO_GPUS = "nodes=[{name: learner, devices: [cpu, cuda:0, cuda:1]}, {name: sim, count: 2}]"


def config(*overrides: str):
    return load_config(
        None,
        ["run.redis_url=redis://127.0.0.1:1/0", "roles.weight_broadcaster.count=1", *overrides],
    )


def test_ranks_on_a_node_take_its_gpus_in_turn() -> None:
    cfg = config(
        TWO_GPUS,
        "roles.trainer.count=2",
        "roles.trainer.node=learner",
        "roles.trainer.settings.device=cuda",
    )
    assert cfg.device_plan("trainer") == ["cuda:0", "cuda:1"]
    assert cfg.placed_settings("trainer", 1).device == "cuda:1"


def test_a_group_of_nodes_gives_each_rank_its_own_nodes_first_gpu() -> None:
    cfg = config(
        "nodes=[{name: learner, count: 2, devices: [cuda:0, cuda:1]}]",
        "roles.trainer.count=2",
        "roles.trainer.node=learner",
        "roles.trainer.settings.device=cuda",
        "roles.rollout_server.count=3",
        "roles.rollout_server.node=learner",
        "roles.rollout_server.settings.device=cuda",
    )
    assert cfg.placement("trainer") == ["learner-0", "learner-1"]
    assert cfg.device_plan("trainer") == ["cuda:0", "cuda:0"]  # instance 0 on each node
    # rollout servers 0 and 2 on learner-0 (its 1st and 2nd), 1 on learner-1
    assert cfg.device_plan("rollout_server") == ["cuda:0", "cuda:0", "cuda:1"]


def test_cpu_stays_cpu_and_an_explicit_device_wins() -> None:
    cfg = config(
        "nodes=[{name: learner, devices: [cpu]}]",
        "roles.trainer.count=1",
        "roles.env_worker.count=2",
    )
    assert cfg.device_plan("trainer") == ["cpu"]
    assert cfg.placed_settings("trainer", 0).device == "cpu"
    assert cfg.device_plan("env_worker") == [None, None]  # no device setting
    cfg = config(
        TWO_GPUS,
        "roles.trainer.node=learner",
        "roles.trainer.settings.device=cuda:1",
        "roles.rollout_server.node=learner",
    )
    assert cfg.device_plan("trainer") == ["cuda:1"]
    assert cfg.device_plan("rollout_server") == ["cpu"]  # the default, on a GPU node too


def test_a_node_without_devices_listed_takes_the_setting_as_written() -> None:
    cfg = config("roles.trainer.settings.device=cuda", "roles.rollout_server.count=2")
    assert cfg.nodes[0].devices is None
    assert cfg.device_plan("trainer") == ["cuda"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (  # three ranks, two GPUs
            [TWO_GPUS, "roles.trainer.count=3", "roles.trainer.settings.device=cuda"],
            r"^nodes\[0\]\.devices: trainer ranks 0 and 2 would share cuda:0 on node 'learner'",
        ),
        (  # one GPU named for two ranks of one node
            [TWO_GPUS, "roles.sft_trainer.count=2", "roles.sft_trainer.settings.device=cuda:0"],
            r"^roles\.sft_trainer\.settings\.device: sft_trainer ranks 0 and 1 would share",
        ),
        (  # a GPU asked of a node that lists none
            ["nodes=[{name: box, devices: [cpu]}]", "roles.trainer.settings.device=cuda"],
            r"^nodes\[0\]\.devices: node 'box' lists no cuda device",
        ),
        (  # an explicit device the node does not list
            [TWO_GPUS, "roles.rollout_server.settings.device=cuda:2"],
            r"^roles\.rollout_server\.settings\.device: 'cuda:2' is not among node 'learner'",
        ),
        (
            ["nodes=[{name: box, devices: [cuda]}]", "roles.trainer.count=1"],
            r"^nodes\[0\]\.devices: \['cuda'\] must list distinct devices",
        ),
        (["nodes=[{name: box, devices: []}]"], r"^nodes\[0\]\.devices: \[\] must list"),
    ],
    ids=["too_few_gpus", "one_gpu_named", "no_gpu_listed", "not_listed", "no_index", "empty"],
)
def test_a_placement_the_nodes_cannot_serve_is_refused_naming_the_field(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        config(*overrides)


def test_ranks_may_share_a_gpu_with_nccl_shared_gpu() -> None:
    cfg = config(
        TWO_GPUS,
        "roles.trainer.count=3",
        "roles.trainer.node=learner",
        "roles.trainer.settings.device=cuda",
        "run.nccl_shared_gpu=true",
    )
    assert cfg.device_plan("trainer") == ["cuda:0", "cuda:1", "cuda:0"]


class _Probe(Role[TrainerSettings]):
    name = "trainer"

    def step(self) -> None:
        raise AssertionError("never run")


def test_the_launcher_hands_each_rank_its_device(tmp_path, monkeypatch) -> None:
    cfg = config(
        TWO_GPUS,
        "roles.trainer.count=2",
        "roles.trainer.node=learner",
        "roles.trainer.settings.device=cuda",
        "roles.env_worker.node=sim",
    )
    started: list[list[str]] = []

    class _Recorded:
        def __init__(self, args, **_: object) -> None:
            started.append(args)

    monkeypatch.setattr(processes.subprocess, "Popen", _Recorded)
    (tmp_path / "logs").mkdir()
    supervisor = RoleSupervisor(cfg, tmp_path, None, print, threading.Event())  # type: ignore[arg-type]
    ctx = SpawnContext(config_path=tmp_path / "config.yaml", run_dir=tmp_path, address="127.0.0.1")
    supervisor.start(ctx, ["learner", "sim-0"])
    handed = {
        (args[args.index("--index") + 1], args[args.index("--node") + 1]): (
            args[args.index("--device") + 1] if "--device" in args else None
        )
        for args in started
        if "roles.trainer" in args or "roles.env_worker" in args
    }
    assert handed == {("0", "learner"): "cuda:0", ("1", "learner"): "cuda:1", ("0", "sim-0"): None}
    # what the role process makes of it: its settings.device
    role = _Probe(cfg, 1, node="learner", run_dir=tmp_path, device="cuda:1")
    assert role.settings.device == "cuda:1"
    assert _Probe(cfg, 0, node="learner", run_dir=tmp_path).settings.device == "cuda:0"
