"""Rollout server role: batched policy inference for every env worker.

A ROUTER socket takes ``ObsRequest`` from all env workers; each step batches whatever has arrived
(up to ``max_batch``, waiting at most ``max_wait_ms`` for more; in ``sync`` mode it waits for every
env), runs the policy under ``torch.inference_mode`` (or, for small MLPs on CPU, its numpy path,
``act_numpy``) and replies with action, log-prob, value and the ``policy_version`` that produced
them. How a batch's observations are stacked, checked and its replies cut is
``roles/request_batch.py``.

Weights arrive from the broadcaster on a background thread into a standby copy of the policy
(double buffering); the serving loop swaps it in between batches, so serving never stops for a
sync and never sees half-written weights. Each copy's parameters are views of its own flat
buffer (``FlatLayout.bind``), so the broadcast lands directly in the standby model: no second
copy competes with serving for CPU or memory bandwidth during a sync. A bfloat16 model cannot be
a view of float32 values: it receives into its own float32 buffer and takes a copy once the
version passed its checks (``WeightTarget``). With ``policy.lora`` the
buffer holds the adapters and heads only; each copy's frozen base is loaded by ``build_policy``.
A received copy is swapped in only when its signature under the run's weights key matches, its
version is newer than the one served and was produced by a trainer, and its values are finite
(``transport/weight_auth.py``); the link's id is random, so no one can guess it to take the
broadcaster's place. A server whose link does not form within ``_STORE_TIMEOUT_S`` (a stale or
forged broadcaster record in Redis) relinks, looking the broadcaster up again.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from typing import Any

import numpy as np
import torch

from rlvla3.algo.chunk_check import obs_problem, observation_bytes
from rlvla3.config.role_settings import RolloutServerSettings
from rlvla3.policy.base import NumpyActOutput
from rlvla3.policy.factory import build_policy, env_spaces
from rlvla3.policy.lora import load_init_weights
from rlvla3.policy.memory_check import check_role_memory
from rlvla3.runtime.rate_meter import RateMeter
from rlvla3.runtime.role import Role
from rlvla3.runtime.role_main import main
from roles.request_batch import (
    all_usable,
    batch_replies,
    request_rows,
    stack_observations,
    without_unusable,
)
from transport.messages import ActionReply, ObsBatchRequest, ObsRequest
from transport.socket_limits import request_limits
from transport.sockets import RouterSocket
from transport.weight_auth import VersionGate, new_link_id
from transport.weights import FlatLayout, LinkHeader, WeightLink, WeightTarget

_UNUSABLE = "non-finite or absurdly large observation (rlvla3/algo/number_limits.py)"
_RECEIVER_TIMEOUT_S = 24 * 3600.0  # a link waits as long as the trainer takes between versions
_STORE_TIMEOUT_S = 60.0  # reaching the broadcaster's store, and each rendezvous step through it
_RELINK_MIN_S, _RELINK_MAX_S = 0.1, 5.0  # backoff between relinks after a broken link


class RolloutServer(Role[RolloutServerSettings]):
    """Serves actions from the newest weights it has, swapping versions between batches."""

    name = "rollout_server"
    serves_training = True
    """False for evaluation's server: it never takes part in ``sync`` mode's lock-step."""
    request_rate: RateMeter | None = None
    """Requests per second (set up in ``setup``; ``stats`` may run before it), fed at heartbeat
    time from ``requests_seen``."""
    requests_seen = 0
    """Requests taken off the socket so far (a plain int: the serving loop only adds to it)."""
    requests_rated = 0
    """``requests_seen`` when ``stats`` last fed ``request_rate``."""
    last_batch: tuple[int, float] | None = None
    """The last batch's size and how long it waited to fill, in seconds."""

    def setup(self) -> None:
        torch.set_num_threads(self.settings.num_threads)
        spaces = env_spaces(self.cfg)
        self.obs_space = spaces.observation
        self.device = torch.device(self.settings.device)
        # two copies: the one serving and the standby that receives the next version
        estimate = check_role_memory(
            self.cfg, self.name, self.device, copies=2, trains=False, receives=True
        )
        if estimate is not None:
            self.log.info("policy memory: %s", estimate.describe())
        self.active = build_policy(self.cfg, spaces).to(self.device).eval()
        self.standby = build_policy(self.cfg, spaces).to(self.device).eval()
        self.layout = FlatLayout.of(self.active)
        self.active_target = WeightTarget.of(self.layout, self.active)
        # only the standby ever receives: unbound copies share one float32 receive buffer
        shared = None if self.active_target.bound else self.active_target.flat
        self.standby_target = WeightTarget.of(self.layout, self.standby, receive=shared)
        self.version = -1
        self.pending_version: int | None = None
        self.swap_lock = threading.Lock()
        self.weights_ready = threading.Event()
        limits = request_limits(observation_bytes(self.obs_space), self.cfg.env.envs_per_request)
        self.requests = self.own(
            RouterSocket(hwm=10_000, on_bad_frame=self.count_bad_frame, limits=limits)
        )
        self.bind("requests", self.requests)
        self.sync = self.cfg.run.mode == "sync" and self.serves_training
        self.full_batch = self._requests_per_round() if self.sync else self.settings.max_batch
        wait_ms = self.settings.sync_max_wait_ms if self.sync else self.settings.max_wait_ms
        self.batch_wait_s = wait_ms / 1000
        self.request_rate = RateMeter()
        self.rng = np.random.default_rng([self.cfg.run.seed, self.index])  # act_numpy's sampling
        self.greedy, self.next_eval_check = False, 0.0
        self.gate = VersionGate(self.weights_key, resends=True)  # a relink resends the same
        if self.cfg.num_processes("weight_broadcaster") == 0:
            self._serve_initial_weights()
            return
        threading.Thread(target=self._receive_weights, name="weights", daemon=True).start()
        while not self.weights_ready.wait(0.1):  # serve nothing before the trainer's weights
            if self.stop_event.is_set():
                raise InterruptedError

    def _serve_initial_weights(self) -> None:
        """A run without a weight broadcaster (inference only: evaluating a checkpoint, or
        measuring throughput) serves ``policy.init_checkpoint``'s weights, else the policy as
        initialised, as version 0."""
        path = self.cfg.policy.init_checkpoint
        if path:
            if not self.cfg.policy.lora.enabled:  # (with LoRA build_policy loaded it)
                load_init_weights(self.active, path)
            self.log.info("inference only: serving the weights of %s", path)
        else:
            self.log.info("inference only: serving the initial (untrained) policy")
        self.version = 0
        self.gauge("policy_version", 0)
        self.weights_ready.set()

    def _requests_per_round(self) -> int:
        """Requests of one sync-mode step: one per env group (``env.envs_per_request``)."""
        # a run without env workers (a benchmark driving the servers itself) counts as one
        workers = self.cfg.num_processes("env_worker") if "env_worker" in self.cfg.roles else 1
        env = self.cfg.env
        return max(1, workers * -(-env.num_envs_per_worker // env.envs_per_request))

    # --- weights (background thread) -------------------------------------------------------------
    def _receive_weights(self) -> None:
        """Keep a weight link to the broadcaster, relinking (with backoff) when it breaks. A
        restarted broadcaster has a new store address, so each relink looks it up again."""
        store, store_address, backoff = None, None, _RELINK_MIN_S
        while not self.stop_event.is_set():
            link_id = new_link_id(self.name, self.index)
            try:
                address = self.wait_for_endpoints("weight_broadcaster", "store")[0]
                if address != store_address:
                    store, store_address = _store_client(address), address
                self.registry.publish_endpoint(self.name, self.index, "weights_link", link_id)
                link = WeightLink(
                    store,
                    link_id,
                    1,
                    self.settings.device,
                    _RECEIVER_TIMEOUT_S,
                    host=self.address,
                    form_timeout_s=_STORE_TIMEOUT_S,
                )
                while not self.stop_event.is_set():
                    header = link.recv_header()  # waits for the trainer, no lock held
                    if self._receive_into_standby(link, header):
                        self.weights_ready.set()
                    backoff = _RELINK_MIN_S
            except InterruptedError:
                return  # stopping
            except Exception as err:
                self.drop("weight_relinks", f"weight link {link_id} broke ({err}); relinking")
                store_address = None  # look the broadcaster up afresh
                self.stop_event.wait(backoff)
                backoff = min(2 * backoff, _RELINK_MAX_S)

    def _receive_into_standby(self, link: WeightLink, header: LinkHeader) -> bool:
        """Receive the version ``header`` announces straight into the standby model's
        parameters; returns whether it passed the gate (then it is swapped in next).

        Holds the swap lock while the bytes arrive and are checked: the serving loop then keeps
        serving the active model and swaps only once the standby is complete and checked. A
        version received earlier but not yet swapped in is overwritten by this one, also when
        this one is refused (its bytes must be taken off the link all the same).
        """
        with self.swap_lock:
            self.pending_version = None
            link.recv_body(self.standby_target.flat, header.version, header.numel)
            started = time.perf_counter()
            trained = self.registry.trained_version()
            problem = self.gate.problem(
                header.version, self.standby_target.flat, header.tag, trained
            )
            self.gauge("weights_check_ms", (time.perf_counter() - started) * 1000)
            if problem is not None:
                self.drop("weights_rejected", f"weights v{header.version} refused: {problem}")
                return False
            self.gate.accept(header.version, header.tag)
            self.standby_target.commit()  # a bfloat16 model takes the float32 values here
            self.pending_version = header.version
        return True

    def _maybe_swap(self) -> None:
        if self.pending_version is None or not self.swap_lock.acquire(blocking=False):
            return
        try:
            if self.pending_version is None:  # a receive failed in between: nothing complete
                return
            self.active, self.standby = self.standby, self.active
            self.active_target, self.standby_target = self.standby_target, self.active_target
            self.version, self.pending_version = self.pending_version, None
        finally:
            self.swap_lock.release()
        self.gauge("policy_version", self.version)

    # --- serving ---------------------------------------------------------------------------------
    def step(self) -> None:
        self._maybe_swap()
        self._refresh_greedy()
        batch, waited_s = self._collect()
        if not batch:
            return
        valid = [(ident, req) for ident, req in batch if self._valid(req)]
        served = self._serve(valid) if valid else 0
        self.requests_seen += len(batch)
        self.count("requests_served", served)
        self.last_batch = (len(batch), waited_s)

    def stats(self) -> dict[str, float]:
        """The base gauges, and the serving ones, computed here (at heartbeat time) rather
        than per batch: at batch 1 every microsecond of a step is on an env's round trip."""
        stats = super().stats()
        if self.request_rate is not None:
            seen = self.requests_seen
            self.request_rate.add(seen - self.requests_rated)
            self.requests_rated = seen
            stats["requests_per_s"] = self.request_rate.rate()
        if self.last_batch is not None:
            size, waited_s = self.last_batch
            stats["batch_fill"] = size / self.full_batch
            stats["queue_wait_ms"] = waited_s * 1000
        return stats

    def _refresh_greedy(self) -> None:
        """Serve greedy actions once the launcher starts the end-of-run evaluation (checked at
        most once a second): it measures the policy's best actions, not its exploration."""
        if not self.greedy and time.monotonic() >= self.next_eval_check:
            self.greedy = self.registry.evaluation_version() is not None
            self.next_eval_check = time.monotonic() + 1.0

    def _collect(self) -> tuple[list[tuple[bytes, ObsRequest]], float]:
        """A batch: the first request to arrive (within 0.1 s), every one already waiting, and
        those arriving within the batch wait; and how long it waited, in seconds."""
        first = self.requests.recv_from(timeout_s=0.1)
        if first is None:
            return [], 0.0
        batch = [first]
        if self.batch_wait_s == 0:  # no clock reads: at batch 1 they are a step's bookkeeping
            while len(batch) < self.full_batch:
                item = self.requests.recv_from(timeout_s=0.0)
                if item is None:
                    break
                batch.append(item)
            return batch, 0.0
        started = time.monotonic()
        deadline = started + self.batch_wait_s
        while len(batch) < self.full_batch:
            remaining = deadline - time.monotonic()
            item = self.requests.recv_from(timeout_s=max(0.0, remaining))
            if item is not None:
                batch.append(item)
            elif remaining <= 0:
                break
        return batch, time.monotonic() - started

    def _valid(self, req: Any) -> bool:
        if isinstance(req, ObsBatchRequest):
            rows = request_rows(req)
            problem = (
                "an empty group" if rows is None else obs_problem(req.obs, self.obs_space, (rows,))
            )
            if problem is not None:
                self.drop("bad_requests", f"request {req.env_key!r:.80}: {problem}")
                return False
            return True
        if not isinstance(req, ObsRequest):
            self.drop("bad_requests", f"dropped a {type(req).__name__} on the request socket")
            return False
        problem = obs_problem(req.obs, self.obs_space)
        if problem is not None:
            self.drop("bad_requests", f"request {req.env_key!r:.80}: {problem}")
            return False
        return True

    def _serve(self, batch: list[tuple[bytes, Any]]) -> int:
        """Act on a batch of checked requests and reply to each; returns how many observations
        were served (a group's request carries several)."""
        if len(batch) == 1 and type(batch[0][1]) is ObsRequest:
            return self._serve_one(*batch[0])
        obs, rows = stack_observations(batch, self.obs_space.spaces)
        batch, obs, rows, refused = without_unusable(batch, obs, rows)
        for req in refused:
            self.drop("bad_requests", f"request {req.env_key!r:.80}: {_UNUSABLE}")
        if not batch:
            return 0
        out = self._act(obs)
        replies = batch_replies(batch, rows, out, policy_version=self.version, greedy=self.greedy)
        for identity, reply in replies:
            self.requests.send_to(identity, reply)
        return sum(rows)

    def _serve_one(self, identity: bytes, req: ObsRequest) -> int:
        """``_serve`` for a batch of one request (every request, when envs are few or slow):
        the same checks and reply with none of the batch's stacking and splitting."""
        obs = {key: req.obs[key][None] for key in self.obs_space.spaces}  # views, no copies
        if not all_usable(obs):
            self.drop("bad_requests", f"request {req.env_key!r:.80}: {_UNUSABLE}")
            return 0
        out = self._act(obs)
        reply = ActionReply(
            request_id=req.request_id,
            action=np.asarray(out.action[0]),  # (a discrete action's [0] is a numpy scalar)
            env_action=None if out.env_action is out.action else np.asarray(out.env_action[0]),
            log_prob=out.log_prob.item(),
            value=out.value.item(),
            policy_version=self.version,
            greedy=self.greedy,
        )
        self.requests.send_to(identity, reply)
        return 1

    def _act(self, obs: dict[str, np.ndarray]) -> NumpyActOutput:
        """The active policy's actions for a batch of observations: its numpy path where it has
        one (small policies on CPU, without torch's per-op overhead), else torch."""
        if self.device.type == "cpu":
            out = self.active.act_numpy(obs, self.greedy, self.rng)
            if out is not None:
                return out
        return self._act_torch(obs)

    @torch.inference_mode()
    def _act_torch(self, obs: dict[str, np.ndarray]) -> NumpyActOutput:
        # A lone request's arrays are read-only views of the received message (_serve_one);
        # torch takes only writable memory.
        batch = {
            key: torch.from_numpy(value if value.flags.writeable else value.copy()).to(self.device)
            for key, value in obs.items()
        }
        out = self.active.act(batch, deterministic=self.greedy)
        action = out.action.cpu().numpy()
        env_action = self.active.to_env_action(out.action)
        return NumpyActOutput(
            action=action,
            env_action=action if env_action is out.action else env_action.cpu().numpy(),
            log_prob=out.log_prob.cpu().numpy(),
            value=out.value.cpu().numpy(),
        )


def _store_client(address: str) -> torch.distributed.TCPStore:
    """A client of the weight store at ``host:port``."""
    host, port = address.rsplit(":", 1)
    # A dead broadcaster's record outlives it by a heartbeat TTL; a TCPStore client would spend
    # its whole timeout retrying it, so knock first.
    socket.create_connection((host, int(port)), timeout=2.0).close()
    return torch.distributed.TCPStore(
        host, int(port), is_master=False, timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S)
    )


if __name__ == "__main__":
    main(RolloutServer)
