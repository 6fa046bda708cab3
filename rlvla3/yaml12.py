"""YAML text -> plain data (dicts, lists, scalars), read the way a launch YAML should be read.

PyYAML implements YAML 1.1, whose plain scalars surprise: ``3e-4`` is a string (a float needs a
dot), ``on``/``yes``/``no`` are booleans, ``017`` is octal 15 and ``1:30`` is the integer 90.
Here plain scalars follow YAML 1.2's core schema instead (``3e-4`` a float, ``017`` the integer 17,
only true/false booleans; ``1_000`` is still allowed), a key written twice in one mapping is an
error (PyYAML keeps the last silently), every error is one line with its position, and the result
shares no containers: an alias becomes a copy, so a ``--set`` on one place cannot change another.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"


class YamlError(ValueError):
    """Text that is not valid YAML (or not plain data); one line, with the position."""


class _Loader(yaml.SafeLoader):
    """The safe loader (plain data only) with YAML 1.2 core-schema scalars."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _int(loader: _Loader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    if text[:2] in ("0o", "0x"):
        return int(text, 0)
    return int(text, 10)  # decimal, leading zeros and all: 017 is 17


def _mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == _MERGE:  # ``<<: *anchor`` merges, it is not a key
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain value, got {key!r}", key_node.start_mark
            ) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(_INT, _int)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def parse_yaml(text: str) -> Any:
    """Parse ``text`` into plain data; raises :class:`YamlError` (one line) if it cannot."""
    try:
        return _unshared(yaml.load(text, Loader=_Loader))
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise YamlError(f"{where}{err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise YamlError(str(err).splitlines()[0]) from None
    except RecursionError:
        raise YamlError("nested too deeply (or an alias that contains itself)") from None
    except ValueError as err:  # e.g. an integer of more digits than Python converts
        raise YamlError(str(err)) from None


def _unshared(data: Any) -> Any:
    """A copy in which no dict or list appears twice (aliases become copies)."""
    if isinstance(data, dict):
        return {key: _unshared(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_unshared(item) for item in data]
    return data
