"""Rank 0 of every weight link (``transport/weights.py``): the broadcaster's newest weights, sent
to every linked rollout server in parallel threads, so a sync costs about one broadcast.

A send to a frozen server blocks until the link's timeout, and nothing may wait that long: each
broadcast waits for its sends at most a deadline; a link whose send is still running then waits
aside (``late``), getting no other version, until that send ends: delivered, it rejoins and gets
the current version; failed, it is forgotten (its server relinks with a new link id).

Forming a link waits for its server to join, and a link id in Redis may name no one who will
(a stale record, or a server linked to another's store): links form on worker threads that no
broadcast waits for (``start_link``), each within the link's timeout, and ``take_formed`` picks
up how they ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from transport.weight_auth import NO_TAG
from transport.weights import WeightLink


class Broadcaster:
    """Rank 0 of every link: keeps the newest weights and sends them to all linked servers."""

    def __init__(
        self,
        store: dist.Store,
        device: str = "cpu",
        timeout_s: float = 60.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.store = store
        self.device = device
        self.timeout_s = timeout_s
        self.host = host
        self.links: dict[str, WeightLink] = {}
        self.late: dict[str, _LinkSend] = {}  # links whose send outlived its deadline
        self.linking: dict[str, _Task] = {}  # links still forming, each on its worker thread
        self.version = -1
        self.flat: torch.Tensor | None = None
        self.tag = NO_TAG

    def start_link(self, link_id: str) -> None:
        """Begin forming the link with a server, on a worker thread nothing waits for (it
        gives up after ``timeout_s`` with no server); ``take_formed`` takes it up."""
        if link_id in self.links or link_id in self.late or link_id in self.linking:
            return
        # Each on its own clone of the store: one client serves one call at a time, and a
        # link waiting for its server would hold the others' rendezvous until its timeout.
        self.linking[link_id] = _Task(
            lambda: WeightLink(
                self.store.clone(), link_id, 0, self.device, self.timeout_s, self.host
            )
        )

    def take_formed(
        self, should_stop: Callable[[], bool] = lambda: False, deadline_s: float | None = None
    ) -> tuple[list[str], dict[str, str]]:
        """Links whose forming has ended: those formed join and are sent the current version;
        those that failed are forgotten. Returns (linked, {failed: why})."""
        done = [i for i, task in self.linking.items() if not task.thread.is_alive()]
        formed: list[WeightLink] = []
        failed: dict[str, str] = {}
        for link_id in done:
            task = self.linking.pop(link_id)
            if task.error is not None:
                failed[link_id] = str(task.error)
            else:
                formed.append(task.result)
        self.links.update((link.link_id, link) for link in formed)
        for link_id in self._send(formed, should_stop, deadline_s):
            failed[link_id] = f"sending v{self.version} failed"
        return [link.link_id for link in formed if link.link_id not in failed], failed

    def add(self, link_id: str, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Form the link with a server and send it the current weights, waiting for both.

        Raises when the server does not join within the link's timeout, or the send fails;
        ``should_stop`` lets the caller give up waiting, as in ``publish``.
        """
        self.start_link(link_id)
        task = self.linking.get(link_id)
        if task is None:
            return  # linked already
        _wait_for([task.thread], should_stop)
        if task.thread.is_alive():
            raise InterruptedError(f"linking {link_id} abandoned: stopping")
        del self.linking[link_id]
        if task.error is not None:
            raise task.error
        self.links[link_id] = task.result
        if self._send([task.result], should_stop, None):
            raise ConnectionError(f"link {link_id}: sending v{self.version} failed")

    def remove(self, link_id: str) -> None:
        """Forget a server's link (it went away)."""
        self.links.pop(link_id, None)

    def close(self) -> None:
        """Leave every link: each server's pending receive fails, and it relinks."""
        for link in [*self.links.values(), *(send.link for send in self.late.values())]:
            link.close()
        self.links.clear()
        self.late.clear()

    def publish(
        self,
        version: int,
        flat: torch.Tensor,
        should_stop: Callable[[], bool] = lambda: False,
        tag: bytes = NO_TAG,
        deadline_s: float | None = None,
    ) -> list[str]:
        """Send ``flat`` as ``version``, with its ``tag``, to every link in parallel; returns
        the links that failed. (The caller checked the version: ``transport/weight_auth.py``.)

        A send to a dead or frozen peer blocks until the link's timeout; ``should_stop`` lets
        the caller give up waiting (a stopping broadcaster abandons the sends; the threads are
        daemons), and after ``deadline_s`` the sends still running are left to finish alone:
        their links wait in ``late`` (no other version is sent on them meanwhile) until
        ``rejoin_late`` finds them done.
        """
        self.version, self.flat, self.tag = version, flat, tag
        return self._send(list(self.links.values()), should_stop, deadline_s)

    def rejoin_late(
        self, should_stop: Callable[[], bool] = lambda: False, deadline_s: float | None = None
    ) -> tuple[list[str], list[str]]:
        """Links whose late send has finished: those it delivered are linked again and get the
        current version (if newer); those it failed on are forgotten. Returns (rejoined,
        failed)."""
        done = {i: s for i, s in self.late.items() if not s.task.thread.is_alive()}
        back, failed = [], []
        for link_id, send in done.items():
            del self.late[link_id]
            (failed if send.task.error is not None else back).append(send)
        for send in back:
            self.links[send.link.link_id] = send.link
        behind = [s.link for s in back if s.version < self.version and self.flat is not None]
        failed_ids = [s.link.link_id for s in failed]
        failed_ids += self._send(behind, should_stop, deadline_s)
        return [s.link.link_id for s in back], failed_ids

    def _send(
        self,
        links: list[WeightLink],
        should_stop: Callable[[], bool],
        deadline_s: float | None,
    ) -> list[str]:
        """Send the current version on ``links`` in parallel; a send not done by the deadline
        moves its link to ``late``. Returns the links that failed (and are dropped)."""
        if not links or self.flat is None:  # (no weights yet: a link gets them when they come)
            return []
        sends = [_LinkSend(link, self.version, self.flat, self.tag) for link in links]
        _wait_for([s.task.thread for s in sends], should_stop, deadline_s)
        failed = []
        for send in sends:
            if send.task.thread.is_alive():  # late: the peer is frozen or slow; not waited for
                self.links.pop(send.link.link_id, None)
                self.late[send.link.link_id] = send
            elif send.task.error is not None:  # a dead peer: drop its link, the others go on
                self.remove(send.link.link_id)
                failed.append(send.link.link_id)
        return failed


class _Task:
    """One call on a daemon thread, started at once (a blocked gloo/NCCL call cannot be
    interrupted, so no one need wait for it): what it returned or raised, once it has."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.result = call()
        except Exception as err:  # reported through ``error``
            self.error = err


class _LinkSend:
    """One version's send on one link, on its own thread."""

    def __init__(self, link: WeightLink, version: int, flat: torch.Tensor, tag: bytes) -> None:
        self.link, self.version = link, version
        self.task = _Task(lambda: link.send(version, flat, tag))


def _wait_for(
    threads: list[threading.Thread],
    should_stop: Callable[[], bool],
    deadline_s: float | None = None,
) -> None:
    """Wait for daemon ``threads`` until ``should_stop()`` or for at most ``deadline_s``
    (then leave them: a blocked gloo/NCCL call cannot be interrupted)."""
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    for t in threads:
        while t.is_alive() and not should_stop():
            if deadline is not None and time.monotonic() >= deadline:
                return
            t.join(timeout=0.1)
