"""summary.json: ``solved`` follows whichever target stopped the run, or the end-of-run
evaluation over all its episodes when one ran."""

from __future__ import annotations

import json

from rlvla3.config.run_config import Config, config_from_dict
from rlvla3.launch.run_summary import unmeasured_summary, write_report
from rlvla3.launch.stop_reason import StopKind, StopReason
from rlvla3.launch.stop_rules import stop_condition
from rlvla3.runtime.registry import Registry

_ENDED = StopReason(StopKind.ROLES_FINISHED, "test")


def _summary(tmp_path, redis_url: str, name: str, stop: dict, successes: list[bool]) -> dict:
    cfg = config_from_dict({"run": {"name": name, "redis_url": redis_url, "stop": stop}})
    registry = Registry(redis_url, name)
    registry.append(
        "episodes",
        [
            {"return": 1.0, "length": 5, "success": ok, "t": float(i), "env_steps": 5 * i}
            for i, ok in enumerate(successes)
        ],
    )
    write_report(registry, cfg, tmp_path, 1.0, _ENDED)
    return json.loads((tmp_path / "summary.json").read_text())


def test_success_rate_target_counts_as_solved(tmp_path, redis_url) -> None:
    stop = {"target_success_rate": 0.8, "return_window": 10}
    solved = _summary(tmp_path, redis_url, "rep_ok", stop, [False] * 5 + [True] * 9 + [False])
    assert solved["solved"] is True and solved["success_rate"] == 0.9
    short = _summary(tmp_path, redis_url, "rep_bad", stop, [True] * 7 + [False] * 3)
    assert short["solved"] is False and short["success_rate"] == 0.7


def test_no_target_is_never_solved(tmp_path, redis_url) -> None:
    summary = _summary(tmp_path, redis_url, "rep_none", {"return_window": 3}, [True] * 5)
    assert summary["solved"] is False


def test_an_evaluation_decides_over_all_its_episodes(tmp_path, redis_url) -> None:
    """200 evaluation episodes at 0.75 against a target of 0.8: not solved, even though the
    last return_window (50) of them reach 0.8."""
    name = "rep_eval"
    cfg = config_from_dict(
        {
            "run": {
                "name": name,
                "redis_url": redis_url,
                "stop": {"target_success_rate": 0.8, "return_window": 50, "eval_episodes": 200},
            }
        }
    )
    registry = Registry(redis_url, name)
    registry.start_evaluation(7)
    outcomes = [True] * 110 + [False] * 40 + [True] * 40 + [False] * 10  # 0.75; last 50: 0.8
    registry.append(
        "episodes",
        [
            {
                "return": 5.0 if ok else 0.0,
                "length": 5,
                "success": ok,
                "t": float(i),
                "env_steps": 5 * i,
                "min_version": 7,
                "max_version": 7,
                "greedy": True,
            }
            for i, ok in enumerate(outcomes)
        ],
    )
    summary = write_report(registry, cfg, tmp_path, 1.0, _ENDED).as_json()
    assert summary["success_rate"] == 0.75 and summary["evaluation"]["episodes"] == 200
    assert summary["solved"] is False


def test_an_evaluation_counts_only_greedy_episodes_of_its_version(tmp_path, redis_url) -> None:
    """Episodes of the evaluated version that the rollout server sampled (before it saw the
    evaluation start), and greedy ones of an older version, are not the evaluation."""
    name = "rep_greedy"
    cfg = config_from_dict(
        {"run": {"name": name, "redis_url": redis_url, "stop": {"eval_episodes": 4}}}
    )
    registry = Registry(redis_url, name)
    registry.start_evaluation(7)

    def episode(i: int, ok: bool, version: int, greedy: bool) -> dict[str, object]:
        return {
            "return": 5.0 if ok else 0.0,
            "length": 5,
            "success": ok,
            "t": float(i),
            "env_steps": 5 * i,
            "min_version": version,
            "max_version": 7,
            "greedy": greedy,
        }

    sampled = [episode(i, False, 7, greedy=False) for i in range(6)]
    older = [episode(6 + i, False, 6, greedy=True) for i in range(2)]
    evaluated = [episode(8 + i, i < 3, 7, greedy=True) for i in range(4)]
    registry.append("episodes", sampled + older + evaluated)
    summary = write_report(registry, cfg, tmp_path, 1.0, _ENDED).as_json()
    assert summary["evaluation"]["episodes"] == 4
    assert summary["success_rate"] == 0.75


def test_the_stop_rules_verdict_stands_against_episodes_that_finish_while_stopping(
    tmp_path, redis_url
) -> None:
    """The run stopped on its target; episodes the env workers finished while stopping pull the
    last window below it: summary.json still says solved (and says why it stopped)."""
    name = "rep_late"
    cfg = config_from_dict(
        {
            "run": {
                "name": name,
                "redis_url": redis_url,
                "stop": {"target_mean_return": 4.0, "return_window": 4},
            }
        }
    )
    registry = Registry(redis_url, name)
    returns = [5.0, 5.0, 5.0, 5.0, 1.0, 1.0]  # the first four stopped the run
    registry.append(
        "episodes",
        [
            {"return": r, "length": 5, "t": float(i), "env_steps": 5 * i}
            for i, r in enumerate(returns)
        ],
    )
    target = StopReason(StopKind.TARGET_REACHED, "solved: mean return 5.0 over 4 episodes")
    late = write_report(registry, cfg, tmp_path, 1.0, target)
    assert late.solved is True and late.measures.final_mean_return == 3.0
    wall = StopReason(StopKind.MAX_WALL_S, "wall time 10s reached run.stop.max_wall_s")
    assert write_report(registry, cfg, tmp_path, 1.0, wall).solved is False


def test_the_evaluated_success_rate_stop_rule_reads_the_newest_evaluation(redis_url) -> None:
    raw = {
        "run": {
            "name": "rep_eval",
            "redis_url": redis_url,
            "eval": {"every_versions": 2, "episodes": 4},
            "stop": {"target_eval_success_rate": 0.75},
        },
        "roles": {"trainer": {}, "eval_env_worker": {}, "eval_rollout_server": {}},
    }
    cfg = config_from_dict(raw)
    registry = Registry(redis_url, "rep_eval")
    assert stop_condition(registry, cfg, 1.0) is None
    point = {"version": 4, "episodes": 4, "mean_return": 1.0, "env_steps": 10}
    registry.append("evaluations", [{**point, "success_rate": 0.75}])
    reason = stop_condition(registry, cfg, 1.0)
    assert reason is not None and reason.solved and "v4" in reason.text
    registry.append("evaluations", [{**point, "version": 6, "success_rate": 0.5}])
    assert stop_condition(registry, cfg, 1.0) is None  # the newest evaluation decides


def _window_of_three(redis_url: str, name: str, target: float) -> tuple[Config, Registry]:
    """A run evaluated on 100 held-out episodes every 2 versions that stops at the mean
    ``target`` of the newest three evaluations, and its registry."""
    raw = {
        "run": {
            "name": name,
            "redis_url": redis_url,
            "eval": {"every_versions": 2, "episodes": 100},
            "stop": {"target_eval_success_rate": target, "eval_window": 3},
        },
        "roles": {"trainer": {}, "eval_env_worker": {}, "eval_rollout_server": {}},
    }
    return config_from_dict(raw), Registry(redis_url, name)


def test_an_evaluation_window_stops_on_the_mean_of_the_newest_evaluations(redis_url) -> None:
    """One lucky evaluation must not end a run whose window is 3: the mean of the newest three
    decides, and only once there are three."""
    cfg, registry = _window_of_three(redis_url, "rep_eval_window", 0.9)
    point = {"episodes": 100, "mean_return": 1.0, "env_steps": 10}
    for version, rate in ((2, 0.93), (4, 0.95)):
        registry.append("evaluations", [{**point, "version": version, "success_rate": rate}])
        assert stop_condition(registry, cfg, 1.0) is None  # fewer than three so far
    registry.append("evaluations", [{**point, "version": 6, "success_rate": 0.80}])
    assert stop_condition(registry, cfg, 1.0) is None  # mean 0.893
    registry.append("evaluations", [{**point, "version": 8, "success_rate": 0.94}])
    reason = stop_condition(registry, cfg, 1.0)  # 0.95, 0.80, 0.94: mean 0.897
    assert reason is None
    registry.append("evaluations", [{**point, "version": 10, "success_rate": 0.97}])
    reason = stop_condition(registry, cfg, 1.0)  # 0.80, 0.94, 0.97: mean 0.903
    assert reason is not None and reason.solved
    assert "mean of 3 evaluations up to weights v10" in reason.text


def test_an_evaluation_window_whose_rates_all_equal_the_target_stops(redis_url) -> None:
    """Three evaluations of exactly 0.95 meet a target of 0.95, though their float mean is
    0.9499999999999998."""
    cfg, registry = _window_of_three(redis_url, "rep_eval_equal", 0.95)
    point = {"episodes": 100, "mean_return": 1.0, "env_steps": 10}
    for version, rate in ((2, 0.95), (4, 0.95), (6, 0.94)):
        registry.append("evaluations", [{**point, "version": version, "success_rate": rate}])
    assert stop_condition(registry, cfg, 1.0) is None  # mean 0.9467: short of the target
    for version in (8, 10):
        registry.append("evaluations", [{**point, "version": version, "success_rate": 0.95}])
        assert stop_condition(registry, cfg, 1.0) is None  # 0.94 still in the window
    registry.append("evaluations", [{**point, "version": 12, "success_rate": 0.95}])
    reason = stop_condition(registry, cfg, 1.0)
    assert reason is not None and reason.solved
    assert "rate 0.95, the mean of 3 evaluations up to weights v12" in reason.text


def test_a_summary_without_the_runs_redis_says_it_is_incomplete(tmp_path) -> None:
    """The summary written when Redis is gone keeps only what the launcher knows itself."""
    cfg = config_from_dict({"run": {"name": "rep_gone"}})
    lost = StopReason(StopKind.REDIS_LOST, "lost the run's Redis at redis://x (gone)")
    unmeasured_summary(cfg, 12.3456, lost).write(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {
        "run_id": "rep_gone",
        "mode": cfg.run.mode,
        "stop_reason": lost.text,
        "solved": False,
        "wall_s": 12.35,
        "complete": False,
    }


def test_a_measured_summary_writes_every_key_and_leaves_out_what_the_run_lacks(
    tmp_path, redis_url
) -> None:
    summary = _summary(tmp_path, redis_url, "rep_keys", {"return_window": 3}, [True] * 5)
    assert set(summary) == {
        "run_id", "mode", "stop_reason", "solved", "env_steps", "wall_s", "final_mean_return",
        "episodes", "weight_version", "counters", "finished_at", "success_rate",
        "chunk_accounting", "chunks_lost", "roles", "nodes",
    }  # fmt: skip
    assert "complete" not in summary


def test_a_stop_reasons_kind_decides_the_exit_code() -> None:
    assert StopReason(StopKind.SIGNAL, "stopped by signal").exit_code == 130
    assert StopReason(StopKind.ROLE_FAILED, "trainer/0 failed").exit_code == 1
    assert StopReason(StopKind.MAX_ENV_STEPS, "100 env steps reached").exit_code == 0
    ended = StopReason(StopKind.HEAD_ENDED, "the head ended the run: x", head_exit_code=130)
    assert ended.exit_code == 130 and ended.noted("more").text == "the head ended the run: x; more"
    assert ended.noted("more").kind is StopKind.HEAD_ENDED
