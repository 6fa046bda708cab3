"""The run configuration loaded from one YAML file: ``Config`` (``whole_config.py``, its sections
in ``sections.py``) checked across its sections (``checks.py``), and dumped back.

Unknown or mistyped keys fail with one line naming the key path; ``--set a.b=c`` overrides are
applied to the raw YAML before validation, so they are checked exactly like file values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlvla3.config.checks import validate
from rlvla3.config.sections import (
    AlgoConfig,
)
from rlvla3.config.typed_load import ConfigError, from_dict, to_dict
from rlvla3.config.vla import VLAConfig
from rlvla3.config.whole_config import Config
from rlvla3.config.yaml12 import YamlError, dump_yaml, parse_yaml

__all__ = ["AlgoConfig", "Config", "ConfigError", "config_from_dict", "load_config"]


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML file (or embedded defaults when ``path`` is None) and apply ``a.b=c`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = parse_yaml(Path(path).read_text()) or {}
        except YamlError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        except (OSError, UnicodeDecodeError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else err
            raise ConfigError(f"{path}: cannot read the launch YAML ({reason})") from None
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping (run:, roles:, ...), "
                f"got a {type(raw).__name__}"
            )
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Validate plain data into a Config, checking cross-references too."""
    cfg = from_dict(Config, raw)
    validate(cfg)
    return cfg


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``dotted.key=value`` override in place; the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. run.mode=sync")
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a mapping, cannot set {key}")
        node = child
    try:
        node[parts[-1]] = parse_yaml(text) if text else ""
    except YamlError as err:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML: {err}") from None


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML, as saved beside the run's logs."""
    return dump_yaml(_plain(cfg))  # read back by the roles: the same YAML 1.2 rules both ways


def dump_config_with_defaults(cfg: Config) -> str:
    """``dump_config`` plus every default the roles will apply: each role's ``settings`` in
    full and, for a VLA policy, every ``policy.vla`` field but those the env's spaces will
    decide (left null). What ``rlvla3 config`` prints; loads back to the same run."""
    raw = _plain(cfg)
    for role in cfg.roles:
        raw["roles"][role]["settings"] = to_dict(cfg.role_settings(role))
    if cfg.policy.kind == "vla":
        vla = to_dict(cfg.policy.vla)
        raw["policy"]["vla"] = {k: v for k, v in vla.items() if v is not None}
    return dump_yaml(raw)


def _plain(cfg: Config) -> dict[str, Any]:
    """``cfg`` as plain data, ``policy.vla`` with only the fields that differ from their defaults
    (an MLP run's config does not list the VLA's architecture)."""
    raw = to_dict(cfg)
    defaults = to_dict(VLAConfig())
    raw["policy"]["vla"] = {k: v for k, v in raw["policy"]["vla"].items() if v != defaults[k]}
    if cfg.policy.kind != "token_vla":
        del raw["policy"]["token_vla"]  # only a token-VLA run's config lists its section
    return raw
