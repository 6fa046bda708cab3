"""Message codec: one msgpack header frame plus one raw frame per array. Never pickle.

Arrays (numpy, or CPU torch tensors) are replaced in the header by a msgpack extension that holds
their frame index, dtype and shape; their bytes travel as separate frames that ZeroMQ sends
without copying. Decoding trusts nothing: sizes are bounded, dtypes come from an allow-list, every
field is checked against the schema in ``rlvla3/messages.py``, and any problem raises a
``CodecError`` subclass that names the message and field.
"""

from __future__ import annotations

import dataclasses
import threading
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
_DTYPES = {name: np.dtype(name) for name in _ALLOWED_DTYPES}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_local = threading.local()
ZERO_COPY_MIN_BYTES = 1 << 16


def encode(msg: Any) -> list[Any]:
    """Frames for ``msg``: ``[header, *array_buffers]``.

    Arrays of at least ``ZERO_COPY_MIN_BYTES`` are memoryviews of the caller's data (zero-copy:
    do not modify them until sent); smaller ones are copied into bytes.
    """
    schema = _SCHEMAS.get(type(msg))
    if schema is None:
        raise TypeError(f"encode: {type(msg).__name__} is not a message type of rlvla3.messages")
    buffers: list[Any] = []
    fields = {}
    for key in schema.names:
        value = getattr(msg, key)
        if isinstance(value, dict):
            value = {k: _encode_value(v, buffers, schema.name) for k, v in value.items()}
        else:
            value = _encode_value(value, buffers, schema.name)
        fields[key] = value
    return [_packer().pack([SCHEMA_VERSION, schema.name, fields]), *buffers]


def _encode_value(value: Any, buffers: list[Any], name: str) -> Any:
    if isinstance(value, (int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()  # numpy scalars travel as plain msgpack numbers
    arr = _as_array(value)
    if arr is None:
        raise TypeError(f"encode {name}: cannot encode {type(value).__name__}")
    dtype = _DTYPE_NAMES.get(arr.dtype)
    if dtype is None:
        if arr.dtype.name not in _ALLOWED_DTYPES:
            raise TypeError(f"encode {name}: dtype {arr.dtype} is not supported")
        arr, dtype = arr.astype(arr.dtype.newbyteorder("=")), arr.dtype.name
    if not arr.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
        arr = arr.copy(order="C")
    meta = _packer().pack([len(buffers) + 1, dtype, arr.shape, not isinstance(value, np.ndarray)])
    # Small arrays are cheaper to copy than to share; large ones go zero-copy.
    buffers.append(arr.tobytes() if arr.nbytes < ZERO_COPY_MIN_BYTES else arr.reshape(-1).data)
    return msgpack.ExtType(_ARRAY_EXT, meta)


def _packer() -> msgpack.Packer:
    # Creating a Packer costs more than packing a small header: keep one per thread.
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer


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
        return _array_from(data, bufs, used, limits)

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
    schema = _SCHEMAS_BY_NAME.get(name) if isinstance(name, str) else None
    if schema is None:
        raise UnknownMessage(f"unknown message type {name!r}")
    if not isinstance(fields, dict):
        raise MalformedFrame(f"{name}: fields must be a mapping")
    for key in fields:
        if key not in schema.checks:
            raise MalformedFrame(f"{name}.{key}: unknown field")
    for key in schema.required:
        if key not in fields:
            raise MalformedFrame(f"{name}.{key}: missing field")
    for key, value in fields.items():
        annotation, check = schema.checks[key]
        if not check(value):
            raise MalformedFrame(f"{name}.{key}: expected {annotation}, got {type(value).__name__}")
    return schema.cls(**fields)


def _is_array(v: Any) -> bool:
    return isinstance(v, np.ndarray) or _is_tensor(v)


_FIELD_CHECKS: dict[str, Any] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "np.ndarray": _is_array,
    "Obs": lambda v: (
        isinstance(v, dict) and all(isinstance(k, str) and _is_array(a) for k, a in v.items())
    ),
}


@dataclass(frozen=True, slots=True)
class _Schema:
    """What the codec needs to know of one message class, computed once."""

    cls: type
    name: str
    names: tuple[str, ...]
    required: tuple[str, ...]
    checks: dict[str, tuple[str, Any]]


def _schema(cls: type) -> _Schema:
    fields = dataclasses.fields(cls)
    return _Schema(
        cls=cls,
        name=cls.__name__,
        names=tuple(f.name for f in fields),
        required=tuple(f.name for f in fields if f.default is dataclasses.MISSING),
        checks={f.name: (str(f.type), _FIELD_CHECKS[str(f.type)]) for f in fields},
    )


_SCHEMAS = {cls: _schema(cls) for cls in MESSAGE_TYPES.values()}
_SCHEMAS_BY_NAME = {s.name: s for s in _SCHEMAS.values()}


def _array_from(meta: bytes, bufs: list[memoryview], used: set[int], limits: CodecLimits) -> Any:
    """The array an extension descriptor points to, after checking it against its frame."""
    try:
        index, dtype, shape, is_tensor = msgpack.unpackb(meta)
    except Exception as err:
        raise MalformedFrame(f"bad array descriptor: {err}") from err
    if type(index) is not int or not 1 <= index < len(bufs) or index in used:
        raise MalformedFrame(f"array refers to frame {index!r} of {len(bufs)}")
    used.add(index)
    dt = _DTYPES.get(dtype)
    if dt is None:
        raise MalformedFrame(f"array dtype {dtype!r} is not allowed")
    if type(shape) is not list:
        raise MalformedFrame(f"array shape {shape!r} is not a list")
    count = 1
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise MalformedFrame(f"array shape {shape!r} is not a list of non-negative ints")
        count *= dim  # Python ints: no overflow on hostile shapes
    if count > limits.max_array_elements:
        raise OversizedFrame(f"array of {count} elements exceeds {limits.max_array_elements}")
    buf = bufs[index]
    if len(buf) > limits.max_frame_bytes:
        raise OversizedFrame(f"frame of {len(buf)} bytes exceeds {limits.max_frame_bytes}")
    if count * dt.itemsize != len(buf):
        raise MalformedFrame(
            f"array {dtype}{shape} needs {count * dt.itemsize} bytes, got {len(buf)}"
        )
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
    if type(frame) is bytes:
        return memoryview(frame)
    view = memoryview(getattr(frame, "buffer", frame))  # zmq.Frame exposes .buffer
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
