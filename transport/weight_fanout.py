"""Rank 0 of every weight link (``transport/weights.py``): the broadcaster's newest weights, sent
to every linked rollout server in parallel threads, so a sync costs about one broadcast.

A send to a frozen server blocks until the link's timeout, and nothing may wait that long: each
broadcast waits for its sends at most a deadline; a link whose send is still running then waits
aside (``late``), getting no other version, until that send ends: delivered, it rejoins and gets
the current version; failed, it is forgotten (its server relinks with a new link id).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

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
        self.version = -1
        self.flat: torch.Tensor | None = None
        self.tag = NO_TAG

    def add(self, link_id: str, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Form the link with a server and send it the current weights.

        Blocks until the server connects (or the link's timeout: then raises); ``should_stop``
        lets the caller give up waiting, as in ``publish``.
        """
        result: list[WeightLink | BaseException] = []

        def connect() -> None:
            try:
                link = WeightLink(self.store, link_id, 0, self.device, self.timeout_s, self.host)
                if self.flat is not None:
                    link.send(self.version, self.flat, self.tag)
                result.append(link)
            except Exception as err:  # reported to the caller below
                result.append(err)

        _run_until_stopped([threading.Thread(target=connect, daemon=True)], should_stop)
        if not result:
            raise InterruptedError(f"linking {link_id} abandoned: stopping")
        if isinstance(result[0], BaseException):
            raise result[0]
        self.links[link_id] = result[0]

    def remove(self, link_id: str) -> None:
        """Forget a server's link (it went away)."""
        self.links.pop(link_id, None)

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
        done = {i: s for i, s in self.late.items() if not s.thread.is_alive()}
        back, failed = [], []
        for link_id, send in done.items():
            del self.late[link_id]
            (failed if send.error is not None else back).append(send)
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
        _run_until_stopped([s.thread for s in sends], should_stop, deadline_s)
        failed = []
        for send in sends:
            if send.thread.is_alive():  # late: the peer is frozen or slow; not waited for
                self.links.pop(send.link.link_id, None)
                self.late[send.link.link_id] = send
            elif send.error is not None:  # a dead peer: drop its link, the others go on
                self.remove(send.link.link_id)
                failed.append(send.link.link_id)
        return failed


class _LinkSend:
    """One version's send on one link, in a daemon thread: how it ended, once it has."""

    def __init__(self, link: WeightLink, version: int, flat: torch.Tensor, tag: bytes) -> None:
        self.link, self.version = link, version
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(flat, tag), daemon=True)

    def _run(self, flat: torch.Tensor, tag: bytes) -> None:
        try:
            self.link.send(self.version, flat, tag)
        except Exception as err:  # reported through ``error``
            self.error = err


def _run_until_stopped(
    threads: list[threading.Thread],
    should_stop: Callable[[], bool],
    deadline_s: float | None = None,
) -> None:
    """Start daemon ``threads`` and wait for them, until ``should_stop()`` or for at most
    ``deadline_s`` (then leave them: a blocked gloo/NCCL call cannot be interrupted)."""
    for t in threads:
        t.start()
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    for t in threads:
        while t.is_alive() and not should_stop():
            if deadline is not None and time.monotonic() >= deadline:
                return
            t.join(timeout=0.1)
