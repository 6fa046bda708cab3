"""LeRobot's per-frame features: their declaration and their parquet columns.

Shared by the writers (:mod:`sft.lerobot_writer`) and the reader (:mod:`sft.lerobot`); their
statistics are in :mod:`sft.lerobot_stats`. A feature is declared in
``meta/info.json`` as ``{"dtype", "shape", "names"}``. How LeRobot (and the Hugging Face
``datasets`` library under it) stores each kind in the parquet files, and so how we do:

==================================  ============================================================
feature                             parquet column
==================================  ============================================================
``dtype: image``, ``[H, W, C]``     struct ``{bytes: PNG, path: null}`` (``datasets.Image``)
numeric, ``shape: [1]``             plain column (``datasets.Value``)
numeric, ``shape: [n]``             fixed-size list of ``n`` (``datasets.Sequence(length=n)``)
numeric, ``shape: [a, b, ...]``     nested lists, one level per axis (``datasets.Array2D``...)
``dtype: video``                    not in the parquet files: MP4 under ``videos/`` (unsupported)
==================================  ============================================================

The reader also takes numeric N-d features flattened into one fixed-size list (what this project
wrote before it wrote the ``datasets`` layout) and reshapes them from the declared shape.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

IMAGE, VIDEO = "image", "video"
IMAGE_NAMES = ("height", "width", "channel")


class DatasetError(ValueError):
    """A dataset that cannot be read or written as declared; the message names the file and the
    field."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Feature:
    """One per-frame column.

    Attributes:
        dtype: a numpy dtype name (``"float32"``, ``"uint8"``, ``"int64"``, ``"bool"``...) or
            ``"image"`` (``uint8[H, W, C]`` frames stored as PNG, as LeRobot stores camera
            images); ``"video"`` is readable from ``info.json`` but its frames are not.
        shape: per-frame shape, e.g. ``(64, 64, 3)`` for an image, ``(1,)`` for a reward.
        names: optional names of the axes or entries (LeRobot's ``names``).
    """

    dtype: str
    shape: tuple[int, ...]
    names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in (IMAGE, VIDEO):
            try:
                np.dtype(self.dtype)
            except TypeError as e:
                raise DatasetError(f"unknown dtype {self.dtype!r}") from e
        if any(int(d) < 1 for d in self.shape):
            raise DatasetError(f"shape must be positive, got {self.shape}")
        if self.dtype == IMAGE and (len(self.shape) != 3 or self.shape[2] not in (1, 3, 4)):
            raise DatasetError(f"an image's shape is [height, width, 1|3|4], got {self.shape}")

    @property
    def numpy_dtype(self) -> np.dtype:
        """The dtype of the arrays the reader returns (``uint8`` for images)."""
        return np.dtype("uint8") if self.dtype in (IMAGE, VIDEO) else np.dtype(self.dtype)

    @property
    def is_scalar(self) -> bool:
        """One value per frame: ``shape`` ``(1,)`` (LeRobot's) or ``()``."""
        return len(self.shape) <= 1 and math.prod(self.shape) == 1

    def to_json(self) -> dict[str, Any]:
        names = list(self.names) if self.names is not None else None
        return {"dtype": self.dtype, "shape": list(self.shape), "names": names}

    @staticmethod
    def from_json(obj: Any) -> Feature:
        """A feature from its ``info.json`` entry; DatasetError says what is wrong with it."""
        if not isinstance(obj, Mapping):
            raise DatasetError(f"expected an object with dtype and shape, got {obj!r}")
        dtype, shape = obj.get("dtype"), obj.get("shape")
        if not isinstance(dtype, str):
            raise DatasetError(f"dtype must be a string, got {dtype!r}")
        if dtype not in (IMAGE, VIDEO):
            try:
                kind = np.dtype(dtype).kind
            except TypeError:
                raise DatasetError(f"unknown dtype {dtype!r}") from None
            if kind not in "biuf":
                raise DatasetError(f"dtype {dtype!r} is not a number or bool type")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise DatasetError(f"shape must be a list of integers, got {shape!r}")
        names = obj.get("names")
        # LeRobot also writes names as {"motors": [...]}: kept only when it is a flat list
        flat = isinstance(names, list) and all(isinstance(n, str) for n in names)
        return Feature(dtype=dtype, shape=tuple(shape), names=tuple(names) if flat else None)


def to_column(arr: np.ndarray, feature: Feature) -> pa.Array:
    """``[T, *feature.shape]`` frames -> one parquet column (see the module's table)."""
    rows = len(arr)
    if feature.dtype == IMAGE:
        return pa.array([{"bytes": _png(frame), "path": None} for frame in arr], type=IMAGE_STRUCT)
    if feature.is_scalar:
        return pa.array(arr.reshape(rows))
    values: pa.Array = pa.array(np.ascontiguousarray(arr).reshape(-1))
    if len(feature.shape) == 1:
        return pa.FixedSizeListArray.from_arrays(values, feature.shape[0])
    for size in reversed(feature.shape):  # innermost axis first
        count = len(values) // size
        values = pa.ListArray.from_arrays(pa.array(np.arange(count + 1) * size, pa.int32()), values)
    return values


def from_column(column: pa.ChunkedArray | pa.Array, feature: Feature, where: str) -> np.ndarray:
    """A parquet column -> ``[T, *feature.shape]`` array; ``where`` names it in errors.

    Nothing is coerced silently: nulls, strings, ragged or differently shaped rows, values that
    do not fit the declared dtype (a float in an int feature, say) and images of another size
    all raise :class:`DatasetError`."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    rows = len(arr)
    if feature.dtype == VIDEO:
        raise DatasetError(
            f"{where}: video features (MP4 under videos/) are not supported; "
            "store the frames as images"
        )
    if arr.null_count:
        raise DatasetError(f"{where}: {arr.null_count} null values")
    if pa.types.is_struct(arr.type):
        if feature.dtype != IMAGE or arr.type.get_field_index("bytes") < 0:
            raise DatasetError(f"{where}: a struct column for a {feature.dtype} feature")
        frames = [_unpng(b, feature.shape, where) for b in arr.field("bytes").to_pylist()]
        return np.stack(frames) if frames else np.zeros((0, *feature.shape), np.uint8)
    sizes = []
    while _is_list(arr.type):  # one level per axis (datasets' ArrayND) or one flat list
        sizes.append(_row_size(arr, where))
        arr = arr.flatten()
        if arr.null_count:
            raise DatasetError(f"{where}: {arr.null_count} null values")
    # nested per axis, flattened into one list, or (one value per frame) a plain column
    accepted = [list(feature.shape), [math.prod(feature.shape)]] + (
        [[]] if feature.is_scalar else []
    )
    if rows and sizes not in accepted:
        raise DatasetError(f"{where}: rows of shape {sizes}, declared {list(feature.shape)}")
    if not (
        pa.types.is_integer(arr.type)
        or pa.types.is_floating(arr.type)
        or pa.types.is_boolean(arr.type)
    ):
        raise DatasetError(f"{where}: values of type {arr.type}, expected numbers")
    try:
        cast = arr.cast(pa.from_numpy_dtype(feature.numpy_dtype), safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise DatasetError(f"{where}: values do not fit dtype {feature.dtype} ({e})") from None
    if pa.types.is_floating(cast.type) and _infinities(cast) > _infinities(arr):
        raise DatasetError(f"{where}: values too large for dtype {feature.dtype}")
    arr = cast
    out = arr.to_numpy(zero_copy_only=False)
    return out.reshape(rows, *feature.shape)


def _infinities(arr: pa.Array) -> int:
    if not pa.types.is_floating(arr.type):
        return 0
    return int(pc.sum(pc.is_inf(arr)).as_py() or 0)


def _row_size(arr: pa.Array, where: str) -> int:
    """The one length every row of a list column has (DatasetError if rows differ)."""
    if pa.types.is_fixed_size_list(arr.type):
        return int(arr.type.list_size)
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths != lengths[0]).any():
        raise DatasetError(f"{where}: rows of different lengths ({lengths.min()}..{lengths.max()})")
    return int(lengths[0]) if len(lengths) else 0


def _is_list(kind: pa.DataType) -> bool:
    return (
        pa.types.is_list(kind)
        or pa.types.is_fixed_size_list(kind)
        or (pa.types.is_large_list(kind))
    )


IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _png(frame: np.ndarray) -> bytes:
    from PIL import Image  # Pillow comes with matplotlib

    buffer = io.BytesIO()
    image = frame[..., 0] if frame.shape[-1] == 1 else frame
    # compress_level 1: ~5x faster than the default 6, files about 10% larger
    Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8)).save(
        buffer, format="PNG", compress_level=1
    )
    return buffer.getvalue()


def _unpng(data: bytes | None, shape: tuple[int, ...], where: str) -> np.ndarray:
    from PIL import Image

    if data is None:
        raise DatasetError(
            f"{where}: an image without bytes (images stored as files by path are not supported)"
        )
    try:
        with Image.open(io.BytesIO(data)) as image:
            out = np.asarray(image)
    except Exception as e:  # not an image, truncated, a decompression bomb...
        raise DatasetError(f"{where}: undecodable image ({type(e).__name__}: {e})") from None
    out = out[..., None] if out.ndim == 2 else out
    if out.dtype != np.uint8 or out.shape != shape:
        raise DatasetError(
            f"{where}: an image of {out.dtype}{list(out.shape)}, declared uint8{list(shape)}"
        )
    return out


def hf_features(features: Mapping[str, Feature]) -> bytes:
    """The ``huggingface`` parquet schema metadata: the ``datasets`` feature types, so that
    the ``datasets`` parquet loader (LeRobot's, in v2.1 and v3.0) decodes images as images."""

    def describe(f: Feature) -> dict[str, Any]:
        if f.dtype == IMAGE:
            return {"_type": "Image"}
        value = {"dtype": f.dtype, "_type": "Value"}
        if f.is_scalar:
            return value
        if len(f.shape) == 1:
            return {"feature": value, "length": f.shape[0], "_type": "Sequence"}
        return {"shape": list(f.shape), "dtype": f.dtype, "_type": f"Array{len(f.shape)}D"}

    spec = {"info": {"features": {k: describe(f) for k, f in features.items()}}}
    return json.dumps(spec).encode()
