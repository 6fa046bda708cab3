"""``rlvla3 eval`` (docs/evaluation.md): the protocols' episode lists, the Wilson interval, and
real evaluations of a tiny table-top checkpoint: two workers give the same episodes as one, and
a killed evaluation resumes without playing a recorded episode again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from rlvla3.launch.eval_report import read_episodes, wilson_interval
from sim.protocols import ProtocolEpisode, maniskill_protocol, protocol_for, seeded_protocol
from tests.conftest import wait_until
from tests.launching import REPO, eval_command, run_eval, write_checkpoint_run

ENV = "rlvla3/TableTopEasy-v0"


def test_wilson_interval_matches_known_values() -> None:
    assert wilson_interval(0, 12) == pytest.approx((0.0, 0.24249), abs=1e-5)
    assert wilson_interval(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    assert wilson_interval(50, 50) == pytest.approx((0.92865, 1.0), abs=1e-5)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_seeded_and_maniskill_protocols_list_their_seeds() -> None:
    seeded = protocol_for(suite=None, env_id=ENV, episodes=5, seed=7)
    assert [e.seed for e in seeded.episodes] == [7, 8, 9, 10, 11]
    assert [e.index for e in seeded.episodes] == list(range(5))
    assert len({e.key for e in seeded.episodes}) == 5
    ms = maniskill_protocol("maniskill/PickCube-v1", episodes=3)
    assert [e.seed for e in ms.episodes] == [0, 1, 2]
    assert all(e.ignore_terminations for e in ms.episodes)  # full-length episodes
    assert ms.episodes[0].env_kwargs == {"env_kwargs": {"reconfiguration_freq": 1}}
    assert ms.success_metric == "success_once"


def test_protocol_episodes_round_trip_and_bad_ones_are_named() -> None:
    episode = seeded_protocol(ENV, 2).episodes[1]
    assert ProtocolEpisode.from_dict(json.loads(json.dumps(episode.to_dict()))) == episode
    bad = episode.to_dict() | {"seed": True}
    with pytest.raises(ValueError, match="'seed'"):
        ProtocolEpisode.from_dict(bad)
    with pytest.raises(ValueError, match="unknown fields"):
        ProtocolEpisode.from_dict(episode.to_dict() | {"extra": 1})
    with pytest.raises(ValueError, match="mapping"):
        ProtocolEpisode.from_dict([1, 2])


def test_bad_arguments_are_refused_naming_them(tmp_path: Path) -> None:
    from rlvla3.config.typed_load import ConfigError
    from rlvla3.launch.eval_command import EvalRequest, evaluate

    for episodes in (0, -3):
        with pytest.raises(ConfigError, match=f"--episodes: need at least 1, got {episodes}"):
            evaluate(EvalRequest(source=str(tmp_path), episodes=episodes))
    with pytest.raises(ConfigError, match="--seed: need at least 0, got -1"):
        evaluate(EvalRequest(source=str(tmp_path), seed=-1))
    with pytest.raises(ConfigError, match="LIBERO env ids look like 'libero/libero_spatial/0'"):
        evaluate(EvalRequest(source=_checkpoint_run(tmp_path), env="libero/libero_spatial"))


def _checkpoint_run(tmp_path: Path) -> str:
    """A run dir with a config.yaml and one (empty) checkpoint: enough to name a protocol."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "ckpt_00000001.pt").write_bytes(b"x")
    (run / "config.yaml").write_text(f"env: {{id: {ENV}}}\n")
    return str(run)


def test_a_training_run_dir_is_no_place_for_results(tmp_path: Path) -> None:
    from rlvla3.config.typed_load import ConfigError
    from rlvla3.launch.eval_command import STAMP_FILE, _resume

    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds a run that is not an evaluation"):
        _resume(tmp_path, seeded_protocol(ENV, 2), {"checkpoint": "c.pt"})
    assert not (tmp_path / STAMP_FILE).exists()


def test_the_progress_line_counts_a_resumed_evaluations_earlier_episodes(
    tmp_path: Path, registry
) -> None:
    from rlvla3.launch.eval_command import ProtocolHooks

    protocol = seeded_protocol(ENV, 5)
    listed = [e.to_dict() for e in protocol.episodes[2:]]
    hooks = ProtocolHooks(protocol, tmp_path / "episodes.jsonl", listed, workers=1)
    hooks.count_earlier([{"success": True}, {"success": False}])
    assert "2/5 episodes, success 0.500" in hooks.progress_line(registry, 10.0)
    hooks._record([{"key": protocol.episodes[2].key, "success": True}])
    assert "3/5 episodes, success 0.667" in hooks.progress_line(registry, 10.0)


def test_a_grpo_checkpoint_evaluates_under_one_env_per_worker() -> None:
    """Nothing trains in an evaluation: GRPO's group size (which must divide the envs per
    worker) does not stop a GRPO run's checkpoint from being evaluated."""
    from rlvla3.config.run_config import load_config
    from rlvla3.launch.eval_command import EvalRequest, eval_config

    base = load_config(None, [f"env.id={ENV}", "algo.kind=grpo", "algo.group_size=4"])
    cfg = eval_config(base, seeded_protocol(ENV, 2), Path("c.pt"), EvalRequest(source="c.pt"))
    assert cfg.env.num_envs_per_worker == 1 and cfg.algo.kind == "ppo"


def test_the_run_and_the_results_dir_are_named_alike() -> None:
    from rlvla3.config.run_config import load_config
    from rlvla3.launch.eval_command import EvalRequest, _out_dir, eval_config
    from roles.env.protocol_runner import video_name

    protocol = seeded_protocol("odd/Task name:v0", 2)
    request = EvalRequest(source="c.pt")
    checkpoint = Path("/runs/r/checkpoints/c.pt")
    cfg = eval_config(load_config(None, [f"env.id={ENV}"]), protocol, checkpoint, request)
    assert cfg.run.name == _out_dir(request, checkpoint, protocol).name == "eval-odd-Task-name-v0"
    assert video_name(protocol.episodes[1]) == "00001_odd_Task_name_v0_seed1.gif"


def _records(path: Path, keys: list[str]) -> None:
    lines = [json.dumps({"key": k, "task": "t", "success": True}) + "\n" for k in keys]
    path.write_text("".join(lines) + '{"key": "torn')


def test_an_out_holding_another_evaluation_is_refused_and_kept(tmp_path: Path) -> None:
    """Fewer episodes, other seeds or other overrides into the same --out are refused, and
    the results there stay; a torn last line is all that resuming drops."""
    from rlvla3.config.typed_load import ConfigError
    from rlvla3.launch.eval_command import _resume

    full = seeded_protocol(ENV, 5)
    jsonl = tmp_path / "episodes.jsonl"
    meta = {"checkpoint": "c.pt", "greedy": True, "overrides": []}
    _records(jsonl, [e.key for e in full.episodes])
    assert len(_resume(tmp_path, full, meta)) == 5
    assert jsonl.read_text().count("\n") == 5 and "torn" not in jsonl.read_text()
    others = [
        (seeded_protocol(ENV, 1), meta),
        (seeded_protocol(ENV, 5, seed=1), meta),
        (full, meta | {"overrides": ["env.kwargs.max_episode_steps=9"]}),
    ]
    for protocol, other in others:
        with pytest.raises(ConfigError, match=f"--out {tmp_path}: holds the results of another"):
            _resume(tmp_path, protocol, other)
    assert len(read_episodes(jsonl)) == 5


def test_resuming_under_a_stamp_without_the_episode_list_keeps_every_record(
    tmp_path: Path,
) -> None:
    from rlvla3.launch.eval_command import STAMP_FILE, _resume

    full = seeded_protocol(ENV, 5)
    (tmp_path / STAMP_FILE).write_text(json.dumps({"checkpoint": "c.pt", "protocol": ENV}))
    _records(tmp_path / "episodes.jsonl", [e.key for e in full.episodes])
    done = _resume(tmp_path, seeded_protocol(ENV, 2), {"checkpoint": "c.pt", "overrides": []})
    assert len(done) == 2 and len(read_episodes(tmp_path / "episodes.jsonl")) == 5


def test_an_episode_whose_players_keep_dying_is_given_up_after_three_plays(registry) -> None:
    """Each time its player dies the episode goes back first in line, until the third death:
    then it leaves the list, for the launcher to record as failed, and the next one is played."""
    from rlvla3.runtime.eval_queue import EvalQueue

    queue = EvalQueue(registry)
    first, second = (e.to_dict() for e in seeded_protocol(ENV, 2).episodes)
    queue.fill([first, second])
    for pid in (101, 102):
        claim = queue.take("eval_env_worker/0", pid)
        assert claim is not None and claim.data() == first
        assert queue.pending() == (1, 1)
        assert queue.requeue_orphans(lambda worker, p, dead=pid: p > dead) == []  # put back
    claim = queue.take("eval_env_worker/0", 103)
    assert claim is not None and claim.data() == first
    assert queue.requeue_orphans(lambda worker, p: False) == [claim.raw]
    assert queue.pending() == (1, 0)
    nxt = queue.take("eval_env_worker/0", 104)
    assert nxt is not None and nxt.data() == second
    queue.finish(nxt, {"key": second["key"]})
    assert queue.pending() == (0, 0) and queue.results(0) == [{"key": second["key"]}]


def test_a_given_up_episode_is_recorded_failed_with_its_error(registry, tmp_path) -> None:
    from rlvla3.launch.eval_command import ProtocolHooks

    protocol = seeded_protocol(ENV, 1)
    hooks = ProtocolHooks(
        protocol, tmp_path / "episodes.jsonl", [protocol.episodes[0].to_dict()], 0
    )
    hooks.started(registry)
    assert hooks.check(registry) is None  # (no worker to wait for) queued
    assert hooks._queue is not None
    for pid in (1, 2, 3):  # no worker is alive: every check finds the claim orphaned
        assert hooks._queue.take("eval_env_worker/0", pid) is not None
        hooks._next_requeue = 0.0
        reason = hooks.check(registry)
    assert reason is not None and "evaluated all 1 episodes" in reason.text
    record = read_episodes(tmp_path / "episodes.jsonl")[protocol.episodes[0].key]
    assert record["success"] is False and "died while playing it 3 times" in record["error"]


def test_a_malformed_queued_entry_is_counted_not_played(registry) -> None:
    import logging
    import threading
    from types import SimpleNamespace

    from rlvla3.runtime import keys
    from rlvla3.runtime.eval_queue import EvalQueue
    from roles.env.protocol_runner import ProtocolRunner, TaskEnvs

    queue = EvalQueue(registry)
    queue.fill([])
    registry.redis.rpush(keys.eval_todo(registry.run_id), "{not json", '{"key": 1}')
    stop, refused = threading.Event(), []

    def drop(name: str, why: str) -> None:
        refused.append((name, why))
        if len(refused) == 2:
            stop.set()

    parts = SimpleNamespace(stop_event=stop, counters=SimpleNamespace(drop=drop))
    runner = ProtocolRunner(parts, queue, "eval_env_worker/0", (Path("."), 0), logging.getLogger())
    runner.run(TaskEnvs({}, 1))
    assert [name for name, _ in refused] == ["eval_bad_episodes"] * 2
    assert queue.pending() == (0, 0)


# --------------------------------------------------------------- real evaluations (the roles)
def tiny_checkpoint(run_dir: Path, max_steps: int = 20) -> Path:
    """A run dir with a config and one checkpoint of a small random MLP on the table-top task."""
    cfg = {
        "run": {"name": "tiny", "heartbeat_ttl_s": 3.0, "progress_interval_s": 1.0},
        "roles": {"env_worker": {"count": 1}, "rollout_server": {"count": 1}},
        "env": {"id": ENV, "kwargs": {"obs_mode": "state", "max_episode_steps": max_steps}},
        "policy": {"kind": "mlp", "hidden_sizes": [16]},
    }
    return write_checkpoint_run(run_dir, cfg)


def outcomes(out: Path) -> dict[str, tuple]:
    return {
        k: (r["success"], r["length"], round(r["return"], 6))
        for k, r in read_episodes(out / "episodes.jsonl").items()
    }


EPISODES = 40


def test_two_workers_give_the_same_episodes_as_one(tmp_path: Path) -> None:
    """Each episode depends only on its seed and the weights: who plays it changes nothing.
    (Enough episodes that neither worker can drain the queue before the other's first take.)"""
    tiny_checkpoint(tmp_path / "run")
    run_eval(tmp_path / "run", tmp_path / "one", "--episodes", str(EPISODES), "--workers", "1")
    printed = run_eval(
        tmp_path / "run", tmp_path / "two", "--episodes", str(EPISODES), "--workers", "2"
    )
    one, two = outcomes(tmp_path / "one"), outcomes(tmp_path / "two")
    assert len(one) == EPISODES and one == two
    report = json.loads((tmp_path / "two" / "eval.json").read_text())
    players = {e["worker"] for e in report["episodes"]}
    assert players == {"eval_env_worker/0", "eval_env_worker/1"}, players
    assert report["complete"] and report["overall"]["episodes"] == EPISODES
    assert [e["seed"] for e in report["episodes"]] == list(range(EPISODES))
    assert report["greedy"] and all(e["greedy"] and e["version"] == 0 for e in report["episodes"])
    lo, hi = report["overall"]["success_ci95"]
    assert lo <= report["overall"]["success_rate"] <= hi
    assert "overall" in printed and "95% interval" in printed


def test_a_killed_evaluation_resumes_without_replays(tmp_path: Path) -> None:
    """Kill ``rlvla3 eval`` once some episodes are recorded; the next one into the same --out
    plays only the others, and every episode is recorded exactly once."""
    total = 300
    source = tiny_checkpoint(tmp_path / "run", max_steps=30)
    out = tmp_path / "out"
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(
            eval_command(source, out, "--episodes", str(total)),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=os.environ | {"PYTHONPATH": str(REPO)},
        )
    try:
        jsonl = out / "episodes.jsonl"
        wait_until(lambda: jsonl.is_file() and len(read_episodes(jsonl)) >= 5, 120, "episodes")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    recorded = len(read_episodes(jsonl))
    assert 5 <= recorded < total, (tmp_path / "first.log").read_text()
    printed = run_eval(source, out, "--episodes", str(total))
    assert f"{recorded} done before, {total - recorded} to play" in printed
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert sorted(r["seed"] for r in lines) == list(range(total))  # each once: no replays
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counters"]["eval_episodes"] == total - recorded  # the second run played


def test_a_protocol_evaluation_runs_only_the_eval_roles() -> None:
    from rlvla3.config.run_config import config_from_dict
    from rlvla3.config.typed_load import ConfigError

    eval_roles = {"eval_env_worker": {"count": 2}, "eval_rollout_server": {"count": 1}}
    raw = {"run": {"eval": {"protocol": True}}, "roles": eval_roles, "env": {"id": ENV}}
    assert config_from_dict(raw).num_processes("eval_env_worker") == 2
    with pytest.raises(ConfigError, match="run.eval.protocol: runs only the eval roles"):
        config_from_dict(raw | {"roles": eval_roles | {"trainer": {"count": 1}}})
    with pytest.raises(ConfigError, match="roles.eval_rollout_server.count"):
        config_from_dict(raw | {"roles": {"eval_env_worker": {"count": 1}}})


def test_a_result_record_that_is_not_a_json_object_is_taken_as_nothing(
    tmp_path: Path, registry
) -> None:
    """A broken or hostile writer's result in Redis neither crashes the head's launcher nor
    stands for an episode."""
    from rlvla3.launch.eval_command import ProtocolHooks
    from rlvla3.runtime.eval_queue import EvalQueue

    protocol = seeded_protocol(ENV, 2)
    queue = EvalQueue(registry)
    for raw in ("not json", "[1, 2]", json.dumps({"key": protocol.episodes[0].key, "success": 1})):
        queue.redis.rpush(queue._results, raw)
    results = queue.results(0)
    assert results[:2] == [{}, {}]
    hooks = ProtocolHooks(protocol, tmp_path / "episodes.jsonl", [], workers=1)
    hooks.wanted = {e.key for e in protocol.episodes}
    hooks._record(results)
    assert hooks.recorded == {protocol.episodes[0].key}
