"""Bus demo role: pushes ``DemoPing`` messages to the demo sink at a fixed rate.

Proves registry, discovery, codec and queues end to end before the RL roles exist; to be removed
once those roles carry real data.
"""

from __future__ import annotations

import time

import numpy as np

from rlvla3.messages import DemoPing
from rlvla3.role import Role, main
from transport import sockets


class DemoSource(Role):
    """Sends ``settings.rate_hz`` pings per second to every live demo sink."""

    name = "demo_source"

    def setup(self) -> None:
        self.queue = sockets.push(hwm=self.settings.queue_hwm)
        self.queue.connect(self.wait_for_endpoints("demo_sink", "queue"))
        self.seq = 0
        self.payload = np.arange(self.settings.payload_elements, dtype=np.float32)
        self.next_send = time.monotonic()

    def step(self) -> None:
        delay = self.next_send - time.monotonic()
        if delay > 0 and self.stop_event.wait(delay):  # pacing to rate_hz, woken by a stop
            return
        self.next_send += 1.0 / self.settings.rate_hz
        msg = DemoPing(seq=self.seq, sender=f"{self.name}/{self.index}", payload=self.payload)
        if self.queue.send(msg, timeout_s=0.5):
            self.seq += 1
            self.count("demo_sent")

    def shutdown(self) -> None:
        if hasattr(self, "queue"):
            self.queue.close()


if __name__ == "__main__":
    main(DemoSource)
