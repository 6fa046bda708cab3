"""A role process's entry point: ``python -m roles.<name> --config ... --index I ...`` (what the
launcher runs; the flags are in ``rlvla3/runtime/role.py``'s module doc). It takes the role's
keys from the launcher's pipe before anything else starts, loads the config, finds the run's
Redis, pins the process to its CPUs, builds the role, turns CURVE on in a multi-host run, runs
it and exits with its code."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rlvla3.config.run_config import load_config
from rlvla3.runtime import role_keys
from rlvla3.runtime.cpu_pinning import pin_to_cpus
from rlvla3.runtime.role_redis import run_redis
from transport import security

if TYPE_CHECKING:
    from rlvla3.runtime.role import Role


def main(role_cls: type[Role], argv: list[str] | None = None) -> None:
    """Command-line entry of a role process (what the launcher runs)."""
    parser = argparse.ArgumentParser(prog=f"python -m roles.{role_cls.name}")
    parser.add_argument("--config", required=True, help="resolved run config YAML")
    parser.add_argument("--index", type=int, default=0, help="instance index within the role")
    parser.add_argument("--node", default=None, help="node name (default: the first node)")
    parser.add_argument("--run-dir", default=None, help="run directory (default: config's dir)")
    parser.add_argument(
        "--address", default=None, help="address to bind and advertise (default: the node's host)"
    )
    parser.add_argument("--device", default=None, help="where it runs (the launcher's plan)")
    parser.add_argument(
        "--secret-fd",
        type=int,
        default=None,
        help="a pipe holding this role's keys (the launcher's)",
    )
    args = parser.parse_args(argv)
    # first: nothing started later inherits
    keys = role_keys.take(args.secret_fd, role_cls.name, args.index)
    # the launcher asks a stalled role where it is stuck: every thread's stack to the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    cfg = load_config(args.config)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {role_cls.name}/{args.index} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    run_dir = Path(args.run_dir) if args.run_dir else Path(args.config).resolve().parent
    cfg, redis_password = run_redis(cfg, run_dir, keys)
    if role_cls.name in cfg.roles:
        pin_to_cpus(cfg.roles[role_cls.name].cpus, f"roles.{role_cls.name}.cpus")
    node = args.node or cfg.all_nodes()[0].name
    role = role_cls(
        cfg,
        args.index,
        node=node,
        run_dir=run_dir,
        address=args.address,
        redis_password=redis_password,
        device=args.device,
    )
    if keys is not None:  # a multi-host run: only the run's peers may talk to us
        role.weights_key = keys.weights
        role.chunk_key = keys.chunk_check if keys.chunk_check is not None else keys.chunk_sign
        security.enable(
            keys.curve,
            on_refused=lambda what: role.drop(
                "auth_refused", f"refused a peer without the run's secret: {what}"
            ),
        )
    code = role.run()
    # Everything is stopped, flushed and closed by now. Exit without running interpreter
    # teardown: a daemon thread still blocked inside a C++ call (a gloo receive, a TCPStore
    # wait) would otherwise end the process with "terminate called without an active exception".
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
