"""Data-parallel learners on CPU (gloo): per PPO update, the gradient all-reduce's bytes and time
(or, sharded, FSDP's all-gathers and reduce-scatters) and the batch the leader posts, against the
update's compute, and what each rank holds of the training state.

For each policy size, ``--updates`` PPO updates of ``--batch`` samples (``--epochs`` epochs of
``--minibatch`` samples) run on 1 rank (no group) and on 2 ranks, each rank its own process with
``--threads`` torch threads, over gloo on loopback (``rlvla3/runtime/train_group.py``,
``rlvla3/algo/group_updates.py``). Rank 0 builds the batch, posts it (one broadcast per tensor),
and every rank trains its half of each minibatch; before each optimizer step the gradients are
summed in one flat all-reduce. Reported per update (rank 0's view, mean over the updates after a
warm-up one): wall time, time in the all-reduces and their bytes, time posting the batch and its
bytes, and the communication's share of the update. On a machine with fewer free cores than
ranks the 2-rank figures include the ranks waiting for each other's CPU.

The sharded rows (``settings.shard``, ``rlvla3/algo/sharding.py``) run 2 ranks with FSDP2:
no all-reduce of the gradients, but per minibatch an all-gather of the parameters for the
forward pass (and the backward's, for units resharded after the forward) and a reduce-scatter
of the gradients. Each is timed to its end as it is issued (the bench waits for it, so FSDP's
prefetch overlaps nothing here), and its bytes are those of the whole tensors it assembles or
reduces, as the all-reduce's are. ``state MiB/rank`` is what a rank holds of the parameters
and Adam's two moments after the updates.

Usage: ``python bench/data_parallel.py [--updates 6] [--batch 4096] [--minibatch 512]
[--epochs 2] [--threads 1] [--json P] [--smoke]``
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import torch
import torch.distributed as dist
from harness.provenance import write_result
from harness.report import Table, benchmark_parser, host_line, host_record, load_average_1m

from rlvla3.algo.group_updates import GroupUpdates
from rlvla3.algo.learners import Objective
from rlvla3.algo.optim import build_optimizer
from rlvla3.config.run_config import AlgoConfig
from rlvla3.policy.mlp import MLPPolicy
from rlvla3.runtime.train_group import TrainGroup, follower_store
from transport.weights import start_store

MODELS = {"mlp 64x64 (CartPole)": (64, 64), "mlp 1024x3": (1024, 1024, 1024)}
OBS_DIM = 64
TABLE = Table.from_layout(
    "model:<22 | ranks:>5 | mode:<10 | params:>10, | update ms:>10.1f | all-reduce ms:>13.1f"
    " | all-reduce MiB:>14.2f | fsdp ms:>8.1f | fsdp MiB:>9.2f | post ms:>8.1f"
    " | post MiB:>9.2f | comm share:>10.1% | state MiB/rank:>14.2f"
)
CASES = ((1, False), (2, False), (2, True))
"""(ranks, sharded) of each model's rows."""


class CollectiveMeter:
    """Time and bytes of FSDP's collectives in this process: ``torch.distributed``'s
    ``all_gather_single`` and ``reduce_scatter_single`` (what FSDP2 calls) wrapped, each
    waited for as it is issued. Bytes: the whole tensor gathered, or reduced."""

    def __init__(self) -> None:
        self.seconds = 0.0
        """Seconds in the collectives so far."""
        self.bytes = 0
        """Bytes of the whole tensors they assembled or reduced so far."""
        self._wrap("all_gather_single", "output_tensor", 0)
        self._wrap("reduce_scatter_single", "input", 1)

    def _wrap(self, name: str, whole: str, position: int) -> None:
        original = getattr(dist, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            work = original(*args, **kwargs)
            if work is not None:  # (FSDP waits for it again: a no-op once done)
                work.wait()
            self.seconds += time.perf_counter() - started
            tensor = kwargs[whole] if whole in kwargs else args[position]
            self.bytes += tensor.numel() * tensor.element_size()
            return work

        setattr(dist, name, timed)


def _local_bytes(value) -> int:
    """Bytes of a tensor this rank holds (a ``DTensor``'s own shard)."""
    if not isinstance(value, torch.Tensor):
        return 0
    local = value.to_local() if hasattr(value, "to_local") else value
    return local.numel() * local.element_size()


def _state_bytes(policy: MLPPolicy, optimizer: torch.optim.Optimizer) -> int:
    """What this rank holds of the parameters and the optimizer's state."""
    moments = [v for state in optimizer.state.values() for v in state.values()]
    return sum(map(_local_bytes, [*policy.parameters(), *moments]))


def _batch(n: int, policy: MLPPolicy) -> dict:
    """``n`` random observations, acted on by ``policy``, with random advantages."""
    obs = {"state": torch.randn(n, OBS_DIM, generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        out = policy.act(obs)
    adv = torch.randn(n)
    fields = ("actions", "log_probs", "values", "advantages", "returns")
    return {"obs": obs} | dict(
        zip(fields, (out.action, out.log_prob, out.value, adv, out.value + adv), strict=True)
    )


def _rank(
    rank: int, world: int, shard: bool, port: int, hidden: tuple[int, ...], args: dict, out: str
) -> None:
    """One rank's updates; rank 0 writes its per-update figures to ``out`` (JSON)."""
    torch.set_num_threads(args["threads"])
    torch.manual_seed(0)
    policy = MLPPolicy(OBS_DIM, gym.spaces.Discrete(4), hidden_sizes=hidden)
    algo = AlgoConfig(epochs=args["epochs"], minibatch_size=args["minibatch"])
    optimizer = build_optimizer(policy, algo)
    group = None
    if world > 1:
        store = follower_store(f"127.0.0.1:{port}", timeout_s=60)
        group = TrainGroup(store, rank, world, torch.device("cpu"), "127.0.0.1", timeout_s=120)
    objective = Objective(algo, vf_coef=algo.vf_coef, norm_adv=True)
    rebuild = functools.partial(build_optimizer, algo=algo) if shard else None
    updates = GroupUpdates(group, objective, policy, optimizer, rebuild)
    # acted once, before any sharding (``act`` is no pass of a sharded policy): the figures
    # depend on the batch's size, not on its values
    batch = _batch(args["batch"], policy)
    updates.share_state()
    meter = CollectiveMeter() if updates.sharded else None
    rows = []
    for _ in range(args["updates"] + 1):  # the first is a warm-up
        before = (updates.post_s, updates.posted_bytes)
        fsdp_before = (meter.seconds, meter.bytes) if meter is not None else (0.0, 0)
        dp = updates.data_parallel
        reduce_before = (dp.reduce_s, dp.reduced_bytes) if dp is not None else (0.0, 0)
        started = time.perf_counter()
        if group is None or group.leader:
            updates.lead(batch, policy_coef=1.0, reference=None)
        else:
            message = group.wait(lambda: False, lambda: time.sleep(0.001))
            updates.follow(message, reference=None)
        wall = time.perf_counter() - started
        reduce_now = (dp.reduce_s, dp.reduced_bytes) if dp is not None else (0.0, 0)
        fsdp_now = (meter.seconds, meter.bytes) if meter is not None else (0.0, 0)
        rows.append(
            {
                "update_s": wall,
                "all_reduce_s": reduce_now[0] - reduce_before[0],
                "all_reduce_bytes": reduce_now[1] - reduce_before[1],
                "fsdp_s": fsdp_now[0] - fsdp_before[0],
                "fsdp_bytes": fsdp_now[1] - fsdp_before[1],
                "post_s": updates.post_s - before[0],
                "post_bytes": updates.posted_bytes - before[1],
            }
        )
    if group is not None:
        # leave together, as the roles do: no rank exits while another is still in the
        # group's last collective, and each drops its process group before the interpreter
        # tears down (a rank that exits with gloo's threads still up can die in ``terminate``)
        if group.leader:
            group.say_stop(timeout_s=60)
        else:
            group.follow_to_stop(lambda message: None, timeout_s=60)
        group.close()
    if rank == 0:
        params = sum(p.numel() for p in policy.parameters())
        state = _state_bytes(updates.policy, updates.optimizer)
        found = {"params": params, "state_bytes_per_rank": state, "updates": rows[1:]}
        Path(out).write_text(json.dumps(found))


def measure(name: str, hidden: tuple[int, ...], world: int, shard: bool, args: dict) -> dict:
    """Run ``world`` ranks (processes) of ``hidden``'s MLP (``shard``: sharded); rank 0's mean
    figures per update."""
    store = start_store("127.0.0.1", timeout_s=60)
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        procs = [
            ctx.Process(target=_rank, args=(r, world, shard, store.port, hidden, args, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
            if p.exitcode != 0:
                raise RuntimeError(
                    f"{name}: a rank of {world} failed (exit code {p.exitcode}; its stderr is above)"
                )
        found = json.loads(Path(out).read_text())
    rows = found["updates"]
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    comm = (mean["all_reduce_s"] + mean["fsdp_s"] + mean["post_s"]) / mean["update_s"]
    return {
        "model": name,
        "ranks": world,
        "mode": "sharded" if shard else "replicated",
        "params": found["params"],
        "state_bytes_per_rank": found["state_bytes_per_rank"],
        **mean,
        "comm_share": comm,
    }


def main() -> None:
    parser = benchmark_parser(__doc__, smoke_help="2 updates of a small batch, for CI")
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--minibatch", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.smoke:
        args.updates, args.batch, args.minibatch, args.epochs = 2, 256, 128, 1
    settings = vars(args)
    load_before = load_average_1m()
    results = []
    models = dict(list(MODELS.items())[:1]) if args.smoke else MODELS
    for name, hidden in models.items():
        for world, shard in CASES:
            results.append(measure(name, hidden, world, shard, settings))
    TABLE.print(
        (
            r["model"],
            r["ranks"],
            r["mode"],
            r["params"],
            r["update_s"] * 1e3,
            r["all_reduce_s"] * 1e3,
            r["all_reduce_bytes"] / 2**20,
            r["fsdp_s"] * 1e3,
            r["fsdp_bytes"] / 2**20,
            r["post_s"] * 1e3,
            r["post_bytes"] / 2**20,
            r["comm_share"],
            r["state_bytes_per_rank"] / 2**20,
        )
        for r in results
    )
    host = host_record(load_before)
    print(host_line(host))
    write_result(args.json, "data_parallel", {"cases": results, "host": host}, settings)


if __name__ == "__main__":
    main()
