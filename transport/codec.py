"""Message codec: one msgpack header frame plus one raw frame per array. Never pickle.

Arrays (numpy, or CPU torch tensors) are replaced in the header by a msgpack extension that holds
their frame index, dtype and shape; their bytes travel as separate frames that ZeroMQ sends
without copying. Decoding trusts nothing: sizes are bounded, dtypes come from an allow-list, every
field is checked against the schema in ``rlvla3/messages.py``, and any problem raises a
``CodecError`` subclass that names the message and field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from rlvla3.messages import MESSAGE_TYPES, SCHEMA_VERSION

_ARRAY_EXT = 1
_ALLOWED_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
    + ["float16", "float32", "float64"]
)


class CodecError(Exception):
    """A frame could not be decoded. The receiving role counts it and carries on."""


class MalformedFrame(CodecError):
    """The frames are not a valid message (bad msgpack, wrong fields, inconsistent sizes)."""


class OversizedFrame(CodecError):
    """A frame or array exceeds the configured decode limits."""


class UnknownMessage(CodecError):
    """The header names a message type this schema does not have."""


class SchemaMismatch(CodecError):
    """The sender uses another schema version."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecLimits:
    """Upper bounds enforced while decoding untrusted frames."""

    max_header_bytes: int = 1 << 20
    max_frame_bytes: int = 1 << 30
    max_frames: int = 4096
    max_array_elements: int = 1 << 28


DEFAULT_LIMITS = CodecLimits()


def encode(msg: Any) -> list[Any]:
    """Frames for ``msg``: ``[header, *array_buffers]``; buffers are zero-copy memoryviews."""
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise TypeError(f"encode: {name} is not a message type of rlvla3.messages")
    buffers: list[Any] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, np.generic):
            return obj.item()  # numpy scalars travel as plain msgpack numbers
        arr = _as_array(obj)
        if arr is None:
            raise TypeError(f"encode {name}: cannot encode {type(obj).__name__}")
        if arr.dtype.name not in _ALLOWED_DTYPES:
            raise TypeError(f"encode {name}: dtype {arr.dtype} is not supported")
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("="))
        is_tensor = not isinstance(obj, np.ndarray)
        meta = msgpack.packb([len(buffers) + 1, arr.dtype.name, list(arr.shape), is_tensor])
        buffers.append(arr.reshape(-1).view(np.uint8).data if arr.size else b"")
        return msgpack.ExtType(_ARRAY_EXT, meta)

    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    header = msgpack.packb([SCHEMA_VERSION, name, fields], default=default, use_bin_type=True)
    return [header, *buffers]


def decode(frames: Sequence[Any], limits: CodecLimits = DEFAULT_LIMITS) -> Any:
    """Rebuild a message from ``frames`` (bytes, memoryviews or zmq Frames).

    Raises:
        CodecError: a subclass saying what is wrong; the frames are never partially trusted.
    """
    if not frames:
        raise MalformedFrame("empty message: no header frame")
    if len(frames) > limits.max_frames:
        raise OversizedFrame(f"{len(frames)} frames exceed max_frames={limits.max_frames}")
    bufs = [_buffer(f) for f in frames]
    if len(bufs[0]) > limits.max_header_bytes:
        raise OversizedFrame(f"header of {len(bufs[0])} bytes exceeds {limits.max_header_bytes}")
    used: set[int] = set()

    def ext_hook(code: int, data: bytes) -> Any:
        if code != _ARRAY_EXT:
            raise MalformedFrame(f"unknown msgpack extension type {code}")
        index = _array_index(data, len(bufs), used)
        return _array_from(data, bufs[index], limits)

    try:
        version, name, fields = msgpack.unpackb(bufs[0], ext_hook=ext_hook, raw=False)
    except CodecError:
        raise
    except Exception as err:  # msgpack raises several unrelated types on garbage
        raise MalformedFrame(f"header is not a valid msgpack message: {err}") from err
    if len(used) != len(bufs) - 1:
        raise MalformedFrame(f"{name}: {len(bufs) - 1} data frames but {len(used)} referenced")
    return _build(version, name, fields)


def _build(version: Any, name: Any, fields: Any) -> Any:
    if version != SCHEMA_VERSION:
        raise SchemaMismatch(f"schema version {version!r}, this side speaks {SCHEMA_VERSION}")
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise UnknownMessage(f"unknown message type {name!r}")
    if not isinstance(fields, dict):
        raise MalformedFrame(f"{name}: fields must be a mapping")
    expected = {f.name: f for f in dataclasses.fields(cls)}
    for key in fields:
        if key not in expected:
            raise MalformedFrame(f"{name}.{key}: unknown field")
    for key, f in expected.items():
        if key not in fields and f.default is dataclasses.MISSING:
            raise MalformedFrame(f"{name}.{key}: missing field")
        if key in fields:
            _check_field(name, key, f.type, fields[key])
    return cls(**fields)


_FIELD_CHECKS: dict[str, Any] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "np.ndarray": lambda v: isinstance(v, np.ndarray) or _is_tensor(v),
    "Obs": lambda v: isinstance(v, dict)
    and all(isinstance(k, str) and (isinstance(a, np.ndarray) or _is_tensor(a)) for k, a in v.items()),
}


def _check_field(msg: str, key: str, annotation: Any, value: Any) -> None:
    check = _FIELD_CHECKS[str(annotation)]
    if not check(value):
        raise MalformedFrame(f"{msg}.{key}: expected {annotation}, got {type(value).__name__}")


def _array_index(meta: bytes, num_bufs: int, used: set[int]) -> int:
    try:
        index = msgpack.unpackb(meta)[0]
    except Exception as err:
        raise MalformedFrame(f"bad array descriptor: {err}") from err
    if not isinstance(index, int) or not 1 <= index < num_bufs or index in used:
        raise MalformedFrame(f"array refers to frame {index!r} of {num_bufs}")
    used.add(index)
    return index


def _array_from(meta: bytes, buf: memoryview, limits: CodecLimits) -> Any:
    try:
        _, dtype, shape, is_tensor = msgpack.unpackb(meta)
    except Exception as err:
        raise MalformedFrame(f"bad array descriptor: {err}") from err
    if dtype not in _ALLOWED_DTYPES:
        raise MalformedFrame(f"array dtype {dtype!r} is not allowed")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise MalformedFrame(f"array shape {shape!r} is not a list of non-negative ints")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count > limits.max_array_elements:
        raise OversizedFrame(f"array of {count} elements exceeds {limits.max_array_elements}")
    if len(buf) > limits.max_frame_bytes:
        raise OversizedFrame(f"frame of {len(buf)} bytes exceeds {limits.max_frame_bytes}")
    dt = np.dtype(dtype)
    if count * dt.itemsize != len(buf):
        raise MalformedFrame(f"array {dtype}{shape} needs {count * dt.itemsize} bytes, got {len(buf)}")
    arr = np.frombuffer(buf, dtype=dt, count=count).reshape(shape)
    if is_tensor:
        import torch

        return torch.from_numpy(arr.copy())  # a writable copy: torch tensors assume ownership
    return arr


def _as_array(obj: Any) -> np.ndarray | None:
    if isinstance(obj, np.ndarray):
        return obj
    if _is_tensor(obj):
        if obj.device.type != "cpu":
            raise TypeError(f"encode: tensor on {obj.device}; move it to the CPU first")
        return obj.detach().numpy()
    return None


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "numpy")


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    view = memoryview(buf)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
