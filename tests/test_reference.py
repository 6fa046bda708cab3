"""The generated references match the code, every config field is documented, and every
counter and gauge the code uses is listed (with its meaning) in rlvla3/runtime/metric_names.py."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from rlvla3 import reference
from rlvla3.runtime.metric_names import COUNTERS, GAUGES
from tests.launching import REPO


def test_the_reference_pages_are_up_to_date() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rlvla3.reference", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("section", "cls"), reference._sections())
def test_every_config_field_has_its_own_doc(section: str, cls: type) -> None:
    docs = reference.field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not missing, f"{section}: fields without a doc line: {missing}"


def test_every_nested_section_the_config_page_points_to_is_on_it() -> None:
    page = (REPO / "docs" / "config.md").read_text()
    pointed = set(re.findall(r"see `([a-z_.]+)`", page))
    missing = {name for name in pointed if f"## `{name}`" not in page}
    assert pointed and not missing


def test_every_counter_and_gauge_in_the_code_is_listed() -> None:
    pattern = re.compile(r"\.(count|drop|gauge)\(\s*\"([a-z_]+)\"")
    used = {"count": set(), "drop": set(), "gauge": set()}
    for package in ("rlvla3", "roles", "sft", "sim", "transport"):
        for path in (REPO / package).rglob("*.py"):
            for kind, name in pattern.findall(path.read_text()):
                used[kind].add(name)
    assert used["count"] and used["gauge"]  # the scan finds them at all
    unlisted = (used["count"] | used["drop"]) - set(COUNTERS) | used["gauge"] - set(GAUGES)
    assert not unlisted, f"not in rlvla3/runtime/metric_names.py: {sorted(unlisted)}"


def test_a_role_refuses_an_unlisted_counter(tmp_path, redis_url) -> None:
    from rlvla3.config.run_config import load_config
    from rlvla3.runtime.role import Role

    class Probe(Role):
        name = "trainer"

        def step(self) -> None:
            pass

    cfg = load_config(None, ["roles.trainer.count=1", f"run.redis_url={redis_url}"])
    role = Probe(cfg, 0, node="local", run_dir=tmp_path)
    role.count("env_steps")
    with pytest.raises(
        KeyError, match="counter 'env_stpes': not in rlvla3/runtime/metric_names.py"
    ):
        role.count("env_stpes")
    with pytest.raises(KeyError, match="gauge 'qeue_depth'"):
        role.gauge("qeue_depth", 1)
