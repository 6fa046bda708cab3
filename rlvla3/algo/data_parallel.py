"""Data parallelism for the learners: one update spread over a training group's ranks.

Every rank holds the whole update batch (the leader posts it, ``rlvla3/runtime/train_group.py``)
and the same shuffle (the leader posts its seed). Each minibatch is cut into ``world_size``
slices; a rank evaluates the loss on its own slice only, and before each optimizer step the
gradients are summed over the ranks in one flat all-reduce, each rank's weighted by its slice's
share of the minibatch. The sum is exactly the gradient of the whole minibatch's mean loss, so
N ranks take the same optimizer steps as one process would on the same batch, and every rank's
weights stay identical without ever being sent (DDP's contract, with the all-reduce written out:
the learners evaluate policies through ``evaluate``, not ``forward``, which DDP's hooks wrap).
Advantages are normalised over the whole minibatch, before it is sliced.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from rlvla3.algo.sharding import copy_whole, local_part
from rlvla3.runtime.train_group import GroupError, Message, TrainGroup

STATE = "state"
"""The kind of the message that brings a joining rank the leader's weights and optimizer state."""

Tensor = torch.Tensor


class DataParallel:
    """A rank's share of each minibatch, and the gradient reduction.

    Args:
        group: the training group (rank and world size, collectives).
        sharded: the policy is sharded (``rlvla3/algo/sharding.py``): FSDP reduce-scatters the
            gradients during the backward pass, so each rank weights its loss by its share
            before it (``weigh_loss``) and ``reduce_gradients`` has nothing left to do.
    """

    def __init__(self, group: TrainGroup, sharded: bool = False) -> None:
        self.group, self.sharded = group, sharded
        self.reduced_bytes = 0
        """Bytes of gradients all-reduced so far (the bench reads it)."""
        self.reduce_s = 0.0
        """Seconds spent in the gradient all-reduces so far."""

    def local_positions(self, size: int) -> Tensor:
        """This rank's positions in a minibatch of ``size`` samples (slices differ by at most
        one sample; a rank's is empty when ``size`` < the world size)."""
        return torch.arange(size).tensor_split(self.group.world_size)[self.group.rank]

    def share(self, size: int) -> tuple[Tensor, float]:
        """This rank's positions in a minibatch of ``size`` samples and the weight of its
        gradient (its share of the minibatch). Sharded, a rank whose slice is empty still
        runs a pass, on the first sample at weight 0: FSDP's gathers and reductions are
        collectives that every rank must enter, over the same autograd graph."""
        positions = self.local_positions(size)
        weight = len(positions) / size
        if self.sharded and not len(positions):
            positions = torch.arange(1)
        return positions, weight

    def weigh_loss(self, loss: Tensor, weight: float) -> Tensor:
        """The loss this rank back-propagates: weighted by its share when sharded (FSDP sums
        the gradients as they are made), as it is otherwise (``reduce_gradients`` weighs)."""
        return loss * weight if self.sharded else loss

    def mean_over_ranks(self, value: float, weight: float) -> float:
        """The ranks' sum of ``weight`` x ``value``: a minibatch's mean from its slices' means
        weighted by their shares (every rank must call it)."""
        total = torch.tensor([value * weight], dtype=torch.float64, device=self.group.device)
        self.group.all_reduce_sum_(total)
        return float(total.item())

    def reduce_gradients(self, params: list[torch.nn.Parameter], weight: float) -> None:
        """Replace every parameter's gradient by the ranks' sum of ``weight`` x their gradient.

        A rank without a gradient for a parameter (its slice was empty) counts as zeros; a
        parameter no rank has a gradient for keeps none, so the optimizer leaves it alone as it
        would in one process (AdamW would otherwise decay it). One flat all-reduce carries the
        gradients and, per parameter, whether a rank had one. Sharded, FSDP has reduced them
        in the backward pass already: nothing to do.
        """
        if self.sharded:
            return
        started = time.perf_counter()
        device = self.group.device
        present = torch.tensor([float(p.grad is not None) for p in params], device=device)
        grads = [
            p.grad.reshape(-1).to(device, torch.float32)
            if p.grad is not None
            else torch.zeros(p.numel(), device=device)
            for p in params
        ]
        flat = torch.cat([torch.cat(grads).mul_(weight), present])
        self.group.all_reduce_sum_(flat)
        had = flat[-len(params) :].tolist()
        offset = 0
        for p, had_grad in zip(params, had, strict=True):
            n = p.numel()
            grad = flat[offset : offset + n].view(p.shape).to(p.device, p.dtype, copy=True)
            p.grad = grad if had_grad > 0 else None
            offset += n
        self.reduced_bytes += flat.numel() * flat.element_size()
        self.reduce_s += time.perf_counter() - started


# --- what the leader posts -----------------------------------------------------------------------


def flatten_tree(tree: dict[str, Any], prefix: str = "") -> dict[str, Tensor]:
    """``{"obs": {"image": t}}`` -> ``{"obs/image": t}``: a batch as named tensors."""
    flat: dict[str, Tensor] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_tree(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def unflatten_tree(flat: dict[str, Tensor]) -> dict[str, Any]:
    """The inverse of ``flatten_tree``."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def whole_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """The leader's weights (buffers too) and optimizer state as the named tensors ``post_state``
    sends (``model/<key>``, ``optim/<index>/<key>``): references, nothing copied."""
    tensors = {f"model/{k}": v.detach() for k, v in module.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            tensors[f"optim/{index}/{key}"] = torch.as_tensor(value)
    return tensors


def post_state(
    group: TrainGroup, tensors: dict[str, Tensor], info: dict[str, Any] | None = None
) -> None:
    """The leader: send its ``whole_state`` and ``info`` (plain fields: where the leader stands)
    to every rank, so all start from where it resumed."""
    group.post(STATE, info or {}, tensors)


def load_state(
    group: TrainGroup,
    message: Message,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:
    """A follower: take the leader's weights and optimizer state from a ``state`` message, one
    tensor at a time as it arrives (a ``lazy`` one's; sharded, this rank keeps its slice of
    each: ``local_part``), into ``module`` and ``optimizer``, whole or sharded alike. The
    learning rates stay this rank's own (an RL update message carries them). Returns the
    message's plain fields."""
    if message.kind != STATE:
        raise GroupError(f"group message: {message.kind!r} where the leader's state was due")
    load_tensors(group.receive(message), module, optimizer)
    return message.info


def load_tensors(
    tensors: Iterable[tuple[str, Tensor]],
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Load named tensors of a ``whole_state`` into ``module`` and ``optimizer``, each as it
    comes: whole, or into shards (this rank's slice: ``local_part``). Every module entry must
    come; a name that fits neither is a ``GroupError``."""
    targets = module.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Tensor]] = {}
    loaded = set()
    for name, value in tensors:
        where, _, rest = name.partition("/")
        if where == "model" and rest in targets and targets[rest].shape == value.shape:
            copy_whole(targets[rest], value)
            loaded.add(rest)
        elif where == "optim" and (slot := _optimizer_slot(rest, len(params))) is not None:
            index, key = slot
            state.setdefault(index, {})[key] = local_part(value, params[index])
        else:
            raise GroupError(
                f"group message state: tensor {name!r:.80} {tuple(value.shape)} does not fit "
                "this rank's policy or optimizer"
            )
    if loaded != targets.keys():
        missing = sorted(targets.keys() - loaded)
        raise GroupError(f"group message state: no tensor for {missing[:3]!r:.120}")
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _optimizer_slot(rest: str, num_params: int) -> tuple[int, str] | None:
    """``<index>/<key>`` of an ``optim/`` tensor, the index within ``num_params``; else None."""
    index, _, key = rest.partition("/")
    if not (index.isdigit() and int(index) < num_params and key):
        return None
    return int(index), key


def shuffle_generator(seed: int) -> torch.Generator:
    """The generator of an update's minibatch shuffles (the same seed on every rank)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
