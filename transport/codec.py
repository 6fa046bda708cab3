"""Message codec: one msgpack header frame, plus one raw frame per large array. Never pickle.

Wire format (``rlvla3.messages.SCHEMA_VERSION`` 2)::

    frame 0:  msgpack [version, message_name, [value of each field, in schema order]]
    frame 1+: raw bytes of each array of at least ZERO_COPY_MIN_BYTES (sent without copying)

An array value is ``[dtype_name, shape, data, is_tensor]``: ``data`` is the array's bytes inline
(arrays under ``ZERO_COPY_MIN_BYTES``) or the index of the frame that holds them. Why this shape:
on the hot path (``ObsRequest`` / ``ActionReply``) every extra ZeroMQ frame costs more than the
copy of a small array, and knowing each field's type from the schema lets the decoder check values
positionally, without per-array msgpack extension callbacks. Measured on the 2-core CI machine:
an ``ActionReply`` went from 3 frames, 13 µs encode / 23 µs decode to 1 frame, ~5 / ~8 µs.

Decoding trusts nothing: sizes are bounded, dtypes come from an allow-list, every field is checked
against the schema in ``rlvla3/messages.py``, every data frame must be referenced exactly once,
and any problem raises a ``CodecError`` subclass that names the message and field.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from rlvla3.messages import MESSAGE_TYPES, SCHEMA_VERSION

_ALLOWED_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
    + ["float16", "float32", "float64"]
)
ZERO_COPY_MIN_BYTES = 1 << 16  # smaller arrays travel inline in the header (one frame)


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
    """Upper bounds enforced while decoding untrusted frames.

    Attributes:
        max_header_bytes: header frame size (it carries the inline arrays, each < 64 KiB).
        max_frame_bytes: size of one data frame.
        max_frames: frames per message.
        max_array_elements: elements of one array, checked before anything is allocated.
    """

    max_header_bytes: int = 1 << 26
    max_frame_bytes: int = 1 << 30
    max_frames: int = 4096
    max_array_elements: int = 1 << 28


DEFAULT_LIMITS = CodecLimits()
_DTYPES = {name: np.dtype(name) for name in _ALLOWED_DTYPES}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_local = threading.local()


# ------------------------------------------------------------------------------------------ encode
def encode(msg: Any) -> list[Any]:
    """Frames for ``msg``: ``[header, *large_array_buffers]``.

    Arrays of at least ``ZERO_COPY_MIN_BYTES`` are memoryviews of the caller's data (zero-copy:
    do not modify them until sent); smaller ones are copied into the header.
    """
    schema = _SCHEMAS.get(type(msg))
    if schema is None:
        raise TypeError(f"encode: {type(msg).__name__} is not a message type of rlvla3.messages")
    buffers: list[Any] = []
    values = list(schema.get_values(msg))  # every field, in order, in one C call
    for i, key, kind in schema.special:  # only array, observation and maybe-numpy-scalar fields
        value = values[i]
        if kind is _ARRAY:
            values[i] = _encode_array(value, buffers, schema.name, key)
        elif kind is _OBS:
            if type(value) is not dict:
                raise TypeError(f"encode {schema.name}.{key}: expected a dict of arrays")
            values[i] = {k: _encode_array(v, buffers, schema.name, key) for k, v in value.items()}
        elif isinstance(value, np.generic):
            values[i] = value.item()  # numpy scalars travel as plain msgpack numbers
    return [_packer().pack([SCHEMA_VERSION, schema.name, values]), *buffers]


def _encode_array(value: Any, buffers: list[Any], name: str, key: str) -> list[Any]:
    if type(value) is np.ndarray:
        arr = value
    else:
        arr = _as_array(value)
        if arr is None:
            raise TypeError(
                f"encode {name}.{key}: cannot encode {type(value).__name__} as an array"
            )
    dtype = _DTYPE_NAMES.get(arr.dtype)
    if dtype is None:
        if arr.dtype.name not in _ALLOWED_DTYPES:
            raise TypeError(f"encode {name}.{key}: dtype {arr.dtype} is not supported")
        arr, dtype = arr.astype(arr.dtype.newbyteorder("=")), arr.dtype.name
    if arr.nbytes < ZERO_COPY_MIN_BYTES:
        data: Any = arr.tobytes()  # small: cheaper to copy into the header than to send a frame
    else:
        if not arr.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
            arr = arr.copy(order="C")
        buffers.append(arr.reshape(-1).data)
        data = len(buffers)
    return [dtype, arr.shape, data, arr is not value]


def _packer() -> msgpack.Packer:
    # Creating a Packer costs more than packing a small header: keep one per thread.
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer


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


# ------------------------------------------------------------------------------------------ decode
def decode(frames: Sequence[Any], limits: CodecLimits = DEFAULT_LIMITS) -> Any:
    """Rebuild a message from ``frames`` (bytes, memoryviews or zmq Frames).

    Raises:
        CodecError: a subclass saying what is wrong; the frames are never partially trusted.
    """
    if not frames:
        raise MalformedFrame("empty message: no header frame")
    if len(frames) > limits.max_frames:
        raise OversizedFrame(f"{len(frames)} frames exceed max_frames={limits.max_frames}")
    header = frames[0] if type(frames[0]) is bytes else _buffer(frames[0])
    if len(header) > limits.max_header_bytes:
        raise OversizedFrame(f"header of {len(header)} bytes exceeds {limits.max_header_bytes}")
    try:
        version, name, values = msgpack.unpackb(header, raw=False)
    except Exception as err:  # msgpack raises several unrelated types on garbage
        raise MalformedFrame(f"header is not a valid msgpack message: {err}") from err
    if version != SCHEMA_VERSION:
        raise SchemaMismatch(f"schema version {version!r}, this side speaks {SCHEMA_VERSION}")
    schema = _SCHEMAS_BY_NAME.get(name) if type(name) is str else None
    if schema is None:
        raise UnknownMessage(f"unknown message type {name!r}")
    if type(values) is not list or len(values) != len(schema.fields):
        got = len(values) if type(values) is list else type(values).__name__
        raise MalformedFrame(f"{name}: expected {len(schema.fields)} field values, got {got}")
    data = _DataFrames(frames, limits)
    fields = {}
    key = ""
    try:
        # The hot loop of every receiver: scalar checks inline, arrays through data.array().
        for (key, kind), value in zip(schema.fields, values, strict=True):
            if kind is _ARRAY:
                value = data.array(value)
            elif kind is _INT:
                if type(value) is not int:
                    raise _BadValue(f"expected int, got {type(value).__name__}")
            elif kind is _FLOAT:
                if type(value) is not float and type(value) is not int:
                    raise _BadValue(f"expected float, got {type(value).__name__}")
            elif kind is _OBS:
                value = data.obs(value)
            elif type(value) is not _SCALAR_TYPES[kind]:  # str, bool
                raise _BadValue(f"expected {kind}, got {type(value).__name__}")
            fields[key] = value
    except _BadValue as err:
        raise MalformedFrame(f"{name}.{key}: {err}") from None
    except OversizedFrame as err:
        raise OversizedFrame(f"{name}.{key}: {err}") from None
    if len(data.used) != len(frames) - 1:
        raise MalformedFrame(
            f"{name}: {len(frames) - 1} data frames but {len(data.used)} referenced"
        )
    return schema.cls(**fields)


class _BadValue(Exception):
    """A field value does not match its schema type (turned into MalformedFrame with its name)."""


class _DataFrames:
    """The frames of one message being decoded, and which data frames arrays have claimed."""

    __slots__ = ("frames", "used", "limits")

    def __init__(self, frames: Sequence[Any], limits: CodecLimits) -> None:
        self.frames = frames  # [header, *data frames]: data frame i is frames[i]
        self.used: set[int] = set()
        self.limits = limits

    def array(self, v: Any) -> Any:
        """The array a ``[dtype, shape, data, is_tensor]`` descriptor holds, checked."""
        if type(v) is not list or len(v) != 4:
            raise _BadValue(f"expected an array [dtype, shape, data, is_tensor], got {v!r:.60}")
        dtype, shape, data, is_tensor = v
        dt = _DTYPES.get(dtype) if type(dtype) is str else None
        if dt is None:
            raise _BadValue(f"array dtype {dtype!r} is not allowed")
        if type(shape) is not list:
            raise _BadValue(f"array shape {shape!r} is not a list")
        count = 1
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise _BadValue(f"array shape {shape!r} is not a list of non-negative ints")
            count *= dim  # Python ints: no overflow on hostile shapes
        limits = self.limits
        if count > limits.max_array_elements:
            raise OversizedFrame(f"array of {count} elements exceeds {limits.max_array_elements}")
        if type(data) is bytes:
            buf: Any = data
        elif type(data) is int and 1 <= data < len(self.frames) and data not in self.used:
            self.used.add(data)
            buf = _buffer(self.frames[data])
            if len(buf) > limits.max_frame_bytes:
                raise OversizedFrame(f"frame of {len(buf)} bytes exceeds {limits.max_frame_bytes}")
        else:
            raise _BadValue(f"array refers to frame {data!r} of {len(self.frames) - 1} data frames")
        if count * dt.itemsize != len(buf):
            raise _BadValue(
                f"array {dtype}{shape} needs {count * dt.itemsize} bytes, got {len(buf)}"
            )
        arr = np.ndarray(shape, dt, buf)  # a read-only view of the frame (np.frombuffer: slower)
        if is_tensor is True:
            import torch

            return torch.from_numpy(arr.copy())  # a writable copy: torch tensors assume ownership
        return arr

    def obs(self, v: Any) -> dict[str, Any]:
        """An observation dict ``{str: array descriptor}``, each array checked."""
        if type(v) is not dict:
            raise _BadValue(f"expected a dict of arrays, got {type(v).__name__}")
        out = {}
        for key, value in v.items():
            if type(key) is not str:
                raise _BadValue(f"observation key {key!r} is not a str")
            try:
                out[key] = self.array(value)
            except _BadValue as err:
                raise _BadValue(f"[{key!r}]: {err}") from None
        return out


# Field annotations as they appear in rlvla3.messages; _schema stores these very objects, so
# the decode loop compares kinds with `is`.
_INT, _FLOAT, _ARRAY, _OBS, _STR, _BOOL = "int", "float", "np.ndarray", "Obs", "str", "bool"
_SCALAR_TYPES = {_STR: str, _BOOL: bool}
_KINDS = (_INT, _FLOAT, _ARRAY, _OBS, *_SCALAR_TYPES)


@dataclass(frozen=True, slots=True)
class _Schema:
    """What the codec needs to know of one message class, computed once."""

    cls: type
    name: str
    fields: tuple[tuple[str, str], ...]  # (field name, annotation) in declaration order
    get_values: Callable[[Any], tuple[Any, ...]]  # message -> its field values, in order
    special: tuple[tuple[int, str, str], ...]  # (index, name, kind) of fields encode converts


def _schema(cls: type) -> _Schema:
    fields = []
    for f in dataclasses.fields(cls):
        kind = next((k for k in _KINDS if k == str(f.type)), None)
        if kind is None:
            raise TypeError(f"{cls.__name__}.{f.name}: the codec cannot carry {f.type}")
        fields.append((f.name, kind))
    names = [name for name, _ in fields]
    get_values = operator.attrgetter(*names) if len(names) > 1 else _one_tuple(names[0])
    special = tuple(
        (i, name, kind) for i, (name, kind) in enumerate(fields) if kind not in (_STR, _BOOL)
    )
    return _Schema(
        cls=cls, name=cls.__name__, fields=tuple(fields), get_values=get_values, special=special
    )


def _one_tuple(name: str) -> Callable[[Any], tuple[Any]]:
    get = operator.attrgetter(name)
    return lambda msg: (get(msg),)


_SCHEMAS = {cls: _schema(cls) for cls in MESSAGE_TYPES.values()}
_SCHEMAS_BY_NAME = {s.name: s for s in _SCHEMAS.values()}


def _buffer(frame: Any) -> memoryview:
    if type(frame) is bytes:
        return memoryview(frame)
    view = memoryview(getattr(frame, "buffer", frame))  # zmq.Frame exposes .buffer
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
