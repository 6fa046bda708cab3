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

    def construct_document(self, node: yaml.Node) -> Any:
        _check_keys(self, node)
        return super().construct_document(node)


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


def _check_keys(loader: _Loader, root: yaml.Node) -> None:
    """Every mapping's own keys are plain and unique. Checked on the composed document, before
    construction: PyYAML's merge handling rewrites anchored mappings in place, after which a key
    overridden by a merge would look written twice."""
    stack, visited = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in visited:  # an alias: checked where it was anchored
            continue
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        if not isinstance(node, yaml.MappingNode):
            continue
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            stack.append(value_node)
            if key_node.tag == _MERGE:  # ``<<: *anchor`` merges, it is not a key
                stack.append(key_node)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"a key must be a plain value, got a {key_node.id}",
                    key_node.start_mark,
                )
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)


_Loader.add_constructor(_INT, _int)


class _Dumper(yaml.SafeDumper):
    """Writes what ``parse_yaml`` reads back unchanged: a string that YAML 1.2 would read as a
    number or boolean (``"1e3"``, ``"0o17"``) is quoted."""


_Dumper.yaml_implicit_resolvers = {
    first: list(resolvers) for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}


def dump_yaml(data: Any) -> str:
    """``data`` as YAML text that :func:`parse_yaml` reads back as the same data."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


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
