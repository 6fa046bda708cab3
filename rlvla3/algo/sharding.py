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

Every collective here (``gather_state``, the sharded forward and backward) must be entered by
every rank at the same point: the leader decides and posts a message first
(``rlvla3/algo/group_updates.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

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
    register_fsdp_forward_method(policy, "evaluate")
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
    setattr(policy, name, fn)
    register_fsdp_forward_method(policy, name)
    return getattr(policy, name)


def shard_training(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rebuild_optimizer: Any,
    group: TrainGroup,
) -> torch.optim.Optimizer:
    """Shard ``policy`` and move ``optimizer``'s state (whole, the same on every rank: the
    leader's, shared) onto the shards; returns the optimizer over the sharded parameters,
    built by ``rebuild_optimizer(policy)``."""
    whole = optimizer.state_dict()
    shard_policy(policy, group_mesh(group))
    sharded = rebuild_optimizer(policy)
    load_whole_optimizer_state(sharded, whole)
    return sharded


def load_whole_optimizer_state(optimizer: torch.optim.Optimizer, whole: dict[str, Any]) -> None:
    """Load an optimizer state of whole tensors (a checkpoint's) into ``optimizer`` over
    sharded parameters: each rank keeps its own slice of every moment (no communication)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for index, entry in whole["state"].items():
        param = params[int(index)]
        state[int(index)] = {
            key: _local_slice(value, param) if _sharded_like(value, param) else value
            for key, value in entry.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": whole["param_groups"]})


def _sharded_like(value: Any, param: torch.Tensor) -> bool:
    return (
        isinstance(param, DTensor)
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.shape == param.shape
    )


def _local_slice(value: torch.Tensor, param: DTensor) -> DTensor:
    # src_data_rank=None: every rank holds the whole tensor, each keeps its slice, no send
    return distribute_tensor(
        value.to(param.device_mesh.device_type),
        param.device_mesh,
        param.placements,
        src_data_rank=None,
    )


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


def gather_module(module: torch.nn.Module) -> GatheredModule:
    """The whole state of sharded ``module`` (with LoRA, the trained tensors alone: the frozen
    base is not gathered). A collective: every rank calls it, in the same order."""
    trained = trained_state_names(module)
    state = module.state_dict()
    names = list(state) if trained is None else trained
    return GatheredModule({name: whole(state[name]).detach() for name in names}, trained)


def gather_optimizer(optimizer: torch.optim.Optimizer) -> GatheredOptimizer:
    """The whole state of an optimizer over sharded parameters (a collective)."""
    state = optimizer.state_dict()
    gathered = {
        index: {key: whole(value) for key, value in entry.items()}
        for index, entry in state["state"].items()
    }
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
