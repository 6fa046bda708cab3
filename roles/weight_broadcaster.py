"""Weight broadcaster role: trainer → every rollout server, versioned, over torch.distributed.

Receives ``WeightsUpdate`` messages from the trainer (PULL, only the newest matters), keeps that
version, and broadcasts it to every live rollout server through a two-rank link per server
(``transport/weights.py``). It takes only versions signed with the run's weights key, newer than
the one it holds, produced by a trainer and finite (``transport/weight_auth.py``), and forwards
each with its signature, which the servers check again. Servers that join late get the current version when their link forms. A broadcast waits for a
server at most ``send_deadline_s``: a frozen server's link waits aside until its send ends,
while the others keep getting every version (``transport/weight_fanout.py``). A link forms on a
worker thread the loop does not wait for: a link id no server joins here (a stale record, or a
server linked to someone else's store) fails after ``link_timeout_s``, is counted
(``weight_links_failed``) and is not tried again; its server relinks under a new id.
The version and its time are recorded in Redis. A restarted trainer asks for the version held
here (``WeightsRequest`` on the ``current`` endpoint) and continues from it when it is newer
than its own checkpoint, so training never steps back behind what the servers act with.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from rlvla3.config.role_settings import WeightBroadcasterSettings
from rlvla3.runtime.role import Role
from rlvla3.runtime.role_main import main
from transport import sockets
from transport.messages import WeightsRequest, WeightsUpdate
from transport.socket_limits import CONTROL_LIMITS, MIB, weights_limits
from transport.weight_auth import VersionGate
from transport.weight_fanout import Broadcaster
from transport.weights import start_store

_LINK_SCAN_PERIOD_S = 0.5


SLOW_LINK_MB_PER_S = 100
"""The slowest link a send deadline allows for (MB/s, about 1 Gb/s Ethernet's): a version takes
at least its size over this before its link counts as late."""


def send_deadline_s(setting_s: float, numel: int) -> float:
    """How long a send of ``numel`` float32 values may take before its link is set aside: the
    setting, or the time a slow link takes for a version of this size when that is longer (a
    large model's every send would otherwise be late)."""
    return max(setting_s, 4 * numel / 1e6 / SLOW_LINK_MB_PER_S)


class WeightBroadcaster(Role[WeightBroadcasterSettings]):
    """Owns the versioned copy of the latest weights and fans it out to rollout servers."""

    name = "weight_broadcaster"

    def setup(self) -> None:
        weights = weights_limits(self.settings.max_weights_mb * MIB)
        self.updates = self.own(
            sockets.pull(hwm=4, on_bad_frame=self.count_bad_frame, limits=weights)
        )
        self.bind("updates", self.updates)
        self.requests = self.own(
            sockets.RouterSocket(on_bad_frame=self.count_bad_frame, limits=CONTROL_LIMITS)
        )
        self.bind("current", self.requests)
        self.current: WeightsUpdate | None = None  # the version held, for WeightsRequest
        self.store = start_store(self.address, timeout_s=self.settings.link_timeout_s)
        self.registry.publish_endpoint(
            self.name, self.index, "store", f"{self.address}:{self.store.port}"
        )
        self.broadcaster = Broadcaster(
            self.store, self.settings.device, self.settings.link_timeout_s, host=self.address
        )
        self.gate = VersionGate(self.weights_key)
        self.layout: str | None = None  # the first accepted update fixes layout and size
        self.numel = 0
        self.next_link_scan = 0.0
        self.failed_links: set[str] = set()  # ids that failed to link: not tried again

    def step(self) -> None:
        update = self._newest_valid_update(timeout_s=0.1)
        if update is not None:
            self._publish(update)
        self._answer_requests()
        if time.monotonic() >= self.next_link_scan:
            self._sync_links()
            self.next_link_scan = time.monotonic() + _LINK_SCAN_PERIOD_S

    def _newest_valid_update(self, timeout_s: float) -> WeightsUpdate | None:
        """The newest acceptable update received (a backlog: only the newest is worth sending).
        Every update is checked, so a bad one is refused and counted even in a backlog."""
        newest: WeightsUpdate | None = None
        update = self.updates.recv(timeout_s=timeout_s)
        while update is not None:
            problem = (
                self._update_problem(update)
                if isinstance(update, WeightsUpdate)
                else f"a {type(update).__name__} is not a WeightsUpdate"
            )
            if problem is not None:
                version = getattr(update, "version", "?")
                self.drop("weights_rejected", f"weights v{version} dropped: {problem}")
            elif newest is None or update.version > newest.version:
                newest = update
            update = self.updates.recv(timeout_s=0) if self.updates.poll(0) else None
        return newest

    def _answer_requests(self) -> None:
        """Answer every waiting ``WeightsRequest`` with the weights held (or version -1)."""
        while self.requests.poll(0):
            got = self.requests.recv_from(timeout_s=0)
            if got is None:
                continue  # a bad frame: counted by the socket
            peer, request = got
            if not isinstance(request, WeightsRequest):
                self.drop("bad_frames", f"dropped a {type(request).__name__} on 'current'")
                continue
            held = self.current
            if held is None or held.version <= request.after_version:
                held = WeightsUpdate(version=-1, layout="", flat=np.zeros(0, np.float32))
            self.requests.send_to(peer, held)

    def _publish(self, update: WeightsUpdate) -> None:
        self.current = update
        self.gate.accept(update.version, update.tag)
        self.layout, self.numel = update.layout, update.flat.size
        with warnings.catch_warnings():  # a read-only view of the received frame, only read
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(update.flat).to(self.settings.device)
        started = time.perf_counter()
        late_before = set(self.broadcaster.late)
        failed = self.broadcaster.publish(
            update.version,
            flat,
            self.stop_event.is_set,
            tag=update.tag,
            deadline_s=self._deadline_s(),
        )
        for link_id in sorted(set(self.broadcaster.late) - late_before):
            self.drop(
                "weight_sends_late",
                f"link {link_id} took v{update.version} for longer than "
                f"{self._deadline_s():.3g}s (send_deadline_s, or the version's size at "
                f"{SLOW_LINK_MB_PER_S} MB/s): not waited for",
            )
        self.registry.set_weight_version(update.version)
        self.gauge("policy_version", update.version)
        self.gauge("last_sync_ms", (time.perf_counter() - started) * 1000)
        self.gauge("links", len(self.broadcaster.links))
        if failed:
            live = self._server_links()
            for link_id in failed:  # a server that is stopping closes its link: no warning
                log = self.log.warning if link_id in live else self.log.info
                log(
                    "link %s %s during broadcast: dropped",
                    link_id,
                    "failed" if link_id in live else "closed (its server stopped)",
                )

    def _deadline_s(self) -> float:
        return send_deadline_s(self.settings.send_deadline_s, self.numel or 0)

    def _update_problem(self, update: WeightsUpdate) -> str | None:
        """Why ``update`` must not go to the rollout servers (None: it may)."""
        flat = update.flat
        if flat.dtype != np.float32 or flat.ndim != 1:
            return f"flat is {flat.dtype}{list(flat.shape)}, expected float32[N]"
        if self.layout is not None and (update.layout, flat.size) != (self.layout, self.numel):
            return (
                f"layout {update.layout} of {flat.size} values, expected {self.layout} of "
                f"{self.numel}"
            )
        if update.version <= self.gate.newest:  # (before asking Redis: a backlog's older ones)
            return f"not newer than v{self.gate.newest}"
        trained = self.registry.trained_version()
        started = time.perf_counter()
        problem = self.gate.problem(update.version, flat, update.tag, trained)
        self.gauge("weights_check_ms", (time.perf_counter() - started) * 1000)
        return problem

    def _sync_links(self) -> None:
        live = self._server_links()
        self._rejoin_late()
        self._take_formed_links(live)
        self.failed_links &= live  # a link id is never reused: forget those gone from Redis
        for link_id in sorted(live - self.failed_links):
            self.broadcaster.start_link(link_id)  # (no-op for a link formed or forming)
        for link_id in set(self.broadcaster.links) - live:
            self.broadcaster.remove(link_id)
        self.gauge("links", len(self.broadcaster.links))

    def _take_formed_links(self, live: set[str]) -> None:
        """Links whose forming ended: log those formed; count those that failed, which are
        not tried again (their server relinks under a new id if it is still waiting)."""
        linked, failed = self.broadcaster.take_formed(self.stop_event.is_set, self._deadline_s())
        for link_id in linked:
            self.log.info("linked %s (sent v%d)", link_id, self.broadcaster.version)
        for link_id, why in sorted(failed.items()):
            self.failed_links.add(link_id)
            if link_id in live:
                self.drop("weight_links_failed", f"could not link {link_id}: {why}")

    def _rejoin_late(self) -> None:
        """Links whose late send has ended rejoin (their server came back) or are forgotten."""
        rejoined, failed = self.broadcaster.rejoin_late(self.stop_event.is_set, self._deadline_s())
        for link_id in rejoined:
            self.log.info("link %s is back: sent v%d", link_id, self.broadcaster.version)
        for link_id in failed:
            self.log.info("link %s failed after a late send: dropped", link_id)

    def _server_links(self) -> set[str]:
        """The weight links every live rollout server (evaluation's included) asks for."""
        return {
            link
            for role in ("rollout_server", "eval_rollout_server")
            for link in self.registry.endpoints(role, "weights_link")
        }


if __name__ == "__main__":
    main(WeightBroadcaster)
