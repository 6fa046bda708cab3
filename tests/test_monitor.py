"""The live monitor: derived figures from snapshots, an 80x24 screen, the Prometheus exporter
scraped and parsed with the real client parser, and the TUI in a real terminal (tmux) on a live
run whose rollout server is frozen."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from rlvla3.monitor import diagnosis
from rlvla3.monitor.prometheus import metric_name, serve
from rlvla3.monitor.rates import RunHistory, sparkline
from rlvla3.monitor.view import render
from rlvla3.runtime.metric_names import COUNTERS, GAUGES
from rlvla3.runtime.registry import Registry
from tests.conftest import wait_until
from tests.launching import launcher_output, start_launcher, write_yaml


def _role(role: str, index: int, stats: dict, *, alive: bool = True, **extra) -> dict:
    record = {
        "role": role,
        "index": index,
        "node": "local",
        "host": "127.0.0.1",
        "pid": 100 + index,
        "status": "running",
        "endpoints": {},
        "restarts": 0,
        "heartbeat_age_s": 0.5,
        "alive": alive,
        "stats": stats,
        "stalled_for_s": 0.0,
        "busy": "",
    }
    return {**record, **extra}


def _snap(t: float, env_steps: int, roles: list[dict], **counters: int) -> dict:
    return {
        "run_id": "unit",
        "time": t,
        "stop_reason": None,
        "weight_version": 7,
        "counters": {"env_steps": env_steps, **counters},
        "chunks_in_flight": 3,
        "chunk_accounting": {},
        "mean_return_last_20": 1.0,
        "recent_episodes": [{"return": float(i), "success": i % 2 == 0} for i in range(40)],
        "last_metrics": None,
        "evaluations": [{"version": 5, "episodes": 20, "success_rate": 0.5, "mean_return": 1.0}],
        "roles": roles,
        "nodes": [],
    }


def _workers(steps: float, wait_us: float, requests: float) -> list[dict]:
    stats = {
        "env_steps": steps,
        "env_step_us": steps * 50,
        "action_wait_us": wait_us,
        "action_requests": requests,
        "chunks_queued": 30,
        "max_chunks_queued": 32,
        "envs": 4,
    }
    return [
        _role("env_worker", 0, stats),
        _role("rollout_server", 0, {"requests_served": requests, "policy_version": 5}),
        _role("trainer", 0, {"samples_consumed": steps / 2, "policy_version": 7}),
    ]


def test_rates_come_from_the_window_and_a_restart_is_never_negative() -> None:
    history = RunHistory(window_s=5.0)
    history.add(_snap(0.0, 0, _workers(0, 0, 0)))
    history.add(_snap(5.0, 5000, _workers(5000, 5000 * 2000, 5000)))
    assert history.rate("env_steps") == pytest.approx(1000.0)
    assert history.role_rate("env_worker/0", "env_steps") == pytest.approx(1000.0)
    # 2 ms per action against a 0.05 ms simulator step: the envs wait on the servers
    assert history.role_ratio("env_worker/0", "action_wait_us", "action_requests") == 2000
    assert diagnosis.waiting_share(history) == pytest.approx(0.5)  # 10 s waited in 5 s by 4 envs
    figures = {f.key: f for f in history.roles()}
    assert figures["rollout_server/0"].detail == "v5 lag 2"  # the trainer is at v7
    assert "action 2.0ms" in figures["env_worker/0"].detail
    # the worker restarted (a new pid): its own counters start again from zero, and its rate
    # counts from its new process's first snapshot, never across the restart
    restarted = _workers(1000, 0, 1000)
    restarted[0]["pid"] = 999
    history.add(_snap(10.0, 6000, restarted))
    assert history.role_rate("env_worker/0", "env_steps") == 0.0  # one snapshot of it so far
    assert history.rate("env_steps") == pytest.approx(200.0)
    later = _workers(4000, 0, 4000)
    later[0]["pid"] = 999
    history.add(_snap(12.0, 9000, later))
    assert history.role_rate("env_worker/0", "env_steps") == pytest.approx(1500.0)
    history.add(_snap(17.0, 9000, later))
    assert history.rate("env_steps") == 0.0  # a run that stopped moving shows 0/s at once
    healthy, problem = diagnosis.health(history, history.roles())
    assert not healthy and "no env steps" in problem


def test_health_staleness_drops_and_the_bottleneck() -> None:
    history = RunHistory(window_s=1.0)
    counters = {
        "chunks_produced": 100,
        "chunks_dropped": 12,
        "bad_chunks": 2,
        "trained_staleness_0": 0,
        "trained_staleness_1": 0,
        "samples_consumed": 0,
        "samples_dropped": 0,
    }
    history.add(_snap(0.0, 0, _workers(0, 0, 0), **counters))
    counters.update(
        trained_staleness_0=300,
        trained_staleness_1=100,
        samples_consumed=400,
        samples_dropped=100,
        chunks_dropped=17,
        bad_chunks=3,
    )
    roles = _workers(100, 100, 100)
    roles[1] = _role("rollout_server", 0, {"requests_served": 100}, alive=False)
    history.add(_snap(1.0, 100, roles, **counters))
    shares = diagnosis.staleness_shares(history)
    assert shares == [("0", 0.75), ("1", 0.25), ("2", 0.0), ("3+", 0.0)]
    # in the window: 100 of 500 samples dropped, 4 chunks too stale and 1 refused
    drops = diagnosis.drop_shares(history)
    assert drops == {"samples": 0.2, "stale_chunks": 4, "refused_chunks": 1}
    healthy, problem = diagnosis.health(history, history.roles())
    assert not healthy and problem == "rollout_server/0 LOST"
    lost = {f.key: f for f in history.roles()}["rollout_server/0"]
    assert lost.rate is None  # a LOST role shows no rate, not its last one
    assert diagnosis.bottleneck(history, history.roles()).startswith("trainer: 30/32 chunks queued")
    stopping = [dict(r, status="stopping", alive=True) for r in roles]
    history.add(_snap(5.0, 100, stopping, **counters))
    assert diagnosis.health(history, history.roles()) == (True, "")  # no alarm while the run ends


def test_the_screen_fits_80x24_even_with_many_roles() -> None:
    roles = _workers(0, 0, 0) + [
        _role("env_worker", i, {"env_steps": 0.0}, alive=i > 11) for i in range(1, 40)
    ]  # 11 LOST roles: the header says so in one line
    history = RunHistory(window_s=1.0)
    history.add(_snap(0.0, 0, roles))
    history.add(_snap(1.0, 100, roles))
    console = Console(width=80, height=24, record=True, file=io.StringIO(), color_system=None)
    console.print(render(history, width=80, height=24))
    lines = console.export_text().rstrip("\n").splitlines()
    assert len(lines) <= 24 and max(len(line) for line in lines) <= 80, "\n".join(lines)
    text = "\n".join(lines)
    assert "more" in text and "env steps 100/s" in text and "v5 50%" in text
    assert "UNHEALTHY: env_worker/1 LOST, env_worker/2 LOST +9\n" in text
    assert "µs" not in text and "_us" not in text  # derived figures only
    assert sparkline([0, 1, 2, 4], 4) == "▁▃▅█"


def test_prometheus_exporter_serves_every_counter_and_role_gauge(redis_url) -> None:
    registry = Registry(redis_url, "prom_unit")
    registry.register("env_worker", 0, node="n0", host="127.0.0.1", pid=1)
    registry.heartbeat(
        "env_worker", 0, ttl_s=30, stats={"steps_per_s": 12.5, "env_steps": 40, "env_step_us": 2e6}
    )
    registry.flush({"env_steps": 40, "action_wait_us": 3_000_000}, flusher="w#0", number=0)
    server, port = serve(registry, 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        server.shutdown()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert len(families) == len(list(text_string_to_metric_families(text)))  # names unique
    for name in COUNTERS:
        family = families[f"rlvla3_{metric_name(name)[0]}"]
        assert family.type == "counter"
    assert families["rlvla3_env_steps"].samples[0].value == 40
    assert families["rlvla3_action_wait_seconds"].samples[0].value == 3.0  # µs -> s
    up = families["rlvla3_role_up"].samples[0]
    assert up.value == 1 and up.labels == {
        "run": "prom_unit",
        "role": "env_worker",
        "index": "0",
        "node": "n0",
    }
    assert families["rlvla3_role_steps_per_s"].type == "gauge"
    assert families["rlvla3_role_env_step_seconds"].samples[0].value == 2.0
    assert families["rlvla3_run_up"].samples[0].value == 1
    registry.clear_run()


def test_the_exporter_says_the_run_is_down_once_its_redis_is_gone(tmp_path) -> None:
    registry = Registry(f"unix://{tmp_path}/no-such.sock", "gone")
    server, port = serve(registry, 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            families = list(text_string_to_metric_families(reply.read().decode()))
    finally:
        server.shutdown()
    assert [(f.name, f.samples[0].value) for f in families] == [("rlvla3_run_up", 0.0)]


def test_the_grafana_dashboard_asks_only_for_served_metrics() -> None:
    dashboard = json.loads(Path("docs/grafana/rlvla3.json").read_text())
    served = {"rlvla3_run_up", "rlvla3_weight_version", "rlvla3_chunks_in_flight"}
    served |= {f"rlvla3_{n}" for n in ("mean_return", "success_rate", "eval_version")}
    served |= {"rlvla3_eval_mean_return", "rlvla3_eval_success_rate"}
    served |= {f"rlvla3_{metric_name(n)[0]}_total" for n in COUNTERS}
    served |= {f"rlvla3_role_{metric_name(n)[0]}" for n in GAUGES}
    served |= {f"rlvla3_role_{metric_name(n)[0]}_total" for n in COUNTERS}
    served |= {"rlvla3_role_up", "rlvla3_role_stalled", "rlvla3_role_process_restarts_total"}
    import re

    asked = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"rlvla3_[a-z0-9_]+", target["expr"])
    }
    assert asked and asked <= served, asked - served


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")
def test_the_tui_in_a_terminal_shows_a_frozen_server_and_its_replacement(
    tmp_path, redis_url
) -> None:
    name = "tui_live"
    cfg = {
        "run": {
            "name": name,
            "redis_url": redis_url,
            "heartbeat_ttl_s": 2.0,
            "stall_timeout_s": 60.0,
            "stop": {"max_wall_s": 150},
        },
        "roles": {
            "env_worker": {"count": 1},
            "rollout_server": {"count": 1},
            "trainer": {"count": 1},
            "weight_broadcaster": {"count": 1},
        },
        "env": {"id": "CartPole-v1", "num_envs_per_worker": 2, "chunk_len": 32},
    }
    run_dir = tmp_path / "run"
    launcher = start_launcher(write_yaml(tmp_path / "cfg.yaml", cfg), run_dir)
    session = f"rlvla3-test-{os.getpid()}"
    registry = Registry(redis_url, name)
    frozen = None
    try:
        wait_until(lambda: registry.counters().get("env_steps", 0) > 500, 90, "env steps")
        command = f"{sys.executable} -m rlvla3 monitor --run {run_dir} --interval 0.5"
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24", command],
            check=True,
        )

        def screen() -> str:
            out = subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True
            )
            return out.stdout

        def rate_shown() -> float | None:
            for line in screen().splitlines():
                if line.startswith("env steps "):
                    return float(line.split()[2].split("/")[0].replace(",", ""))
            return None

        wait_until(lambda: "healthy" in screen() and (rate_shown() or 0) > 0, 30, "a live rate")
        assert "weight_broadcaster/0" in screen()  # the whole role table fits in 24 lines
        frozen = next(r.pid for r in registry.roles() if r.role == "rollout_server")
        os.kill(frozen, signal.SIGSTOP)

        def server_row() -> str:
            rows = [line for line in screen().splitlines() if line.startswith("rollout_server/0")]
            return rows[0] if rows else ""

        def frozen_shown() -> bool:
            shown = screen()
            row = next((r for r in shown.splitlines() if r.startswith("rollout_server/0")), "")
            return ("LOST" in row or "STALLED" in row) and "UNHEALTHY" in shown

        # a frozen role is replaced once its heartbeat is silent past the TTL: the screen says
        # so while it is, then shows the replacement and its restart
        wait_until(frozen_shown, 30, "the frozen server's row to say LOST or STALLED")
        wait_until(lambda: "↻1" in server_row(), 60, "the replaced server's restart")
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):  # replaced: killed as frozen
                os.kill(frozen, signal.SIGCONT)
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        launcher.send_signal(signal.SIGINT)
        code = launcher.wait(timeout=60)
    assert code == 130, launcher_output(run_dir)
