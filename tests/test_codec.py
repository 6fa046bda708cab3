"""Codec: round trips for every message type and dtype; bad frames raise typed errors."""

from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.fuzz_frames import bad_message, nested_array_messages
from transport import messages as m
from transport.codec import (
    ZERO_COPY_MIN_BYTES,
    CodecError,
    CodecLimits,
    MalformedFrame,
    OversizedFrame,
    SchemaMismatch,
    UnknownMessage,
    decode,
    encode,
)
from transport.messages import SCHEMA_VERSION as V

DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
]

arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, max_side=5))
)
ints = st.integers(-(2**62), 2**62)
floats = st.floats(allow_nan=False, width=64)
obs = st.dictionaries(st.sampled_from(["state", "image", "instruction", "proprio"]), arrays)

MESSAGES = {
    m.ObsRequest: st.builds(m.ObsRequest, env_key=st.text(), request_id=ints, obs=obs),
    m.ActionReply: st.builds(
        m.ActionReply,
        request_id=ints,
        action=arrays,
        env_action=st.none() | arrays,
        log_prob=floats,
        value=floats,
        policy_version=ints,
    ),
    m.ObsBatchRequest: st.builds(m.ObsBatchRequest, env_key=st.text(), request_id=ints, obs=obs),
    m.ActionBatchReply: st.builds(
        m.ActionBatchReply,
        request_id=ints,
        actions=arrays,
        env_actions=st.none() | arrays,
        log_probs=arrays,
        values=arrays,
        policy_version=ints,
    ),
    m.TrajectoryChunk: st.builds(
        m.TrajectoryChunk,
        worker_index=ints,
        env_index=ints,
        chunk_id=ints,
        obs=obs,
        actions=arrays,
        rewards=arrays,
        terminated=arrays,
        truncated=arrays,
        log_probs=arrays,
        values=arrays,
        policy_versions=arrays,
        bootstrap_value=floats,
        producer=st.text(),
    ),
    m.WeightsUpdate: st.builds(m.WeightsUpdate, version=ints, layout=st.text(), flat=arrays),
    m.WeightsRequest: st.builds(m.WeightsRequest, after_version=ints),
}


def assert_same(a: object, b: object) -> None:
    assert type(a) is type(b)
    for f in msgspec.structs.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                np.testing.assert_array_equal(x[k], y[k])
                assert x[k].dtype == y[k].dtype
        elif isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
            assert x.dtype == y.dtype and x.shape == y.shape
        else:
            assert x == y


def test_every_message_type_has_a_strategy() -> None:
    assert set(MESSAGES) == set(m.MESSAGE_TYPES.values())


@pytest.mark.parametrize("cls", list(MESSAGES), ids=lambda c: c.__name__)
def test_round_trip(cls: type) -> None:
    @settings(max_examples=60, deadline=None)
    @given(MESSAGES[cls])
    def check(msg: object) -> None:
        frames = [bytes(memoryview(f)) for f in encode(msg)]  # as the wire delivers them
        assert_same(decode(frames), msg)

    check()


def test_large_arrays_are_not_copied_on_encode() -> None:
    arr = np.arange(ZERO_COPY_MIN_BYTES, dtype=np.float32)
    frames = encode(m.WeightsUpdate(version=1, layout="a", flat=arr))
    assert len(frames) == 2
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.float32), arr)


def test_small_arrays_travel_inline_in_one_frame() -> None:
    reply = m.ActionReply(
        request_id=1,
        action=np.array(1),
        env_action=np.array([0.5, -0.5]),
        log_prob=-0.7,
        value=0.1,
        policy_version=3,
    )
    frames = encode(reply)
    assert len(frames) == 1
    assert_same(decode(frames), reply)


def test_reply_without_env_action_steps_with_the_action() -> None:
    reply = m.ActionReply(
        request_id=1, action=np.array(1), log_prob=-0.7, value=0.1, policy_version=3
    )
    back = decode(encode(reply))
    assert back.env_action is None and back.env_step_action is back.action
    with_env = m.ActionReply(
        request_id=1,
        action=np.array([3]),
        env_action=np.array([0.5]),
        log_prob=-0.7,
        value=0.1,
        policy_version=3,
    )
    np.testing.assert_array_equal(decode(encode(with_env)).env_step_action, [0.5])
    with pytest.raises(TypeError, match="ActionReply.env_action: expected an array or None"):
        encode(
            m.ActionReply(
                request_id=1,
                action=np.array(1),
                env_action=[0.5],
                log_prob=-0.7,
                value=0.1,
                policy_version=3,
            )
        )


def test_cpu_tensors_are_sent_and_arrive_as_numpy_arrays() -> None:
    t = torch.randn(3, 4)
    back = decode(encode(m.WeightsUpdate(version=0, layout="x", flat=t)))
    assert isinstance(back.flat, np.ndarray) and torch.equal(torch.tensor(back.flat), t)


def test_non_contiguous_and_big_endian_arrays() -> None:
    arr = np.arange(24, dtype=">i4").reshape(4, 6)[:, ::2]
    back = decode(encode(m.WeightsUpdate(version=0, layout="x", flat=arr)))
    np.testing.assert_array_equal(back.flat, arr)


def test_encode_rejects_unsupported_values() -> None:
    with pytest.raises(TypeError, match="WeightsUpdate.flat: dtype"):
        encode(m.WeightsUpdate(version=0, layout="x", flat=np.array(["a"])))
    with pytest.raises(TypeError, match="WeightsUpdate.flat: "):
        encode(m.WeightsUpdate(version=0, layout="x", flat=[1.0, 2.0]))
    with pytest.raises(TypeError, match="not a message type"):
        encode({"seq": 1})


def _big_frames() -> list[bytes]:
    """A WeightsUpdate whose array travels in its own data frame (16 * 4096 float32 = 64 KiB)."""
    flat = np.ones(ZERO_COPY_MIN_BYTES // 4, np.float32)
    return [bytes(f) for f in encode(m.WeightsUpdate(version=1, layout="s", flat=flat))]


def _header(version: object, name: object, values: list) -> bytes:
    return msgpack.packb([version, [name, *values]])


def _update(flat: object) -> bytes:
    return _header(V, "WeightsUpdate", [1, "s", flat])


@pytest.mark.parametrize(
    ("frames", "error", "text"),
    [
        ([], MalformedFrame, "no header"),
        ([b"\xc1garbage"], MalformedFrame, "not a valid msgpack"),
        ([b"\x92\x02"], MalformedFrame, "not a valid msgpack"),  # truncated header
        ([msgpack.packb(5)], MalformedFrame, "must be \\[version, message\\]"),
        (
            [msgpack.packb([V, {"command": "x"}])],
            MalformedFrame,
            "must be \\[name, \\*field values\\]",
        ),
        (_big_frames()[:1], MalformedFrame, "WeightsUpdate.flat: array refers to frame 1"),
        ([_big_frames()[0], _big_frames()[1][:7]], MalformedFrame, "needs 65536 bytes, got 7"),
        ([*_big_frames(), b"extra"], MalformedFrame, "2 data frames but 1 referenced"),
        ([_header(99, "WeightsUpdate", [])], SchemaMismatch, "schema version 99"),
        ([_header(V, "Evil", [])], UnknownMessage, "'Evil'"),
        (
            [_header(V, "WeightsUpdate", [1, "x", None, b"", 5])],
            MalformedFrame,
            "WeightsUpdate: expected 3 to 4 field values, got 5",
        ),
        (
            [_header(V, "WeightsUpdate", [])],
            MalformedFrame,
            "WeightsUpdate: expected 3 to 4 field values, got 0",
        ),
        (
            [_header(V, "WeightsUpdate", ["1", "x", None])],
            MalformedFrame,
            "WeightsUpdate.version: Expected `int`",
        ),
        (
            [_header(V, "WeightsUpdate", [True, "x", None])],
            MalformedFrame,
            "WeightsUpdate.version: Expected `int`",
        ),
        (
            [_update(["object", [1], b"x"])],
            MalformedFrame,
            "WeightsUpdate.flat: array dtype 'object'",
        ),
        ([_update(5)], MalformedFrame, "WeightsUpdate.flat: Expected `array`, got `int`"),
        ([_update(["float32", [4], b"123"])], MalformedFrame, "needs 16 bytes, got 3"),
        (
            [_update(["float32", [-1], b""])],
            MalformedFrame,
            "WeightsUpdate.flat\\[1\\]\\[0\\]: Expected `int` >= 0",
        ),
        (
            [_update(["float32", 4, b""])],
            MalformedFrame,
            "WeightsUpdate.flat\\[1\\]: Expected `array`",
        ),
        (
            [_header(V, "ObsRequest", ["0/0", 1, {b"k": ["uint8", [1], b"x"]}])],
            MalformedFrame,
            "ObsRequest.obs: Expected `str`, got `bytes` \\(a key\\)",
        ),
        (
            [_header(V, "ObsRequest", ["0/0", 1, {"image": ["uint8", [2], b"x"]}])],
            MalformedFrame,
            "ObsRequest.obs\\['image'\\]: array uint8\\[2\\] needs 2 bytes",
        ),
        (
            [
                _header(V, "TrajectoryChunk", [0, 0, 0, {}, *[["uint8", [65536], 1]] * 7, 0.0]),
                b"\x00" * 65536,
            ],
            MalformedFrame,
            "TrajectoryChunk.rewards: array refers to frame 1",
        ),
    ],
)
def test_malformed_frames_raise_typed_errors(frames: list, error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        decode(frames)


def test_oversized_frames_are_rejected() -> None:
    frames = encode(m.WeightsUpdate(version=1, layout="s", flat=np.zeros(10_000, np.float64)))
    with pytest.raises(OversizedFrame, match="elements exceeds"):
        decode(frames, CodecLimits(max_array_elements=100))
    with pytest.raises(OversizedFrame, match="bytes exceeds"):
        decode(frames, CodecLimits(max_frame_bytes=1000))
    with pytest.raises(OversizedFrame, match="header of"):
        decode(frames, CodecLimits(max_header_bytes=8))
    with pytest.raises(OversizedFrame, match="max_frames"):
        decode([frames[0]] * 10, CodecLimits(max_frames=4))


def test_huge_declared_shape_is_rejected_before_allocation() -> None:
    header = _update(["float64", [1 << 40, 1 << 20], 1])
    with pytest.raises(OversizedFrame, match="WeightsUpdate.flat: array of"):
        decode([header, b"\x00" * 8])


@settings(max_examples=300, deadline=None)
@given(bad_message())
def test_the_fuzz_suites_bad_messages_raise_only_codec_errors(frames: list[bytes]) -> None:
    """What ``tests/fuzz_frames.py`` draws for the fault suite's live sockets: garbage, cut
    short, wrong schema. Decoding raises a ``CodecError`` (which sockets count as a bad frame)
    and nothing else (which would stop the role)."""
    with pytest.raises(CodecError):
        decode(frames)


@pytest.mark.parametrize("frames", nested_array_messages(), ids=lambda f: f"{len(f[0])}B")
def test_deeply_nested_arrays_raise_a_codec_error_not_recursion(frames: list[bytes]) -> None:
    """~200 KB of nested msgpack arrays where an array belongs: a ``MalformedFrame`` (counted
    and dropped by a receiver), not a ``RecursionError``, which would stop the role."""
    with pytest.raises(MalformedFrame, match="Expected `"):
        decode(frames)
