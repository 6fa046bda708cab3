"""The array runner of vector env groups (``roles/env/vector_runner.py``) records exactly what the
per-env runner records for the same vector env, actions and replies: the same chunks (every
field, numbering and bootstrap value), the same episodes, the same requests."""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import pytest

from rlvla3.config.run_config import config_from_dict
from rlvla3.runtime.rate_meter import RateMeter
from roles.env.chunk_sink import ChunkSink, ChunkStream
from roles.env.env_runner import EnvRunner
from roles.env.env_slot import EnvSlot
from roles.env.episode_queue import EpisodeQueue, FinishedEpisode
from roles.env.pacing import Pacing
from roles.env.peers import Peers
from roles.env.policy_client import PolicyClient
from roles.env.resend_buffer import ResendBuffer
from roles.env.runner_thread import RunnerParts, make_env_group
from roles.env.sim_meter import SimMeter
from roles.env.vector_runner import VectorRunner
from tests.env_fakes import RecordingCounters
from transport.messages import ActionBatchReply, ActionReply, TrajectoryChunk


class _Host(RecordingCounters):
    """A stand-in env worker: records what its runner reports and sends."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps  # requests until the stop
        self.stop_event = threading.Event()
        self.episodes: list[tuple] = []
        self.requests: list[int] = []
        self.chunks: list[TrajectoryChunk] = []


class _Client(PolicyClient):
    """A deterministic policy that looks random (so episodes are short); log-prob, value and
    the weight version follow from the observation and the request count."""

    def __init__(self, host: _Host) -> None:
        super().__init__(
            env_key="0/0",
            env_index=0,
            peers=Peers([], []),
            timeout_s=5.0,
            counters=host,
            stop_event=host.stop_event,
            log=logging.getLogger("test"),
        )
        self.host = host

    def ask(self, obs: dict[str, np.ndarray], rows: int | None) -> Any:
        host = self.host
        state = np.asarray(obs["state"])
        state = state.reshape(len(state) if rows else 1, -1)
        host.requests.append(len(state))
        if len(host.requests) >= host.steps:
            host.stop_event.set()
        actions = (np.abs(state[:, 2]) * 1e4 % 2 > 1).astype(np.int64)  # (Acrobot: 0 or 1 of 3)
        log_probs = (-np.abs(state[:, 0]) - 0.1).astype(np.float32)
        values = state[:, 1].astype(np.float32)
        version = len(host.requests) // 5
        if rows is None:
            return ActionReply(
                request_id=1,
                action=actions[0],
                log_prob=float(log_probs[0]),
                value=float(values[0]),
                policy_version=version,
            )
        return ActionBatchReply(
            request_id=1,
            actions=actions,
            log_probs=log_probs,
            values=values,
            policy_version=version,
        )


class _Sink(ChunkSink):
    def __init__(self, host: _Host) -> None:
        super().__init__(
            worker_index=0,
            trains=True,
            peers=Peers([], []),
            queue_hwm=1,
            resend=ResendBuffer(0),
            counters=host,
            stop_event=host.stop_event,
        )
        self.host = host

    def send(self, stream: ChunkStream, chunk: TrajectoryChunk) -> None:
        self.host.chunks.append(chunk)
        stream.chunk_id += 1


class _Episodes(EpisodeQueue):
    def __init__(self, host: _Host) -> None:
        super().__init__(0, host)
        self.host = host

    def record(self, episode: FinishedEpisode) -> None:
        e = episode
        self.host.episodes.append((e.episode_return, e.length, e.success, e.versions))


def runner_parts(
    host: _Host, cfg: Any, indices: list[int], client: PolicyClient, pacing: Pacing, vector: bool
) -> RunnerParts:
    """The parts of a runner of envs ``indices`` of ``cfg``'s env that report to ``host``."""
    return RunnerParts(
        env_indices=indices,
        make_envs=lambda: make_env_group(cfg, 0, indices, vector=vector),
        client=client,
        sink=_Sink(host),
        meter=SimMeter(host, RateMeter()),
        pacing=pacing,
        episodes=_Episodes(host),
        counters=host,
        stop_event=host.stop_event,
        env_id=cfg.env.id,
    )


def _run(
    runner_class: type,
    steps: int,
    envs: int,
    episode_limit: int,
    env_id: str = "CartPole-v1",
    lock_step: bool = False,
) -> _Host:
    cfg = config_from_dict(
        {
            "env": {
                "id": env_id,
                "num_envs_per_worker": envs,
                "envs_per_request": envs,
                "vectorized": True,
                "chunk_len": 8,
                "kwargs": {"max_episode_steps": episode_limit},
            },
            "roles": {"env_worker": {"count": 1}},
        }
    )
    host = _Host(steps)
    # sync mode: a barrier (of this one group) and a new version every round
    pacing = Pacing(host.stop_event, groups=1, lock_step=lock_step, version=0)
    pacing.wait_for_version_after = lambda version: True  # type: ignore[method-assign]
    indices = list(range(envs))
    parts = runner_parts(host, cfg, indices, _Client(host), pacing, vector=True)
    streams = [ChunkStream(i, f"0/{i}#test") for i in indices]
    if runner_class is EnvRunner:
        slots = [EnvSlot(i, stream, None) for i, stream in enumerate(streams)]
        runner: Any = EnvRunner(parts, slots, chunk_len=8)
    else:
        runner = VectorRunner(parts, streams, chunk_len=8)
    runner.run(parts.make_envs())
    return host


@pytest.mark.parametrize(
    ("env_id", "episode_limit"),
    [
        ("CartPole-v1", 500),  # its own vector env: finished envs reset at their next step
        ("CartPole-v1", 12),  # most episodes end truncated: bootstrap values asked for
        ("Acrobot-v1", 15),  # gymnasium's sync vector env: finished envs reset in the same step
        ("sync", 12),  # sync mode's rounds: every env's chunk cut after chunk_len steps
    ],
)
def test_the_vector_runner_records_what_the_per_env_runner_records(
    env_id: str, episode_limit: int
) -> None:
    lock_step = env_id == "sync"
    env_id = "CartPole-v1" if lock_step else env_id
    kwargs = {"episode_limit": episode_limit, "env_id": env_id, "lock_step": lock_step}
    old = _run(EnvRunner, steps=400, envs=5, **kwargs)
    new = _run(VectorRunner, steps=400, envs=5, **kwargs)
    assert new.requests == old.requests  # the same requests, bootstrap ones included
    assert new.episodes == old.episodes and len(new.episodes) >= 10
    assert len(new.chunks) == len(old.chunks) >= 40
    for a, b in zip(new.chunks, old.chunks, strict=True):
        assert (a.env_index, a.chunk_id, a.producer) == (b.env_index, b.chunk_id, b.producer)
        assert a.bootstrap_value == pytest.approx(b.bootstrap_value)
        for field in (
            "actions",
            "rewards",
            "terminated",
            "truncated",
            "log_probs",
            "values",
            "policy_versions",
        ):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
            assert getattr(a, field).dtype == getattr(b, field).dtype, field
        np.testing.assert_array_equal(a.obs["state"], b.obs["state"])
    truncated = sum(c.truncated.any() for c in new.chunks)
    assert truncated > 0 if episode_limit < 500 else True
    assert new.counters["env_steps"] == old.counters["env_steps"]


def test_a_vector_group_that_starts_from_a_non_finite_observation_fails_its_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sim.env_group import VectorEnvs

    real_reset = VectorEnvs.reset_all

    def broken(self: VectorEnvs, seed: int | None = None) -> np.ndarray:
        obs = real_reset(self, seed).copy()
        obs[1, 2] = np.nan
        return obs

    monkeypatch.setattr(VectorEnvs, "reset_all", broken)
    with pytest.raises(RuntimeError, match=r"envs \[1\].*non-finite"):
        _run(VectorRunner, steps=10, envs=3, episode_limit=500)


def test_a_fault_resets_only_its_env_in_a_gymnasium_vector_env() -> None:
    """NaNCartPole (tests/faulty_env.py) under gymnasium's sync vector env: every 40th step of
    an env gives a NaN or 1e30 observation and every 4th reset a NaN first one. Each fault cuts that
    env's episode and resets that env alone (again while its reset is broken); no NaN reaches
    a request or a chunk, and the other envs' episodes go on."""
    import tests.faulty_env  # noqa: F401  (registers NaNCartPole-v0)

    host = _run(VectorRunner, steps=600, envs=3, episode_limit=500, env_id="NaNCartPole-v0")
    assert host.counters["sim_faults"] >= 10
    assert len(host.chunks) >= 20 and len(host.episodes) >= 10
    for chunk in host.chunks:
        assert (np.abs(chunk.obs["state"]) < 1e9).all() and np.isfinite(chunk.rewards).all()
    # a fault-cut episode is a truncation; the env's next chunk starts a fresh episode
    assert sum(c.truncated.any() for c in host.chunks) >= 10


def test_a_native_vector_env_that_cannot_reset_one_env_fails_on_a_broken_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sim.env_group import VectorEnvs

    real_step = VectorEnvs.step_arrays
    calls = {"n": 0}

    def nan_at_step_5(self: VectorEnvs, actions: Any) -> Any:
        out = real_step(self, actions)
        calls["n"] += 1
        if calls["n"] == 5:
            out.next_obs[2] = np.nan
        return out

    monkeypatch.setattr(VectorEnvs, "step_arrays", nan_at_step_5)
    with pytest.raises(RuntimeError, match=r"envs \[2\].*cannot reset one env"):
        _run(VectorRunner, steps=50, envs=3, episode_limit=500)
