"""The sharded mode of a training group (``settings.shard``): FSDP2 over the group's ranks.

``shard_training`` wraps the policy with ``torch.distributed.fsdp.fully_shard``: every rank keeps
``1/N`` of each parameter (dim 0), of its gradient and of the optimizer's moments, and the
parameters are all-gathered unit by unit for a forward or backward pass, the gradients
reduce-scattered after it. The units are the elements of the policy's ``ModuleList``s (a
transformer's blocks) and the policy itself (all the rest), so a pass holds one block's full
parameters at a time beside the root's.

FSDP needs a registered process group; the training group's is a bare backend
(``rlvla3/runtime/train_group.py``), so ``group_mesh`` registers a c10d backend whose factory
hands back that same backend object: FSDP's collectives and the group's own run over one set
of connections, no second rendezvous.

Every collective here (the gatherings, the sharded forward and backward) must be entered by
every rank at the same point: the leader decides and posts a message first
(``rlvla3/algo/group_updates.py``).

Whole tensors exist one at a time: a gathering all-gathers one tensor, rank 0 keeps it (in CPU
memory) and the others drop it before the next; a rank taking the leader's state keeps its slice
of each tensor as it arrives (``local_part``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from rlvla3.policy.base import EvalOutput
from rlvla3.runtime.train_group import TrainGroup
from transport.weights import trained_state_names

_BACKEND = "rlvla3_train_group"


def group_mesh(group: TrainGroup) -> DeviceMesh:
    """A 1-D ``DeviceMesh`` over ``group``'s ranks, on the group's own backend (once a
    process: it becomes the process's default group, which nothing else in a trainer uses)."""
    if dist.is_initialized():
        raise RuntimeError("shard: this process already has a default process group")
    backend = group.pg
    dist.Backend.register_backend(
        _BACKEND, lambda *_: backend, devices=["cuda" if group.backend == "nccl" else "cpu"]
    )
    dist.init_process_group(
        _BACKEND,
        store=dist.PrefixStore("fsdp", group.store),
        rank=group.rank,
        world_size=group.world_size,
    )
    # (closing the group destroys it first: at exit nothing may hold the group's threads)
    group.on_close(dist.destroy_process_group)
    return DeviceMesh.from_group(dist.group.WORLD, group.device.type)


def shard_units(policy: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded as units of their own, innermost first: every element of every
    ``ModuleList`` (the policy itself comes last, with all the parameters left over)."""
    units = [
        element
        for module in policy.modules()
        if isinstance(module, torch.nn.ModuleList)
        for element in module
    ]
    return list(reversed(units))


def shard_policy(policy: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Shard ``policy`` in place over ``mesh`` (its parameters become ``DTensor``s: build
    the optimizer afterwards). ``evaluate`` is what the learners call, so it is made to
    gather the parameters as ``forward`` would."""
    for unit in shard_units(policy):
        fully_shard(unit, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    run_as_forward(policy, "evaluate", policy.evaluate)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            # The group's contract: a gradient is the ranks' SUM, each rank's loss already
            # weighted by its share of the minibatch (``DataParallel.share``). FSDP would
            # average (divide by N); factor 1 with sum-only comms makes it a plain sum
            # (gloo has no PREMUL_SUM, the op a custom factor would otherwise use).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def run_as_forward(
    policy: torch.nn.Module, name: str, fn: Callable[..., Any]
) -> Callable[..., Any]:
    """``fn`` made a forward pass of sharded ``policy``'s root unit, as ``policy.<name>``: it
    gathers the root's parameters before ``fn`` runs and frees them after, as ``forward``
    would. For an evaluation that reaches into the policy's modules without going through its
    ``forward`` or ``evaluate`` (the token VLA's packed SFT evaluation calls its model and
    value head directly). Must not be given a method already registered (``evaluate``)."""
    setattr(policy, name, _without_views(fn))
    register_fsdp_forward_method(policy, name)
    return getattr(policy, name)


def _without_views(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the view tensors of its output (an ``EvalOutput``'s fields, or a tensor)
    copied. FSDP hooks its backward gathering onto a pass's outputs, and an in-place op on a
    view would drop that hook: it warns of every view it is given, on every pass (a policy's
    ``value`` is its critic's output squeezed). The copies are a few values per sample."""

    def own(t: Any) -> Any:
        return t.clone() if isinstance(t, torch.Tensor) and t._base is not None else t

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if isinstance(out, EvalOutput):
            return replace(out, **{f.name: own(getattr(out, f.name)) for f in fields(out)})
        return own(out)

    return call


def shard_training(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rebuild_optimizer: Any,
    group: TrainGroup,
) -> torch.optim.Optimizer:
    """Shard ``policy``; returns a fresh optimizer over its shards, built by
    ``rebuild_optimizer(policy)`` (its state comes after: ``local_part``). ``optimizer``, over
    the whole parameters, is emptied, so that a reference kept to it holds no whole tensor."""
    shard_policy(policy, group_mesh(group))
    optimizer.state.clear()
    for param_group in optimizer.param_groups:
        param_group["params"] = []
    return rebuild_optimizer(policy)


def local_part(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Whole ``value`` as this rank holds it beside ``like``: when ``like`` is a shard
    (``DTensor``, FSDP's ``Shard(dim)`` over the group's 1-D mesh) of the same shape, this
    rank's slice (``torch.chunk``'s, as FSDP cuts), in storage of its own; otherwise ``value``
    itself (a whole parameter's, a scalar like Adam's ``step``). No communication: every rank
    slices what it holds."""
    if not (
        isinstance(like, DTensor) and not isinstance(value, DTensor) and value.shape == like.shape
    ):
        return value
    mesh, (placement,) = like.device_mesh, like.placements
    if not isinstance(placement, Shard):
        raise ValueError(f"a sharded parameter placed {placement}, not Shard(dim)")
    chunks = torch.chunk(value, mesh.size(), dim=placement.dim)
    rank = mesh.get_local_rank()
    local = chunks[rank] if rank < len(chunks) else value.narrow(placement.dim, 0, 0)
    # A copy, not a view: the whole tensor goes at once (a view would keep it alive, and
    # ``distribute_tensor``'s slicing leaves it in reference cycles until the next collection).
    local = local.to(mesh.device_type, memory_format=torch.contiguous_format, copy=True)
    return DTensor.from_local(local, mesh, like.placements, shape=like.shape, stride=like.stride())


def copy_whole(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy whole ``value`` into ``target`` (a state-dict entry): all of it, or, ``target`` a
    shard, this rank's slice."""
    with torch.no_grad():
        if isinstance(target, DTensor):
            target.to_local().copy_(local_part(value, target).to_local())
        else:
            target.copy_(value)


# --- the whole state, gathered from the shards ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class GatheredModule:
    """A sharded module's whole state, gathered: what publishing and checkpoints read of a
    module (``state_dict``, ``trained_state_names``), with nothing else of it."""

    tensors: dict[str, torch.Tensor]
    """The state-dict entries gathered (with LoRA: the trained ones alone)."""
    trained: list[str] | None
    """The module's ``trained_state_names`` (None: the whole state trains)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The gathered tensors, by state-dict key."""
        return self.tensors

    def trained_state_names(self) -> list[str] | None:
        """As the sharded module says."""
        return self.trained


@dataclass(frozen=True, slots=True)
class GatheredOptimizer:
    """A sharded optimizer's whole state, gathered, as a checkpoint reads it."""

    whole: dict[str, Any]
    """``optimizer.state_dict()`` with whole tensors."""

    def state_dict(self) -> dict[str, Any]:
        """The whole state dict."""
        return self.whole


def whole(value: Any) -> Any:
    """A ``DTensor``'s whole tensor (an all-gather: every rank must call it), else ``value``."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _kept(value: Any, keep: bool) -> Any:
    """``value`` gathered whole (a collective) and, on the rank that ``keep``s it, moved to CPU
    memory; None elsewhere, so the whole tensor goes before the next is gathered."""
    full = whole(value)
    if not keep:
        return None
    return full.cpu() if isinstance(full, torch.Tensor) else full


def gather_module(module: torch.nn.Module, keep: bool = True) -> GatheredModule | None:
    """The whole state of sharded ``module`` (with LoRA, the trained tensors alone: the frozen
    base is not gathered), one tensor at a time, in CPU memory; None where not ``keep``. A
    collective: every rank calls it, in the same order; only the one that keeps (rank 0)
    holds more than one whole tensor at once."""
    trained = trained_state_names(module)
    state = module.state_dict()
    names = list(state) if trained is None else trained
    tensors = {name: _kept(state[name], keep) for name in names}
    return GatheredModule(tensors, trained) if keep else None


def gather_optimizer(
    optimizer: torch.optim.Optimizer, keep: bool = True
) -> GatheredOptimizer | None:
    """The whole state of an optimizer over sharded parameters, as ``gather_module``."""
    state = optimizer.state_dict()
    gathered = {
        index: {key: _kept(value, keep) for key, value in entry.items()}
        for index, entry in state["state"].items()
    }
    if not keep:
        return None
    return GatheredOptimizer({"state": gathered, "param_groups": state["param_groups"]})


def evaluate_shared(
    policy: Any, group: TrainGroup, obs: dict[str, torch.Tensor], actions: torch.Tensor
) -> EvalOutput:
    """A sharded policy's ``evaluate`` (no gradients) of a batch every rank holds: each rank
    scores its slice (a rank with none, the first sample, left out: FSDP's gathers need every
    rank's pass) and one all-reduce puts the slices together. The leader's critic pass when
    it builds a batch (``rlvla3/algo/batch.py``)."""
    n = len(actions)
    positions = torch.arange(n).tensor_split(group.world_size)[group.rank]
    scored = positions if len(positions) else torch.arange(min(n, 1))
    with torch.no_grad():
        out = policy.evaluate({k: v[scored] for k, v in obs.items()}, actions[scored])
    parts = torch.zeros(3, n, dtype=torch.float32, device=group.device)
    if len(positions):
        parts[:, positions] = torch.stack([out.log_prob, out.entropy, out.value]).float()
    group.all_reduce_sum_(parts)
    return EvalOutput(log_prob=parts[0], entropy=parts[1], value=parts[2])
