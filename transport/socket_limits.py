"""How large a message each kind of receiving socket accepts.

A ``MessageSocket`` sets ``ZMQ_MAXMSGSIZE`` to the largest frame its ``CodecLimits`` allow, so
libzmq drops an oversized frame (and disconnects its sender) before buffering it; the codec's
own bounds are the same numbers, so what libzmq lets through the codec can still refuse, but
nothing it would refuse is ever held whole in memory. One limit for every socket would have to
fit the largest message (weights): each kind gets what its real messages need instead.

| socket kind | takes | largest frame |
|---|---|---|
| a rollout server's requests | ``ObsRequest``, ``ObsBatchRequest`` | 2 x rows x observation bytes + 64 KiB, at least 1 MiB |
| an env's replies | ``ActionReply``, ``ActionBatchReply`` | rows x 16 KiB, at least 1 MiB |
| a trainer's chunks | ``TrajectoryChunk`` | ``chunk_len`` x (observation bytes + 4 KiB) + 1 MiB |
| weights (broadcaster's updates, a trainer's ask) | ``WeightsUpdate`` | the weights' bytes + 64 KiB |
| control (the broadcaster's ``current``) | ``WeightsRequest`` | 64 KiB |

Every kind takes at most ``MAX_DATA_FRAMES`` data frames a message: a message has one per
array field or observation key of 64 KiB or more, and a ``TrajectoryChunk``, the widest, has
seven array fields and its observation's keys.
"""

from __future__ import annotations

from transport.codec import ZERO_COPY_MIN_BYTES, CodecLimits

KIB, MIB = 1 << 10, 1 << 20
MAX_DATA_FRAMES = 63
REPLY_BYTES_PER_ROW = 16 * KIB
"""An action reply's row: the action, the env's action, three numbers; 16 KiB holds a
1,000-dimensional float64 action twice."""
STEP_BYTES_BEYOND_OBS = 4 * KIB
"""A chunk's step besides its observation: action (up to 512 float64 dims) and six numbers."""


def frame_limits(max_frame_bytes: int) -> CodecLimits:
    """Codec limits for a socket whose every frame, header included, is at most
    ``max_frame_bytes`` (an element is at least one byte, so no array holds more)."""
    return CodecLimits(
        max_header_bytes=max_frame_bytes,
        max_frame_bytes=max_frame_bytes,
        max_frames=1 + MAX_DATA_FRAMES,
        max_array_elements=max_frame_bytes,
    )


def request_limits(observation_bytes: int, rows: int) -> CodecLimits:
    """A rollout server's request socket: ``rows`` observations of ``observation_bytes`` each
    (``env.envs_per_request`` rows in an ``ObsBatchRequest``); twice that, for msgpack's
    framing of inline arrays and a margin."""
    return frame_limits(max(MIB, 2 * rows * observation_bytes + ZERO_COPY_MIN_BYTES))


def reply_limits(rows: int) -> CodecLimits:
    """An env's socket for action replies of ``rows`` rows."""
    return frame_limits(max(MIB, rows * REPLY_BYTES_PER_ROW))


def chunk_limits(observation_bytes: int, chunk_len: int) -> CodecLimits:
    """A trainer's chunk socket: at most ``chunk_len`` steps (``env.chunk_len``) a chunk."""
    return frame_limits(chunk_len * (observation_bytes + STEP_BYTES_BEYOND_OBS) + MIB)


def weights_limits(weights_bytes: int) -> CodecLimits:
    """A socket for ``WeightsUpdate`` of up to ``weights_bytes`` of values."""
    return frame_limits(weights_bytes + ZERO_COPY_MIN_BYTES)


CONTROL_LIMITS = frame_limits(ZERO_COPY_MIN_BYTES)
"""Sockets for small control messages (``WeightsRequest``)."""
