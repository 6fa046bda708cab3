"""The CartPole traffic of the request-reply benchmarks: an observation request, a fixed action
reply, and their encoded frames (what a raw pyzmq peer sends without our codec)."""

from __future__ import annotations

from typing import Any

import numpy as np

from transport.codec import encode
from transport.messages import ActionReply, ObsRequest

HOST = "127.0.0.1"
"""Every benchmark server binds loopback."""


def obs_request(i: int) -> ObsRequest:
    """A CartPole observation request (64 env keys in turn)."""
    state = np.full(4, (i % 100) * 0.01, np.float32)
    return ObsRequest(env_key=f"0/{i % 64}", request_id=i, obs={"state": state})


def frames(msg: Any) -> list[bytes]:
    """``msg`` encoded by our codec, as bytes to send with plain ``send_multipart``."""
    return [bytes(memoryview(f)) for f in encode(msg)]


def reply_frames() -> list[bytes]:
    """The frames of a CartPole ``ActionReply``, for servers that answer with fixed bytes."""
    return frames(
        ActionReply(
            request_id=7,
            action=np.array(1, np.int64),
            env_action=np.array(1, np.int64),
            log_prob=-0.69,
            value=0.5,
            policy_version=3,
        )
    )
