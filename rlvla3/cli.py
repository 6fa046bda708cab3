"""The ``rlvla3`` command: ``launch`` a run, ``monitor`` it, print its resolved ``config``,
write ``demos``, ``export`` a checkpoint (LoRA adapters merged), ``eval`` a checkpoint with a
benchmark's protocol."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rlvla3.config.typed_load import ConfigError

if TYPE_CHECKING:  # (the command imports what a subcommand needs when it runs)
    from rlvla3.runtime.redis_auth import RedisAuth


def _launch(args: argparse.Namespace) -> int:
    from rlvla3.launch.command import launch
    from rlvla3.runtime import run_secret

    # out of os.environ before anything starts: redis-server, roles and whatever they start
    # never inherit it (the launcher keeps it in memory: it derives each role's keys)
    try:
        run_secret.take()
    except run_secret.SecretError as err:  # a bad RLVLA3_RUN_SECRET: a config error, exit 2
        raise ConfigError(str(err)) from None
    return launch(args.config, args.set, node=args.node, out=args.out, resume=args.resume)


def _config(args: argparse.Namespace) -> int:
    from rlvla3.config.run_config import dump_config_with_defaults, load_config

    print(dump_config_with_defaults(load_config(args.config, args.set)), end="")
    return 0


def _monitor(args: argparse.Namespace) -> int:
    import redis

    from rlvla3.monitor.live import RunNotFound, find_run, snapshot, watch
    from rlvla3.runtime.registry import Registry

    try:
        info = (
            {"redis_url": args.redis, "run_id": args.run}
            if args.redis
            else find_run(args.run, args.runs_root)
        )
    except RunNotFound as err:
        print(f"rlvla3 monitor: {err}", file=sys.stderr)
        return 2
    if not info.get("run_id"):
        print("rlvla3 monitor: --redis needs --run RUN_ID (the run's name)", file=sys.stderr)
        return 2
    try:
        registry = Registry(info["redis_url"], info["run_id"], _monitor_password(info))
        first = snapshot(registry)  # raises if the run's Redis is gone
        if args.json:
            print(json.dumps(first, indent=2))
            return 0
        if args.prometheus is not None:
            return _serve_prometheus(registry, args.prometheus)
        if args.svg:
            from rlvla3.monitor.live import save_svg

            save_svg(registry, Path(args.svg))
            print(f"wrote {args.svg}")
            return 0
        return watch(registry, args.interval)
    except (redis.ConnectionError, FileNotFoundError, ValueError) as err:
        summary = Path(info.get("run_dir", "")) / "summary.json" if "run_dir" in info else None
        if summary is not None and summary.is_file():  # the run has ended: show how
            ended = json.loads(summary.read_text())
            if args.json:
                print(json.dumps({"ended": True, "summary": ended}, indent=2))
            else:
                print(
                    f"run {ended.get('run_id')} has ended: {ended.get('stop_reason')} "
                    f"(summary: {summary})"
                )
            return 0
        print(
            f"rlvla3 monitor: cannot reach the run's Redis ({err}); has it ended?", file=sys.stderr
        )
        return 1


def _serve_prometheus(registry, port: int) -> int:
    """Serve the run to Prometheus on loopback until Ctrl-C or the run ends."""
    import redis

    from rlvla3.monitor.prometheus import serve

    server, bound = serve(registry, port)
    print(f"serving run {registry.run_id} at http://127.0.0.1:{bound}/metrics", flush=True)
    unreachable_since = None
    try:
        while True:
            time.sleep(2.0)  # (only polls whether the run is still there)
            try:
                registry.redis.ping()
                unreachable_since = None
            except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > 10.0:
                    print("the run's Redis is gone: the run has ended", flush=True)
                    return 0
    except KeyboardInterrupt:
        return 0
    finally:
        server.shutdown()


def _monitor_password(info: dict) -> RedisAuth | str | None:
    """The run user's credentials when the run's Redis wants them (a multi-node run's private
    Redis), derived from ``RLVLA3_RUN_SECRET``, else from the run dir's ``secret`` file (mode
    0600, on every node); a configured ``run.redis_url``'s password."""
    from rlvla3.config import redis_url
    from rlvla3.runtime import run_secret
    from rlvla3.runtime.redis_auth import run_redis_auth

    if "run_dir" not in info:  # --redis URL: the secret, if any, comes from the environment
        secret = run_secret.from_env()
        return None if secret is None else run_redis_auth(secret)
    if redis_url.password_of(info.get("redis_url") or "") == redis_url.REDACTED:
        return run_secret.redis_password(Path(info["run_dir"]))  # a configured run.redis_url's
    if not info.get("redis_auth"):
        return None
    secret = run_secret.load(Path(info["run_dir"]))
    return None if secret is None else run_redis_auth(secret)


def _demos(args: argparse.Namespace) -> int:
    from sft.demos import EXPERT_ENVS, generate_demos

    if args.env not in EXPERT_ENVS:
        return _usage_error(
            f"--env: no scripted expert for {args.env!r} (have: {', '.join(EXPERT_ENVS)})"
        )
    if args.episodes < 1:
        return _usage_error(f"--episodes: need at least 1, got {args.episodes}")
    if args.expert_noise < 0:
        return _usage_error(f"--expert-noise: must be >= 0, got {args.expert_noise}")
    try:
        stats = generate_demos(
            args.env,
            args.episodes,
            args.out,
            args.seed,
            expert_noise=args.expert_noise,
            overwrite=args.overwrite,
            codebase_version=args.format,
            obs_mode=args.obs_mode,
        )
    except (FileExistsError, NotADirectoryError, PermissionError) as err:
        return _usage_error(f"--out: {err}")
    print(
        f"wrote {stats.num_episodes} episodes ({stats.num_frames} frames) to {stats.root} "
        f"(LeRobot {args.format}); "
        f"expert success rate {stats.success_rate:.2f} over {stats.num_attempts} attempts"
    )
    return 0


def _usage_error(message: str) -> int:
    print(f"rlvla3: {message}", file=sys.stderr)
    return 2


def _export(args: argparse.Namespace) -> int:
    from rlvla3.export import export_checkpoint

    out = export_checkpoint(args.source, args.out, args.config)
    print(f"wrote {out}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from rlvla3.launch.eval_command import EvalRequest, evaluate

    named = {f.name for f in dataclasses.fields(EvalRequest)} - {"overrides"}
    request = EvalRequest(**{n: getattr(args, n) for n in named}, overrides=tuple(args.set))
    return evaluate(request)


def _add_set(p: argparse.ArgumentParser, help_text: str) -> None:
    """The repeatable ``--set KEY=VALUE`` config override."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=help_text)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a checkpoint with a benchmark's protocol (docs/evaluation.md)",
    )
    p.add_argument("source", help="a checkpoint file or a run dir (its newest checkpoint)")
    p.add_argument("--config", default=None, help="the run's YAML (default: the run dir's)")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--suite",
        default=None,
        choices=("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90"),
        help="a LIBERO suite: every task x its fixed initial states (openpi's protocol)",
    )
    where.add_argument(
        "--env",
        default=None,
        help="an env id (default: the run's env.id); libero/... ids "
        "evaluate that one task, maniskill/... ids ManiSkill's protocol",
    )
    p.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="episodes per LIBERO task (default 50), else in all (ManiSkill 100, others 50)",
    )
    p.add_argument("--seed", type=int, default=0, help="first reset seed (not LIBERO)")
    p.add_argument("--sample", action="store_true", help="sample actions (default: greedy)")
    p.add_argument("--workers", type=int, default=1, help="eval env worker processes")
    p.add_argument(
        "--videos", type=int, default=0, metavar="K", help="GIFs of the first K episodes"
    )
    p.add_argument(
        "--out",
        default=None,
        help="results dir (default: eval-<protocol> in the run dir); "
        "an interrupted evaluation into the same dir resumes",
    )
    _add_set(p, "override a value of the evaluation run's config (repeatable)")
    p.set_defaults(func=_eval)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``rlvla3`` command."""
    parser = argparse.ArgumentParser(prog="rlvla3", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("launch", help="start a run from a launch YAML and supervise it")
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="launch YAML, e.g. launch/cartpole.yaml (without one: the defaults of "
        "rlvla3/config/whole_config.py plus --set; a run needs at least one role)",
    )
    _add_set(p, "override a config value, e.g. --set run.mode=sync (repeatable)")
    p.add_argument("--node", default=None, help="start only this node's roles (multi-host runs)")
    p.add_argument("--out", default=None, help="run dir (default: run.output_dir/run.name)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse an existing run dir and continue from its checkpoints",
    )
    p.set_defaults(func=_launch)

    p = sub.add_parser("config", help="print a launch YAML resolved, with every default")
    p.add_argument("config", nargs="?", default=None, help="launch YAML (none: the defaults)")
    _add_set(p, "override a config value, as for launch (repeatable)")
    p.set_defaults(func=_config)

    p = sub.add_parser("monitor", help="live view of a run (or one --json snapshot)")
    p.add_argument("--run", default=None, help="run dir or run name (default: newest under runs/)")
    p.add_argument("--runs-root", default="runs", help="where run names are looked up")
    p.add_argument("--redis", default=None, help="Redis URL (then --run is the run id)")
    p.add_argument("--json", action="store_true", help="print one JSON snapshot and exit")
    p.add_argument("--interval", type=float, default=1.0, help="refresh period in seconds")
    p.add_argument(
        "--prometheus",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the run's counters and gauges to Prometheus at "
        "http://127.0.0.1:PORT/metrics (loopback only; 0: a free port) instead of the view",
    )
    p.add_argument(
        "--svg", default=None, metavar="PATH", help="write one 80x24 screen to an SVG file and exit"
    )
    p.set_defaults(func=_monitor)

    p = sub.add_parser("demos", help="write scripted-expert demonstrations (LeRobot layout)")
    p.add_argument("--env", default="rlvla3/TableTop-v0", help="env id with a scripted expert")
    p.add_argument("--episodes", type=int, default=200, help="successful episodes to write")
    p.add_argument("--out", required=True, help="dataset directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the first episode")
    # sim.tabletop.OBS_MODES, copied: building the parser imports no simulator (a test checks
    # that every mode is accepted)
    p.add_argument(
        "--obs-mode", default="rgb", choices=("rgb", "state", "rgb+state", "rgb+goal", "rgb+scene")
    )
    p.add_argument(
        "--expert-noise",
        type=float,
        default=0.0,
        help="std of noise on the executed action; the clean action is recorded (DART)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing LeRobot dataset (never deletes any other directory)",
    )
    p.add_argument(
        "--format",
        default="v3.0",
        choices=("v3.0", "v2.1"),
        help="LeRobot dataset layout: v3.0 (LeRobot 0.4 and later load it as is) or v2.1 "
        "(LeRobot 0.3 and earlier)",
    )
    p.set_defaults(func=_demos)

    p = sub.add_parser(
        "export", help="write a run's checkpoint as one plain checkpoint (LoRA adapters merged)"
    )
    p.add_argument("source", help="run dir, its checkpoints dir, or a checkpoint file")
    p.add_argument("--out", required=True, help="the checkpoint file to write")
    p.add_argument(
        "--config", default=None, help="the run's config.yaml (default: the one in the run dir)"
    )
    p.set_defaults(func=_export)
    _add_eval(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``rlvla3`` console command."""
    args = build_parser().parse_args(argv)
    try:
        sys.exit(args.func(args))
    except ConfigError as err:
        print(f"rlvla3: config error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
