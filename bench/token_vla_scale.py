"""The token VLA at real size (issue 32, item 8): a random-init model of a size preset (default
``llava-0.5b``: 558M parameters, rlvla3/policy/presets.py, written into a temp dir, nothing
fetched), bfloat16 on CUDA (float32 on the CPU), LoRA of ``--lora-rank`` on ``--lora-targets``,
the table-top task's prompt and action tokens (launch/token_vla_tabletop.yaml) at the preset's
image size. Each figure is measured against the bare ``transformers`` model on the same device
(bench/harness/token_vla_loops.py):

  a. bare inference: the model alone on a pre-built processor batch of ``--batch`` table-top
     observations, prefill with the KV cache + one single-token forward per further action
     token -> actions/s.
  b. policy.act: ``TokenVLAPolicy.act`` on the same observations, their inputs built as the
     policy builds them (``DeviceInputs`` where its probe allows: the pixels normalised on the
     device, prompts cached; ``device_inputs`` in the JSON says whether it did).
  p. policy.act with the processor building every batch on the CPU (``DeviceInputs`` off), the
     path of a processor its probe refuses. b / p is what the shortcut buys.
  c. rollout server: the real ``RolloutServer`` role (bench/harness/server_harness.py) serving
     this policy, a client keeping 2 x ``--batch`` requests in flight so that batches of
     ``--batch`` form -> actions/s, and the mean batch formed. c / a is the headline (goal 0.8).
  d. bare training: the LoRA-wrapped model, teacher-forced forward over prompt + action tokens,
     -sum of their log-probs + a value head's MSE, backward, Adam step; minibatch ``--batch``
     -> samples/s.
  e. trainer update: what the trainer runs per version (the learner of rlvla3/algo builds the
     batch of ``--train-samples`` synthetic env steps, then ``ppo_update``: ``--epochs`` passes
     of minibatch ``--batch``) -> samples x epochs / s. e / d is the second headline (goal 0.8).
  f. async vs sync: env steps/s of the whole system through the real launcher
     (bench/harness/mode_rates.py), ``--num-envs`` table-top envs over ``--num-workers`` env
     workers, rollout server, trainer and broadcaster on the device, ``--duration-s`` each,
     from ``--warmup-s`` after the first update trained.

Phases a, b, d, e run in this process, then c and f in processes of their own (this process's
model freed first). Each phase prints its figure when done and the JSON (``--json``) is rewritten
after each, so a time-out leaves the figures measured so far. A phase that fails is recorded
under ``errors`` with its traceback printed, and the next phases still run (a lent GPU's minutes
are too few to rerun them all); the exit status is then 1.

    python bench/token_vla_scale.py [--preset llava-0.5b] [--device cuda] [--phases a,b,c,d,e,f]
        [--batch 32] [--lora-rank 32] [--duration-s 60] [--json PATH]

``--smoke``: the llava-test preset on the CPU, batch 4, 1-2 s windows (seconds, for CI; the
figures say nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness.token_vla_loops as loops
import torch
import yaml
from harness.clients import batched_client
from harness.mode_rates import measure_rates, mode_roles
from harness.provenance import write_result
from harness.report import Table, benchmark_parser
from harness.server_harness import ServerHarness, in_windows

from rlvla3.config.run_config import config_from_dict
from rlvla3.launch.redis_server import EmbeddedRedis
from rlvla3.policy import presets
from rlvla3.policy.factory import build_policy, env_spaces
from rlvla3.policy.memory_check import check_role_memory
from transport.messages import ObsRequest
from transport.weights import FlatLayout

LAUNCH = "launch/token_vla_tabletop.yaml"
"""The table-top task's token-VLA run: its env, prompt, bins and PPO settings."""
PHASES = ("a", "b", "p", "c", "d", "e", "f")
IN_PROCESS = ("a", "b", "p", "d", "e")
"""Phases run on a policy loaded in this process (phase c needs it too: the weights' length)."""
AGAINST = {"b": "a", "p": "a", "c": "a", "e": "d"}
"""Phase -> the bare loop its figure is measured against."""
GOAL = 0.8
"""Fraction of the bare loop's rate the system should reach (c / a and e / d)."""
TABLE = Table.from_layout("phase:<8 | what:<30 | rate:>12,.1f | unit:<19 | vs bare:>8")


def parse_args() -> argparse.Namespace:
    parser = benchmark_parser(__doc__, smoke_help="llava-test on the CPU, seconds, for CI")
    cuda = torch.cuda.is_available()
    parser.add_argument("--preset", default="llava-0.5b", help="a size preset: FAMILY-SIZE")
    parser.add_argument("--model-dir", type=Path, help="where the preset is (written if absent)")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--phases", default=",".join(PHASES), help="e.g. a,b,c")
    parser.add_argument("--batch", type=int, default=32, help="observations per act / minibatch")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--lora-targets", nargs="+", default=["q_proj", "v_proj"])
    parser.add_argument("--window-s", type=float, default=10.0, help="timing window of a-e")
    parser.add_argument("--train-samples", type=int, default=128, help="env steps per update")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-envs", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--duration-s", type=float, default=60.0, help="window of each mode (f)")
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--chunk-len", type=int, default=32, help="env.chunk_len of f")
    parser.add_argument(
        "--run-dir", type=Path, help="where f's runs keep their YAML and logs (default: removed)"
    )
    # torch threads of this process and of the server and trainer roles: half the cores, at
    # most 4 (on a busy 2-core host two spinning OpenMP threads made the bare loops 70x slower)
    threads = max(1, min(4, (os.cpu_count() or 2) // 2))
    parser.add_argument("--threads", type=int, default=threads)
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.device, args.batch, args.window_s = "llava-test", "cpu", 4, 1.0
        args.train_samples, args.lora_rank, args.threads = 8, 4, 1
        args.num_envs, args.num_workers, args.duration_s, args.warmup_s = 4, 1, 2.0, 0.5
        args.chunk_len = 4  # sync rounds short enough to finish inside the window
    args.phases = [p for p in args.phases.split(",") if p]
    if unknown := set(args.phases) - set(PHASES):
        parser.error(f"--phases: no phase {sorted(unknown)} (phases {', '.join(PHASES)})")
    if args.num_envs % args.num_workers:
        parser.error("--num-envs must be a multiple of --num-workers")
    presets.parse_preset(args.preset, "--preset")
    return args


def run_sections(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """The ``env``, ``policy`` and ``algo`` sections: the launch file's, at the preset's image
    size, the written preset without grounding or SFT start, ``--lora-*``, ``--batch``."""
    launch = yaml.safe_load(Path(LAUNCH).read_text())
    size = presets.SIZES[presets.parse_preset(args.preset, "--preset")[1]]
    env = launch["env"]
    env["kwargs"] = {**env["kwargs"], "image_size": size.image_size}
    token_vla = {k: v for k, v in launch["policy"]["token_vla"].items() if "preset" not in k}
    token_vla.update(path=str(model_dir), dtype="bfloat16" if args.device != "cpu" else "float32")
    lora = {"rank": args.lora_rank, "target_modules": args.lora_targets}
    algo = {**launch["algo"], "epochs": args.epochs, "minibatch_size": args.batch}
    algo.update(batch_steps=args.train_samples, value_warmup_updates=0)
    policy = {"kind": "token_vla", "token_vla": token_vla, "lora": lora}
    return {"env": env, "policy": policy, "algo": algo}


class Recorder:
    """The results so far, written to ``--json`` after each phase."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: dict[str, Any] = {"preset": args.preset, "device": args.device}
        self.labels: dict[str, str] = {}
        """Phase -> what it measured, in the order measured."""

    def phase(self, key: str, what: str, rate: float, unit: str, started: float, **extra) -> None:
        seconds = time.monotonic() - started
        self.labels[key] = what
        self.results[key] = {"rate": rate, "unit": unit, "phase_s": seconds, **extra}
        print(f"phase {key}: {what}: {rate:,.1f} {unit} ({seconds:.1f} s)", flush=True)
        self.flush()

    @contextlib.contextmanager
    def guard(self, key: str) -> Iterator[None]:
        """Run one phase: an exception is recorded under ``errors`` and does not stop the next."""
        try:
            yield
        except Exception as err:
            traceback.print_exc()
            print(f"phase {key}: failed: {type(err).__name__}: {err}", flush=True)
            self.results.setdefault("errors", {})[key] = f"{type(err).__name__}: {err}"
            self.flush()

    def note(self, key: str, value: Any) -> None:
        self.results[key] = value
        self.flush()

    def flush(self) -> None:
        write_result(self.args.json, "token_vla_scale", self.results, vars(self.args))


def in_process_phases(args: argparse.Namespace, cfg, rec: Recorder) -> int:
    """Phases a, b, d, e on one policy in this process; returns its flat weight length."""
    device = torch.device(args.device)
    started = time.monotonic()
    estimate = check_role_memory(cfg, "trainer", device, copies=1, trains=True)
    if estimate is not None:
        print(f"model memory (trainer): {estimate.describe()}", flush=True)
        rec.note("memory_estimate", estimate.describe())
    spaces = env_spaces(cfg)
    policy = build_policy(cfg, spaces).to(device).eval()
    params = sum(p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    size = sum(p.numel() * p.element_size() for p in policy.parameters())
    print(
        f"policy: {params:,} parameters ({size / 2**30:.2f} GiB), {trainable:,} trainable, "
        f"loaded in {time.monotonic() - started:.1f} s",
        flush=True,
    )
    rec.note("model", {"parameters": params, "bytes": size, "trainable": trainable})
    numel = FlatLayout.of(policy).numel
    obs = loops.tabletop_observations(cfg.env.id, cfg.env.kwargs, args.batch)
    obs_t = {k: torch.from_numpy(v).to(device) for k, v in obs.items()}
    # the policy's own prompt and processor call: the bare loops get exactly its inputs
    inputs, _ = policy._prompt_inputs(obs_t)
    count = policy.bins.tokens
    rec.note("prompt_tokens", int(inputs["input_ids"].shape[1]))
    rec.note("device_inputs", policy.device_inputs is not None)
    window, b = args.window_s, args.batch
    if "a" in args.phases:
        with rec.guard("a"):
            t = time.monotonic()
            bare = loops.bare_inference(policy.model, inputs, policy.action_ids, count)
            rate, _ = loops.calls_per_s(bare, window, device)
            rec.phase("a", "bare inference", rate * b, "actions/s", t)
    if "b" in args.phases:
        with rec.guard("b"):
            t = time.monotonic()
            rate, _ = loops.calls_per_s(lambda: policy.act(obs_t), window, device)
            rec.phase("b", "policy.act", rate * b, "actions/s", t)
    if "p" in args.phases:
        with rec.guard("p"):
            t = time.monotonic()
            shortcut, policy.device_inputs = policy.device_inputs, None
            try:
                rate, _ = loops.calls_per_s(lambda: policy.act(obs_t), window, device)
            finally:
                policy.device_inputs = shortcut
            rec.phase("p", "policy.act, processor on CPU", rate * b, "actions/s", t)
    policy.train()
    if "d" in args.phases:
        with rec.guard("d"):
            t = time.monotonic()
            lr = cfg.algo.lr
            step = loops.bare_training(policy.model, inputs, policy.action_ids, count, lr)
            rate, _ = loops.calls_per_s(step, window, device)
            rec.phase("d", "bare training", rate * b, "samples/s", t)
    if "e" in args.phases:
        with rec.guard("e"):
            t = time.monotonic()
            chunks = loops.synthetic_chunks(policy, obs_t, args.train_samples, cfg.env.chunk_len)
            update = loops.trainer_update(policy, cfg, chunks, device)
            rate, metrics = loops.calls_per_s(update, window, device)
            epochs = int(metrics["num_epochs"])
            rec.phase(
                "e",
                "trainer update",
                rate * args.train_samples * epochs,
                "samples x epochs/s",
                t,
                epochs=epochs,
                minibatches=int(metrics["num_minibatches"]),
            )
    return numel


def serve_phase(args: argparse.Namespace, sections: dict, numel: int, rec: Recorder) -> None:
    """Phase c: the real rollout server, ``2 x --batch`` requests in flight."""
    started = time.monotonic()
    obs = loops.tabletop_observations(sections["env"]["id"], sections["env"]["kwargs"], args.batch)
    requests = [
        ObsRequest(env_key=f"0/{i}", request_id=i, obs={k: v[i] for k, v in obs.items()})
        for i in range(args.batch)
    ]
    settings = {"max_batch": args.batch, "device": args.device, "num_threads": args.threads}
    with ServerHarness(
        "bench_token_vla_scale", 1, settings=settings, sections=sections, numel=numel
    ) as harness:
        print(f"phase c: rollout server up in {time.monotonic() - started:.1f} s", flush=True)
        rate, start, end = batched_client(
            harness.addresses[0], 2 * args.batch, args.window_s, codec=False, requests=requests
        )
    batches = in_windows(harness.records[0]["batches"], [(start, end)])
    mean_batch = float(batches[:, 2].mean()) if len(batches) else 0.0
    rec.phase("c", "rollout server", rate, "actions/s", started, mean_batch=mean_batch)


def modes_phase(args: argparse.Namespace, sections: dict, rec: Recorder) -> None:
    """Phase f: sync and async through the real launcher."""
    per_worker = args.num_envs // args.num_workers
    env = {**sections["env"], "num_envs_per_worker": per_worker, "chunk_len": args.chunk_len}
    env["envs_per_request"] = min(env.get("envs_per_request", 1), per_worker)
    roles = mode_roles(args.num_workers, args.num_envs)
    for role in ("rollout_server", "trainer", "weight_broadcaster"):
        roles[role].setdefault("settings", {})["device"] = args.device
    for role in ("rollout_server", "trainer"):
        roles[role]["settings"]["num_threads"] = args.threads
    # one update per round in both modes: sync mode updates per round (--train-samples is
    # phase e's batch), and async then trains batches of the same size
    algo = {**sections["algo"], "batch_steps": 0}
    rates: dict[str, float] = {}
    with EmbeddedRedis() as redis, tempfile.TemporaryDirectory(prefix="rlvla3-scale-") as tmp:
        run_dir = args.run_dir or Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        for mode in ("sync", "async"):
            with rec.guard(f"f_{mode}"):
                started = time.monotonic()
                run = {
                    "name": f"bench_token_vla_scale_{mode}_{time.monotonic_ns()}",
                    "mode": mode,
                    "redis_url": redis.url,
                    "progress_interval_s": 3600,
                    # loading a large model holds a role's GIL for seconds
                    "heartbeat_ttl_s": 120.0,
                    "stall_timeout_s": 300.0,
                    "stop": {"max_wall_s": args.warmup_s + args.duration_s + 600},
                }
                cfg = {"run": run, "roles": roles, **sections, "env": env, "algo": algo}
                # from the first update on: a large model's first round (its first update,
                # the weight link's set-up) is no steady state, and in sync mode the envs wait
                # for all of it
                got = measure_rates(
                    cfg,
                    args.num_envs,
                    run_dir,
                    args.warmup_s,
                    args.duration_s,
                    started_by="samples_consumed",
                )
                rates[mode] = got["env_steps_per_s"]
                rec.phase(
                    f"f_{mode}",
                    f"{mode} env steps",
                    rates[mode],
                    "env steps/s",
                    started,
                    **{k: v for k, v in got.items() if k != "env_steps_per_s"},
                )
    # None where a mode failed or sync stepped less than one env step in its window (a
    # least-squares slope of a flat counter is float noise, not a rate): no ratio to give
    sync, async_ = rates.get("sync"), rates.get("async")
    stepped = sync is not None and sync * args.duration_s >= 1.0
    rec.note("f_speedup_async_vs_sync", async_ / sync if stepped and async_ is not None else None)


def print_summary(rec: Recorder) -> None:
    """One line per figure, each against its bare loop where it has one."""
    results = rec.results
    print(TABLE.header())
    for key, label in rec.labels.items():
        r, base = results[key], results.get(AGAINST.get(key, ""))
        ratio = f"{r['rate'] / base['rate']:.2f}" if base else "-"
        print(TABLE.row(key, label, r["rate"], r["unit"], ratio))
    if "c" in results:
        print(
            f"rollout server mean batch {results['c']['mean_batch']:.1f}; goal c/a, e/d >= {GOAL}"
        )
    if results.get("f_speedup_async_vs_sync"):
        print(f"async / sync env steps/s: {results['f_speedup_async_vs_sync']:.2f}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    rec = Recorder(args)
    with tempfile.TemporaryDirectory(prefix="rlvla3-scale-model-") as tmp:
        model_dir = args.model_dir or Path(tmp) / "model"
        started = time.monotonic()
        wrote = presets.ensure_preset(str(model_dir), args.preset, "--preset")
        rec.note("preset_write_s", time.monotonic() - started if wrote else 0.0)
        print(
            f"preset {args.preset} in {model_dir} ({'written' if wrote else 'found'}, "
            f"{time.monotonic() - started:.1f} s)",
            flush=True,
        )
        sections = run_sections(args, model_dir)
        cfg = config_from_dict({"run": {"name": "token_vla_scale"}, **sections})
        numel = 0
        if set(args.phases) & {*IN_PROCESS, "c"}:
            numel = in_process_phases(args, cfg, rec)
        gc.collect()  # this process's model goes before the servers load theirs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if "c" in args.phases:
            with rec.guard("c"):
                serve_phase(args, sections, numel, rec)
        if "f" in args.phases:
            modes_phase(args, sections, rec)
    for key in ("c", "e"):
        base = rec.results.get(AGAINST[key])
        if key in rec.results and base:
            rec.results[key]["vs_bare"] = rec.results[key]["rate"] / base["rate"]
    rec.flush()
    print_summary(rec)
    if failed := rec.results.get("errors"):
        sys.exit(f"phases failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
