"""Message codec: one msgpack header frame, plus one raw frame per large array. Never pickle.

Wire format (``transport.messages.SCHEMA_VERSION`` 8)::

    frame 0:  msgpack [version, [message_name, value of each field, in schema order]]
    frame 1+: raw bytes of each array of at least ZERO_COPY_MIN_BYTES (sent without copying)

An array value is ``[dtype_name, shape, data]``: ``data`` is the array's bytes inline (arrays
under ``ZERO_COPY_MIN_BYTES``) or the index of the frame that holds them. CPU torch tensors are
accepted when encoding and arrive as numpy arrays, as the schema declares. Why this shape:
on the hot path (``ObsRequest`` / ``ActionReply``) every extra ZeroMQ frame costs more than the
copy of a small array.

The header is written by msgspec's C msgpack codec from the message structs of
``transport/messages.py`` and read against their typed mirror (``transport/wire_types.py``):
every field is checked in C while decoding, arrays included (an array descriptor is typed, so no
nesting a sender writes is followed), and only the arrays' conversion runs in Python
(``Codec.array``). Measured on the 2-core CI machine for an ``ActionReply``: the
first codec (3 frames, msgpack-python, checks in Python) took 13 µs to encode and 23 µs to
decode; this one takes ~3 and ~4 µs. Error paths are not hot: when msgspec rejects a header,
``_diagnose`` re-reads it with msgpack-python to say exactly what is wrong, by field name.

Decoding trusts nothing: sizes are bounded, dtypes come from an allow-list, every field is checked
against the schema, every data frame must be referenced exactly once, and any problem raises a
``CodecError`` subclass that names the message and field.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec
import numpy as np

from transport.messages import MESSAGE_TYPES, SCHEMA_VERSION, Obs
from transport.wire_types import BUILDERS, HEADER_TYPE, ArrayDesc

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
# Per message class, the names of its array fields, optional array fields and observation-dict
# fields: encode checks them (msgspec would write a list given for an array as a plain list).
_FIELD_KINDS = {np.ndarray: "arrays", np.ndarray | None: "optional", Obs: "obs"}
_ARRAY_FIELDS = {
    cls: tuple(
        tuple(f.name for f in msgspec.structs.fields(cls) if _FIELD_KINDS.get(f.type) == kind)
        for kind in ("arrays", "optional", "obs")
    )
    for cls in MESSAGE_TYPES.values()
}
_NONE: frozenset[int] = frozenset()


def encode(msg: Any) -> list[Any]:
    """Frames for ``msg`` (``Codec.encode`` with this thread's codec)."""
    return _codec().encode(msg)


def decode(frames: Sequence[Any], limits: CodecLimits = DEFAULT_LIMITS) -> Any:
    """A message from ``frames`` (``Codec.decode`` with this thread's codec)."""
    return _codec().decode(frames, limits)


def _codec() -> Codec:
    codec = getattr(_local, "codec", None)
    if codec is None:
        codec = _local.codec = Codec()
    return codec


_local = threading.local()


class Codec:
    """Encodes and decodes messages: msgspec's encoder and decoder and the array conversions they call.

    Not thread-safe (the array conversion keeps per-call state, e.g. the frames being decoded): use one per
    thread. Each ``MessageSocket`` owns one, as a socket belongs to one thread anyway; the
    module's ``encode``/``decode`` use one per thread. Building one takes ~30 µs.

    Args:
        limits: the default decode bounds.
    """

    def __init__(self, limits: CodecLimits = DEFAULT_LIMITS) -> None:
        self.encoder = msgspec.msgpack.Encoder(enc_hook=self.encode_array)
        self.decoder = msgspec.msgpack.Decoder(HEADER_TYPE)
        self.default_limits = limits
        self.buffers: list[Any] = []
        self.frames: Sequence[Any] = ()
        self.used: set[int] = set()
        self.limits = limits

    def encode(self, msg: Any) -> list[Any]:
        """Frames for ``msg``: ``[header, *large_array_buffers]``.

        Arrays of at least ``ZERO_COPY_MIN_BYTES`` are memoryviews of the caller's data
        (zero-copy: do not modify them until sent); smaller ones are copied into the header.

        Raises:
            TypeError: ``msg`` is not a message, or a field holds something the codec cannot
                carry (named).
        """
        fields = _ARRAY_FIELDS.get(type(msg))
        if fields is None:
            raise TypeError(
                f"encode: {type(msg).__name__} is not a message type of transport.messages"
            )
        arrays, optional, obs = fields
        for name in arrays:
            if type(getattr(msg, name)) is not np.ndarray:  # (the common case, checked fast)
                _check_array(msg, name, optional=False)
        for name in optional:
            if getattr(msg, name) is not None:
                _check_array(msg, name, optional=True)
        for name in obs:
            value = getattr(msg, name)
            if type(value) is not dict or not all(map(_is_array, value.values())):
                raise TypeError(f"encode {type(msg).__name__}.{name}: expected a dict of arrays")
        self.buffers = buffers = []
        try:
            header = self.encoder.encode((SCHEMA_VERSION, msg))
        except (TypeError, ValueError) as err:
            where = f"{type(msg).__name__}{_field_of_encode_error(msg)}"
            raise TypeError(f"encode {where}: {err}") from None
        finally:
            self.buffers = []
        return [header, *buffers] if buffers else [header]

    def decode(self, frames: Sequence[Any], limits: CodecLimits | None = None) -> Any:
        """Rebuild a message from ``frames`` (bytes, memoryviews or zmq Frames).

        Raises:
            CodecError: a subclass saying what is wrong; the frames are never partially trusted.
                Whatever else goes wrong while decoding untrusted bytes is a ``MalformedFrame``
                too: no frame can raise anything a receiver does not count and drop.
        """
        limits = limits or self.default_limits
        if not frames:
            raise MalformedFrame("empty message: no header frame")
        if len(frames) > limits.max_frames:
            raise OversizedFrame(f"{len(frames)} frames exceed max_frames={limits.max_frames}")
        header = frames[0] if type(frames[0]) is bytes else _buffer(frames[0])
        if len(header) > limits.max_header_bytes:
            raise OversizedFrame(f"header of {len(header)} bytes exceeds {limits.max_header_bytes}")
        try:
            version, wire = self.decoder.decode(header)
        except Exception as err:  # (msgspec's errors; anything else is mapped all the same)
            raise _diagnosis(header, err) from None
        if version != SCHEMA_VERSION:
            raise SchemaMismatch(f"schema version {version!r}, this side speaks {SCHEMA_VERSION}")
        # (a set only where data frames can be referenced: most messages are one frame)
        self.frames, self.used, self.limits = frames, set() if len(frames) > 1 else _NONE, limits
        try:
            msg = BUILDERS[type(wire)](wire, self.array, self.obs)
        except CodecError as err:
            raise type(err)(f"{type(wire).__name__}.{err}") from None
        except Exception as err:  # whatever else hostile values make a builder raise
            raise MalformedFrame(
                f"{type(wire).__name__}: {type(err).__name__}: {err!s:.100}"
            ) from None
        finally:
            self.frames = ()
        if len(self.used) != len(frames) - 1:
            raise MalformedFrame(
                f"{type(msg).__name__}: {len(frames) - 1} data frames but "
                f"{len(self.used)} referenced"
            )
        return msg

    # --- arrays --------------------------------------------------------------------------------
    def encode_array(self, value: Any) -> Any:
        """msgspec hook for what it cannot encode itself: arrays, tensors, numpy scalars."""
        if type(value) is np.ndarray:
            arr = value
        elif isinstance(value, np.generic):
            return value.item()  # numpy scalars travel as plain msgpack numbers
        else:
            arr = _as_array(value)
            if arr is None:
                raise TypeError(f"cannot encode {type(value).__name__}")
        dtype = _DTYPE_NAMES.get(arr.dtype)
        if dtype is None:
            if arr.dtype.name not in _ALLOWED_DTYPES:
                raise TypeError(f"dtype {arr.dtype} is not supported")
            arr, dtype = arr.astype(arr.dtype.newbyteorder("=")), arr.dtype.name
        nbytes = arr.nbytes
        if nbytes < 4096:  # tiny: a copy is cheaper than asking whether a view would do
            data: Any = arr.tobytes()
        elif nbytes < ZERO_COPY_MIN_BYTES:  # small: cheaper to copy into the header than a frame
            data = arr.data if arr.flags.c_contiguous else arr.tobytes()
        else:
            if not arr.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
                arr = arr.copy(order="C")
            self.buffers.append(arr.reshape(-1).data)
            data = len(self.buffers)
        return (dtype, arr.shape, data)

    def obs(self, descs: dict[str, ArrayDesc], field: str) -> Obs:
        """The observation dict ``descs`` describes (``array`` for each key)."""
        return {key: self.array(desc, field, key) for key, desc in descs.items()}

    def array(self, desc: ArrayDesc, field: str, key: str | None = None) -> np.ndarray:
        """The array (read-only) an ``ArrayDesc`` of field ``field`` (``[key]``) describes.

        Raises:
            CodecError: naming the field, when anything is off.
        """
        dt = _DTYPES.get(desc.dtype)
        if dt is None:
            raise _array_error(field, key, f"array dtype {desc.dtype!r:.40} is not allowed")
        shape, data, limits = desc.shape, desc.data, self.limits
        count = math.prod(shape)  # (Python ints, each >= 0: no overflow on hostile shapes)
        if count > limits.max_array_elements:
            raise _array_error(
                field, key, f"array of {count} elements exceeds {limits.max_array_elements}", True
            )
        if type(data) is bytes:
            buf: Any = data
        elif 1 <= data < len(self.frames) and data not in self.used:
            self.used.add(data)
            buf = _buffer(self.frames[data])
            if len(buf) > limits.max_frame_bytes:
                raise _array_error(
                    field, key, f"frame of {len(buf)} bytes exceeds {limits.max_frame_bytes}", True
                )
        else:
            raise _array_error(
                field, key, f"array refers to frame {data} of {len(self.frames) - 1} data frames"
            )
        if count * dt.itemsize != len(buf):
            raise _array_error(
                field,
                key,
                f"array {desc.dtype}{shape} needs {count * dt.itemsize} bytes, got {len(buf)}",
            )
        try:
            return np.ndarray(shape, dt, buf)  # a view of the frame (np.frombuffer is slower)
        except ValueError as err:  # e.g. [0, 2**40, 2**40]: no elements, but too big a shape
            raise _array_error(field, key, f"array shape {shape!r:.60}: {err}") from None


def _array_error(field: str, key: str | None, detail: str, oversized: bool = False) -> CodecError:
    where = field if key is None else f"{field}[{key!r:.40}]"
    return (OversizedFrame if oversized else MalformedFrame)(f"{where}: {detail}")


# --- error paths ------------------------------------------------------------------------------
_DIAGNOSE_MAX_BYTES = 1 << 20
"""Headers up to this size are decoded a second time to name the bad field; a larger one's
error says msgspec's path alone (decoding megabytes of hostile bytes twice, and printing
them, would cost a role seconds and hundreds of MB)."""

# msgspec's error paths: "<detail> - at `$[1][3]`", "... - at `$[1][3][...]`" (a dict value) or
# "... - at `key` in `$[1][3]`" (a dict key); $[1] is the message, its [0] the name.
_PATH = re.compile(
    r"^(?P<detail>.*) - at (?P<key>`key` in )?`\$\[1\]\[(?P<index>\d+)\](?P<rest>[^`]*)`$", re.S
)


def _diagnosis(header: Any, err: Exception) -> CodecError:
    """``_diagnose``, or a plain ``MalformedFrame`` if even that fails on hostile bytes (or
    the header is too large to decode twice: its error path is all that is said)."""
    if not isinstance(err, msgspec.MsgspecError):
        return MalformedFrame(f"undecodable header: {type(err).__name__}: {err!s:.100}")
    if len(header) > _DIAGNOSE_MAX_BYTES:
        return MalformedFrame(f"header does not fit the schema: {err!s:.200}")
    try:
        return _diagnose(header, err)
    except Exception as bad:  # (e.g. a RecursionError from the repr of deep nesting)
        return MalformedFrame(f"{err!s:.200} ({type(bad).__name__} while diagnosing it)")


def _diagnose(header: Any, err: Exception) -> CodecError:
    """The precise error for a header msgspec rejected, naming the message and field."""
    try:
        raw = msgpack.unpackb(header, raw=False)
    except Exception as bad:  # msgpack raises several unrelated types on garbage
        if isinstance(err, msgspec.ValidationError):  # (valid msgpack, too deep for msgpack)
            return MalformedFrame(f"header does not fit the schema: {err}")
        return MalformedFrame(f"header is not a valid msgpack message: {str(bad) or err}")
    if type(raw) is not list or len(raw) != 2:
        return MalformedFrame(f"header must be [version, message], got {raw!r:.60}")
    version, body = raw
    if version != SCHEMA_VERSION:
        return SchemaMismatch(f"schema version {version!r}, this side speaks {SCHEMA_VERSION}")
    if type(body) is not list or not body or type(body[0]) is not str:
        return MalformedFrame(f"message must be [name, *field values], got {body!r:.60}")
    cls = MESSAGE_TYPES.get(body[0])
    if cls is None:
        return UnknownMessage(f"unknown message type {body[0]!r}")
    name, fields = body[0], msgspec.structs.fields(cls)
    required = sum(f.required for f in fields)
    if not required <= len(body) - 1 <= len(fields):
        want = f"{required} to {len(fields)}" if required < len(fields) else str(len(fields))
        return MalformedFrame(f"{name}: expected {want} field values, got {len(body) - 1}")
    match = _PATH.match(str(err))
    if match is None or not 1 <= int(match["index"]) <= len(fields):
        return MalformedFrame(f"{name}: {err}")
    field = fields[int(match["index"]) - 1].name + match["rest"]
    detail = match["detail"] + (" (a key)" if match["key"] else "")
    return MalformedFrame(f"{name}.{field}: {detail}")


def _field_of_encode_error(msg: Any) -> str:
    """``.field`` of the first field of ``msg`` the codec cannot carry ('' if none found)."""
    probe = msgspec.msgpack.Encoder(enc_hook=Codec().encode_array)
    for field in msgspec.structs.fields(msg):
        try:
            probe.encode(getattr(msg, field.name))
        except (TypeError, ValueError):
            return f".{field.name}"
    return ""


def _check_array(msg: Any, name: str, *, optional: bool) -> None:
    value = getattr(msg, name)
    if not _is_array(value):
        raise TypeError(
            f"encode {type(msg).__name__}.{name}: expected an array"
            f"{' or None' if optional else ''}, got {type(value).__name__}"
        )


def _as_array(obj: Any) -> np.ndarray | None:
    if isinstance(obj, np.ndarray):
        return obj
    if _is_tensor(obj):
        if obj.device.type != "cpu":
            raise TypeError(f"tensor on {obj.device}; move it to the CPU first")
        return obj.detach().numpy()
    return None


def _is_array(obj: Any) -> bool:
    return type(obj) is np.ndarray or isinstance(obj, np.ndarray) or _is_tensor(obj)


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "numpy")


def _buffer(frame: Any) -> memoryview:
    if type(frame) is bytes:
        return memoryview(frame)
    view = memoryview(getattr(frame, "buffer", frame))  # zmq.Frame exposes .buffer
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
