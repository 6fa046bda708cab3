"""Counter flushes on a real Redis: each applied once, even when the reply to one is lost."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator

import pytest
import redis

from rlvla3.runtime.chunk_ledger import balance
from rlvla3.runtime.counter_batch import CounterBatch
from rlvla3.runtime.registry import Registry


def test_redis_applies_each_flush_number_once(registry: Registry) -> None:
    """A retried number is skipped, a newer one applied; another flusher numbers its own."""
    assert registry.flush({"chunks_produced": 3}, {"pushed|p": 2}, {}, flusher="a", number=0)
    assert not registry.flush({"chunks_produced": 3}, {"pushed|p": 2}, {}, flusher="a", number=0)
    assert registry.flush({"chunks_received": 3}, {}, {"buffered|t": 3}, flusher="b", number=0)
    assert registry.flush(
        {"chunks_consumed": 3, "env_steps": 0}, {}, {"buffered|t": -3}, flusher="b", number=1
    )
    counters = registry.counters()
    assert counters == {"chunks_produced": 3, "chunks_received": 3, "chunks_consumed": 3}
    ledger = registry.chunk_ledger()
    assert ledger == {"pushed|p": 2, "buffered|t": 0}
    assert balance(ledger, counters).balanced


class ReplyDropper:
    """A TCP proxy on loopback to a Redis on a unix socket that, once armed, passes the next
    transaction (``EXEC``) to Redis and closes the client's connection when the reply comes,
    instead of passing it on: Redis applied it, the client cannot know."""

    def __init__(self, unix_path: str) -> None:
        self.unix_path = unix_path
        self.armed = threading.Event()
        self.dropped = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.socket(socket.AF_UNIX)
            server.connect(self.unix_path)
            exec_sent = threading.Event()
            threading.Thread(target=self._requests, args=(client, server, exec_sent)).start()
            threading.Thread(target=self._replies, args=(server, client, exec_sent)).start()

    def _requests(self, client: socket.socket, server: socket.socket, exec_sent) -> None:
        try:
            while data := client.recv(65536):
                if self.armed.is_set() and b"EXEC" in data:
                    self.armed.clear()
                    exec_sent.set()
                server.sendall(data)
        except OSError:
            pass
        finally:
            server.close()

    def _replies(self, server: socket.socket, client: socket.socket, exec_sent) -> None:
        try:
            while data := server.recv(65536):
                if exec_sent.is_set() and b"*" in data:  # EXEC's reply: an array of results
                    self.dropped.set()
                    break
                client.sendall(data)
        except OSError:
            pass
        finally:
            client.shutdown(socket.SHUT_RDWR)
            client.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def dropper(redis_url: str) -> Iterator[ReplyDropper]:
    assert redis_url.startswith("unix://"), redis_url
    proxy = ReplyDropper(redis_url.removeprefix("unix://").split("?")[0])
    yield proxy
    proxy.close()


@pytest.mark.parametrize("client_retries", [True, False])
def test_a_flush_whose_reply_is_lost_is_counted_once(
    dropper: ReplyDropper, registry: Registry, client_retries: bool
) -> None:
    """The reply to a flush Redis applied never comes back. redis-py gives up on the watched
    transaction whether or not it retries calls itself (its default), and the flush reads
    whether it landed: it counts once."""
    url = f"redis://127.0.0.1:{dropper.port}/0"
    via_proxy = Registry(url, registry.run_id)
    if not client_retries:
        via_proxy.redis.connection_pool.connection_kwargs["retry"] = redis.retry.Retry(
            redis.backoff.NoBackoff(), 0
        )
    batch, log = CounterBatch("trainer/0#ab"), logging.getLogger("test")
    batch.flush(via_proxy, log)  # nothing gathered: no call
    batch.add("chunks_received", 4)
    batch.add_to_ledger("buffered|trainer/0", 4)
    dropper.armed.set()
    batch.flush(via_proxy, log)
    assert dropper.dropped.is_set()
    batch.add("chunks_received", 1)
    batch.flush(via_proxy, log)
    assert registry.counters() == {"chunks_received": 5}
    assert registry.chunk_ledger() == {"buffered|trainer/0": 4}
    via_proxy.close()
