"""The role table: one row per role, and everything keyed by role name reads it."""

from __future__ import annotations

import re

import pytest

from rlvla3.config.role_table import EVAL_ROLES, ROLE_TABLE, ROLES, STOP_ORDER, role_spec
from rlvla3.config.run_config import load_config
from tests.launching import REPO


@pytest.mark.parametrize("spec", ROLES, ids=lambda s: s.name)
def test_each_role_module_declares_its_role_name(spec) -> None:
    path = REPO / (spec.module.replace(".", "/") + ".py")
    declared = re.findall(r'^    name = "(\w+)"', path.read_text(), re.MULTILINE)
    assert declared == [spec.name], f"{path}: declares {declared}"


def test_producers_stop_before_their_consumers() -> None:
    assert sorted(STOP_ORDER) == sorted(ROLE_TABLE)
    order = STOP_ORDER.index
    assert order("env_worker") < order("rollout_server") < order("trainer")
    assert order("eval_env_worker") < order("eval_rollout_server")
    assert order("trainer") < order("weight_broadcaster")
    assert order("sft_trainer") < order("weight_broadcaster")


def test_evaluation_roles_and_unknown_names() -> None:
    assert EVAL_ROLES == ("eval_env_worker", "eval_rollout_server")
    with pytest.raises(KeyError, match="'trainr': unknown role .*trainer"):
        role_spec("trainr")


def test_num_processes_is_zero_for_a_role_the_run_lacks() -> None:
    cfg = load_config(None, ["roles.env_worker.count=3"])
    assert cfg.num_processes("env_worker") == 3
    assert cfg.num_processes("trainer") == 0
