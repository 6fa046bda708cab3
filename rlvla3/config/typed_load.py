"""Strict conversion of plain YAML data into typed dataclasses.

Every error names the key path (``roles.env_worker.cuont: unknown key``) so a user can find the
mistake in their YAML without reading a traceback.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is missing, unknown or of the wrong type. The message starts with its path."""


def bounded(
    default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None
) -> Any:
    """A dataclass field whose loaded value must lie in range (``ge <= value``, ``gt < value``,
    ``value <= le``); ``from_dict`` rejects anything else with the key's path. None passes."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le)) if v is not None}
    return dataclasses.field(default=default, metadata={"bounds": bounds})


def _check_bounds(field: dataclasses.Field, value: Any, path: str) -> None:
    bounds = field.metadata.get("bounds")
    if not bounds or value is None:
        return
    if "ge" in bounds and not value >= bounds["ge"]:
        raise ConfigError(f"{path}: must be >= {bounds['ge']}, got {value!r}")
    if "gt" in bounds and not value > bounds["gt"]:
        raise ConfigError(f"{path}: must be > {bounds['gt']}, got {value!r}")
    if "le" in bounds and not value <= bounds["le"]:
        raise ConfigError(f"{path}: must be <= {bounds['le']}, got {value!r}")


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and mistyped values."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or '<root>'}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise ConfigError(f"{_join(path, str(key))}: unknown key")
    kwargs = {}
    for name in fields:
        if name in data:
            kwargs[name] = convert(hints[name], data[name], _join(path, name))
            _check_bounds(fields[name], kwargs[name], _join(path, name))
        elif _is_required(fields[name]):
            raise ConfigError(f"{_join(path, name)}: missing required key")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as err:  # a dataclass's own validation: say where in the file it was
        raise ConfigError(f"{path or '<root>'}: {err}") from None


def convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against type annotation ``tp`` and convert containers recursively."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, path)
    if origin is Literal:
        if value not in get_args(tp):
            choices = ", ".join(repr(a) for a in get_args(tp))
            raise ConfigError(f"{path}: {value!r} is not one of {choices}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        item_tp = get_args(tp)[0] if get_args(tp) else Any
        items = [convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        val_tp = get_args(tp)[1] if get_args(tp) else Any
        return {str(k): convert(val_tp, v, _join(path, str(k))) for k, v in value.items()}
    return _convert_scalar(tp, value, path)


def _convert_union(tp: Any, value: Any, path: str) -> Any:
    args = get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{path}: must not be null")
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return convert(arg, value, path)
        except ConfigError as err:
            errors.append(str(err))
    raise ConfigError(
        errors[0] if len(errors) == 1 else f"{path}: {value!r} matches no allowed type"
    )


def _convert_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                raise ConfigError(
                    f"{path}: a {len(str(value))}-digit number is too large"
                ) from None
            if not math.isfinite(number):
                raise ConfigError(f"{path}: must be a finite number, got {value!r}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise ConfigError(f"{path}: unsupported field type {tp!r}")
    raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")


def to_dict(obj: Any) -> Any:
    """Plain-data (YAML/JSON-ready) form of a dataclass tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _is_required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


__all__ = ["ConfigError", "convert", "from_dict", "to_dict"]
