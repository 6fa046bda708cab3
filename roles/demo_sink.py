"""Bus demo role: pulls ``DemoPing`` messages and counts them (see ``roles/demo_source.py``)."""

from __future__ import annotations

from rlvla3.role import Role, main
from transport import sockets


class DemoSink(Role):
    """Receives pings from every demo source and counts them; bad frames are counted too."""

    name = "demo_sink"

    def setup(self) -> None:
        self.queue = sockets.pull(hwm=self.settings.queue_hwm, on_bad_frame=self.count_bad_frame)
        self.bind("queue", self.queue)

    def step(self) -> None:
        msg = self.queue.recv(timeout_s=0.2)
        if msg is not None:
            self.count("demo_received")
            self.gauge("last_seq", msg.seq)

    def shutdown(self) -> None:
        if hasattr(self, "queue"):
            self.queue.close()


if __name__ == "__main__":
    main(DemoSink)
