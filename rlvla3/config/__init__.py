"""Typed run configuration: the YAML's sections as dataclasses, strict loading, `--set` overrides, per-role settings, node groups."""
