"""Bad input for the sockets roles listen on, drawn by hypothesis (tests only).

``bad_message()`` draws one message (a list of ZeroMQ frames) that the codec must refuse:
garbage bytes, a valid message cut short, a valid message with its schema version, type name,
field count, a field's type or an array's declaration changed, unreferenced data frames. Every
drawn message is checked here against the codec, so each one is known to be refused (and, at a
live role, counted once in ``bad_frames``). ``draw_bad_messages(n)`` collects ``n`` of them.
"""

from __future__ import annotations

import hypothesis
import msgpack
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from transport.codec import CodecError, decode, encode
from transport.messages import (
    SCHEMA_VERSION,
    ActionReply,
    ObsRequest,
    TrajectoryChunk,
    WeightsRequest,
    WeightsUpdate,
)


def cartpole_chunk(steps: int, producer: str) -> TrajectoryChunk:
    """A consistent chunk of ``steps`` CartPole steps from ``producer``."""
    return TrajectoryChunk(
        worker_index=0,
        env_index=0,
        chunk_id=0,
        obs={"state": np.zeros((steps, 4), np.float32)},
        actions=np.zeros(steps, np.int64),
        rewards=np.ones(steps, np.float32),
        terminated=np.zeros(steps, bool),
        truncated=np.zeros(steps, bool),
        log_probs=np.zeros(steps, np.float32),
        values=np.zeros(steps, np.float32),
        policy_versions=np.zeros(steps, np.int64),
        bootstrap_value=0.0,
        producer=producer,
    )


# One well-formed message per type, the material that is cut and mutated.
_VALID = [
    encode(ObsRequest(env_key="0/0", request_id=7, obs={"state": np.zeros(4, np.float32)}))[0],
    encode(
        ActionReply(
            request_id=7, action=np.array(1, np.int64), log_prob=-0.5, value=1.0, policy_version=3
        )
    )[0],
    encode(cartpole_chunk(2, "0/0#fuzz"))[0],
    encode(WeightsUpdate(version=1, layout="x", flat=np.zeros(3, np.float32)))[0],
    encode(WeightsRequest(after_version=-1))[0],
]

_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def _mutated(draw: st.DrawFn) -> list[bytes]:
    """A valid header with one thing about it wrong."""
    version, body = msgpack.unpackb(draw(st.sampled_from(_VALID)), raw=False)
    how = draw(
        st.sampled_from(["version", "name", "drop", "extra", "field", "array", "not_a_message"])
    )
    if how == "version":
        version = draw(_msgpack_values.filter(lambda v: v != SCHEMA_VERSION))
    elif how == "name":
        body[0] = draw(_msgpack_values)
    elif how == "drop":
        body = body[: draw(st.integers(0, len(body) - 1))]
    elif how == "extra":
        body = body + draw(st.lists(_msgpack_values, min_size=1, max_size=3))
    elif how == "field":
        body[draw(st.integers(1, len(body) - 1))] = draw(_msgpack_values)
    elif how == "array":  # an array's [dtype, shape, data] declaration broken
        arrays = [i for i, v in enumerate(body) if isinstance(v, list) and len(v) == 3]
        dicts = [i for i, v in enumerate(body) if isinstance(v, dict) and v]
        if arrays:
            i = draw(st.sampled_from(arrays))
            body[i] = _broken_array(draw, body[i])
        elif dicts:
            i = draw(st.sampled_from(dicts))
            key = next(iter(body[i]))
            body[i][key] = _broken_array(draw, body[i][key])
        else:
            body = draw(_msgpack_values)
    else:
        return [msgpack.packb(draw(_msgpack_values))]
    return [msgpack.packb([version, body])]


def _broken_array(draw: st.DrawFn, array: list) -> list:
    dtype, shape, data = array
    part = draw(st.sampled_from(["dtype", "shape", "data", "huge"]))
    if part == "dtype":
        return [draw(st.sampled_from(["object", "complex128", "V8", "<U4", ""])), shape, data]
    if part == "shape":
        return [dtype, draw(st.lists(st.integers(-3, 9), max_size=4)), data]
    if part == "data":
        return [dtype, shape, draw(st.binary(max_size=40) | st.integers(1, 50))]
    return [dtype, [2**40, 2**40], data]  # declares far more than any limit allows


@st.composite
def _truncated(draw: st.DrawFn) -> list[bytes]:
    header = draw(st.sampled_from(_VALID))
    return [header[: draw(st.integers(0, len(header) - 1))]]


@st.composite
def _unreferenced_data_frames(draw: st.DrawFn) -> list[bytes]:
    extra = draw(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
    return [draw(st.sampled_from(_VALID)), *extra]


@st.composite
def bad_message(draw: st.DrawFn) -> list[bytes]:
    """A message (its frames) that the codec refuses."""
    frames = draw(
        st.one_of(
            st.lists(st.binary(max_size=256), min_size=1, max_size=3),
            _truncated(),
            _mutated(),
            _unreferenced_data_frames(),
        )
    )
    try:
        decode(frames)
    except CodecError:
        return frames
    # A mutation that happened to stay valid (e.g. one int for another): not bad input.
    draw(st.nothing())
    raise AssertionError("unreachable")


def draw_bad_messages(n: int, seed: int = 0) -> list[list[bytes]]:
    """``n`` messages from ``bad_message``, reproducibly for a given ``seed``."""
    drawn: list[list[bytes]] = []

    @hypothesis.seed(seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(bad_message())
    def collect(frames: list[bytes]) -> None:
        drawn.append(frames)

    collect()
    return drawn


def nested_array_messages(depth: int = 200_000) -> list[list[bytes]]:
    """One message per type with an array field that is ``depth`` nested msgpack arrays
    instead (~``depth`` bytes), as the array itself and as its shape: what crashed a role's
    decoder with ``RecursionError`` before the header was decoded against typed descriptors."""
    nest = b"\x91" * depth + b"\xc0"
    empty = ["float32", [0], b""]
    in_shape = b"\x93" + msgpack.packb("float32") + nest + msgpack.packb(b"")
    messages = []
    for array in (nest, in_shape):
        obs = b"\x81" + msgpack.packb("state") + array
        messages += [
            _header_with("ObsRequest", ["0/0", 7], obs, []),
            _header_with("WeightsUpdate", [1, "x"], array, []),
            _header_with("TrajectoryChunk", [0, 0, 0], obs, [*[empty] * 7, 0.0, "0/0#n", ""]),
        ]
    return [[header] for header in messages]


def _header_with(name: str, before: list, raw_value: bytes, after: list) -> bytes:
    """The header ``[version, [name, *before, <raw_value>, *after]]``, ``raw_value`` packed
    already (msgpack-python cannot pack nesting that deep)."""
    count = 2 + len(before) + len(after)
    assert count <= 15  # (a fixarray header)
    return b"".join(
        [
            b"\x92" + msgpack.packb(SCHEMA_VERSION) + bytes([0x90 | count]),
            *map(msgpack.packb, [name, *before]),
            raw_value,
            *map(msgpack.packb, after),
        ]
    )
