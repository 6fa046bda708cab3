"""The body of ``rlvla3 launch``: load the config, run its first stage
(``policy.init_launch``) when no checkpoint is there yet, check what a multi-node launch needs,
move an earlier run's dir aside, and hand this host's part of the run to the ``Launcher``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import redis

from rlvla3.config.run_config import Config, load_config
from rlvla3.config.typed_load import ConfigError
from rlvla3.launch import netaddr
from rlvla3.launch.cluster import Seat, find_seat
from rlvla3.launch.launcher import Launcher
from rlvla3.launch.redis_server import RedisServerError
from rlvla3.launch.rendezvous import configured_store
from rlvla3.launch.run_dir import config_path, move_aside
from rlvla3.runtime import run_secret
from rlvla3.runtime.checkpoints import find_checkpoint
from rlvla3.runtime.registry import RunInUse
from transport import security


def launch(
    config_path: str | None,
    overrides: list[str] = (),
    *,
    node: str | None = None,
    out: str | None = None,
    resume: bool = False,
    echo: Callable[[str], None] = print,
) -> int:
    """Load a config and run this host's part of it (the body of ``rlvla3 launch``). Returns the
    exit code.

    A fresh launch into a run dir that holds an earlier run moves that run aside (nothing is
    deleted; only the head does this); ``resume`` keeps it, so the trainer continues from its
    checkpoints.
    """
    cfg = load_config(config_path, overrides)
    seat = find_seat(cfg, node)
    _check_multi_node(cfg, seat)
    _write_model_preset(cfg, echo)
    if cfg.policy.lora.enabled:
        from rlvla3.policy.factory import check_lora_targets  # torch: only with LoRA

        check_lora_targets(cfg)
    if seat.node is None and cfg.policy.init_launch:
        code = _run_init_launch(cfg, config_path, echo)
        if code != 0:
            return code  # a failed or interrupted first stage stops the chain
    run_dir = (Path(out) if out else Path(cfg.run.output_dir) / cfg.run.name).resolve()
    given = cfg.policy.init_checkpoint
    cfg = _pin_init_checkpoint(cfg, run_dir if resume else None)
    # pinned to a file where one is there (a --node launcher may start while the head still
    # writes it, or hold no trainer)
    if seat.node is None and given and not Path(cfg.policy.init_checkpoint or "").is_file():
        raise ConfigError(
            f"policy.init_checkpoint: no checkpoint at {given} "
            "(a run dir with checkpoints/, or a .pt file)"
        )
    launcher = Launcher(cfg, run_dir, seat, echo=echo, resume=resume)  # checks placement first
    if seat.multi_host:
        echo(
            f"node {seat.label} of {len(cfg.all_nodes())} "
            f"({'head' if seat.is_head else f'head: {seat.head.name}'})"
            + (f", Slurm job {seat.slurm.job_id}" if seat.slurm else "")
        )
    elif len(cfg.all_nodes()) > 1:
        echo(f"running all {len(cfg.all_nodes())} nodes' roles on this host (loopback)")
    if seat.is_head:
        _refuse_live_run(cfg)  # before its run dir could be moved aside
    if not resume and seat.is_head and (run_dir / "run.json").exists():
        echo(move_aside(run_dir))
    try:
        return launcher.run()
    except (netaddr.AddressError, run_secret.SecretError) as err:
        raise ConfigError(str(err)) from None
    except RunInUse as err:
        raise ConfigError(f"run.name: {err}") from None
    except RedisServerError as err:
        hint = " (set run.redis_port to a free port)" if seat.multi_host else ""
        raise ConfigError(f"the run's redis-server: {err}{hint}") from None


def _pin_init_checkpoint(cfg: Config, resumed: Path | None = None) -> Config:
    """``policy.init_checkpoint`` as the checkpoint file it names now (a run dir names its
    newest), so that every role, a restarted one too, loads the same weights (a LoRA run's
    frozen base must be alike in all of them) and the run's checkpoints record that file,
    even if the run that wrote it writes newer ones meanwhile. Resuming the run in ``resumed``,
    the file it started from (its ``config.yaml``) while the given path still names it. Left
    as given while it names no checkpoint yet (a --node launcher started before the head's
    first stage ended).

    Raises:
        ConfigError: the resumed run started from a file under the given path that is gone,
            and the run needs it (a LoRA base, or a KL reference): resuming on another would
            change what it trains.
    """
    given = cfg.policy.init_checkpoint
    if not given:
        return cfg
    needed = cfg.policy.lora.enabled or cfg.algo.ref_kl_coef > 0
    found = _started_from(resumed, Path(given), needed) if resumed else None
    found = found or find_checkpoint(given)
    if found is None:
        return cfg
    return replace(cfg, policy=replace(cfg.policy, init_checkpoint=str(found.resolve())))


def _started_from(run_dir: Path, given: Path, needed: bool) -> Path | None:
    """The init checkpoint file the run in ``run_dir`` started from, if ``given`` names it (is
    it, or a folder above it); None for a run that has no config yet, started elsewhere, was
    not pinned to a file (a folder in its config), or whose file is gone when the run does not
    need it (without LoRA or a KL reference the trainer resumes from its own checkpoints)."""
    try:
        started = load_config(str(config_path(run_dir))).policy.init_checkpoint
    except (OSError, ConfigError):
        return None
    if not started or Path(started).suffix != ".pt":
        return None
    path, root = Path(started), given.resolve()
    if path != root and root not in path.parents:
        return None
    if not path.is_file() and not needed:
        return None
    if not path.is_file():
        raise ConfigError(
            f"policy.init_checkpoint: the run in {run_dir} started from {path}, which is not "
            "there any more; resuming on other initial weights would change what it trains"
        )
    return path


def _refuse_live_run(cfg: Config) -> None:
    """A shared Redis (``run.redis_url``) with a live run of this ``run.name`` refuses the launch."""
    if cfg.run.redis_url is None:
        return
    registry = configured_store(cfg.run.redis_url).registry(cfg.run.name)
    try:
        registry.refuse_if_live()
    except RunInUse as err:
        raise ConfigError(f"run.name: {err}") from None
    except redis.RedisError:
        pass  # unreachable: joining the run says so
    finally:
        registry.close()


def _write_model_preset(cfg: Config, echo: Callable[[str], None]) -> None:
    """Write ``policy.token_vla.preset`` into ``policy.token_vla.path`` when no model is there,
    once, before any role (each of which loads it) starts; with ``preset_grounding``, ground it
    first (stage 0) in a side directory whose files move in only when it is done, so that an
    interrupted stage leaves no half-made model to load."""
    token_vla = cfg.policy.token_vla
    if cfg.policy.kind != "token_vla" or not token_vla.preset:
        return
    from rlvla3.policy.presets import ensure_preset  # torch and transformers: only here

    grounding = token_vla.preset_grounding
    if grounding.vision_steps or grounding.text_steps:
        from rlvla3.policy.grounding import ensure_grounded_preset

        ensure_grounded_preset(token_vla, cfg.env.id, cfg.env.kwargs, echo)
    elif ensure_preset(token_vla.path, token_vla.preset):
        echo(f"wrote the {token_vla.preset} preset's random-init model into {token_vla.path}")


def _check_multi_node(cfg: Config, seat: Seat) -> None:
    """What a launch of one node of several needs before it starts anything."""
    if (
        seat.node is not None
        and cfg.policy.init_launch
        and not find_checkpoint(cfg.policy.init_checkpoint or "", verify=False)
    ):
        raise ConfigError(
            f"policy.init_launch: a multi-node launch does not run the first stage; "
            f"run `rlvla3 launch {cfg.policy.init_launch}` first (it writes "
            f"{cfg.policy.init_checkpoint})"
        )
    token_vla = cfg.policy.token_vla
    grounding = token_vla.preset_grounding
    if (
        seat.node is not None
        and not seat.single_node
        and cfg.policy.kind == "token_vla"
        and token_vla.preset
        and (grounding.vision_steps or grounding.text_steps)
        and not (Path(token_vla.path).expanduser() / "config.json").is_file()
    ):  # (grounding trains: each node would make another model, or clash in a shared dir)
        raise ConfigError(
            "policy.token_vla.preset_grounding: a multi-node launch does not ground the "
            f"preset; run `rlvla3 launch` of this YAML on one host first (it writes "
            f"{token_vla.path}), then share that folder with every node"
        )
    if seat.multi_host and not security.available():
        raise ConfigError(
            "this pyzmq's libzmq has no CURVE, which a multi-node run needs "
            "(pip install --force-reinstall pyzmq)"
        )


def _run_init_launch(cfg: Config, config_path: str | None, echo: Callable[[str], None]) -> int:
    """Run ``policy.init_launch`` into ``policy.init_checkpoint`` unless a checkpoint is there.

    Returns its exit code (0 when nothing had to run). The first stage's config is its own file
    as written: ``--set`` overrides apply to the stage they were given for.
    """
    init_dir = Path(cfg.policy.init_checkpoint or "")
    if find_checkpoint(init_dir, verify=False) is not None:  # (the launch then pins a whole one)
        return 0
    first = Path(cfg.policy.init_launch or "")
    if config_path is not None and first.resolve() == Path(config_path).resolve():
        raise ConfigError(f"policy.init_launch: {first} is this launch file itself")
    echo(f"no checkpoint in {init_dir} yet: running {first} first to make one")
    code = launch(str(first), out=str(init_dir), echo=echo)
    if code == 0 and find_checkpoint(init_dir, verify=False) is None:
        echo(f"{first} ended without writing a checkpoint into {init_dir}")
        return 1
    return code
