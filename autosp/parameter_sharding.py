"""Parameters sharded over the ranks and gathered inside the compiled program (ZeRO-3's memory, AutoSP's one graph).

Note [Parameters gathered in the graph]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``shard_parameters=True`` every rank keeps 1/N of each parameter, N the ranks of the compile's whole group
(data-parallel replicas times the SP group, as ZeRO-3 and ALST partition them), and no rank holds a whole model's
weights between uses.  The design, and why it is not DeepSpeed's or FSDP2's hooks:

- DeepSpeed ZeRO-3 and FSDP2 gather a layer's parameters in module hooks that Dynamo cannot trace
  (``torch._dynamo.disable``), so they break the one graph AutoSP analyses and partitions.  Here the gather is a
  *parametrization* (``torch.nn.utils.parametrize``): ``module.weight`` is computed on every access from this rank's
  flat shard by an autograd-aware functional all-gather (``all_gather_tensor_autograd``).  Dynamo records it where
  the weight is used, so each layer's weights are gathered just before the layer inside the compiled program;
- the all-gather's backward is a reduce-scatter, which *sums* each shard's gradient over every rank: the sum over
  the SP group that Note [Gradient reduction in backward] in autosp/gradients.py performs for whole parameters,
  and the sum over replicas, which that reduction divides by the number of replicas; it divides these too, and
  all-reduces nothing more for them;
- release after use: the joint graph's parameter gathers are tagged ``MUST_RECOMPUTE``
  (`autosp.passes.joint.checkpointing`), so the min-cut partitioner gathers a layer's weights again in the
  backward instead of keeping every gathered weight from the forward to the backward, as ZeRO-3 re-gathers in
  its backward hooks.  What the backward keeps of a weight is its shard;
- the optimizer sees the shards (``model.parameters()``), so its states are sharded too, and each rank updates
  its own 1/N: an elementwise optimizer (SGD, Adam, AdamW) gives the same parameters as on one device.  The shards
  are flat and padded with zeros to a multiple of N; the padding's gradient is zero, so it stays zero;
- a parameter two modules share (tied input and output embeddings) stays whole and is reduced as before: a
  parametrization belongs to one module.

``compiled.full_parameters()`` (`full_parameters`) gathers the whole parameters (or gradients) by their original
names, on every rank, for a checkpoint or a comparison; every rank of the group must call it.  ``state_dict()``
holds the shards (under ``parametrizations.<name>.original``): it resumes the same sharded job without a
collective, so that a save on one rank cannot hang.  ``compiled.clip_grad_norm_(max_norm)`` clips by the norm of
the whole gradients: ``torch.nn.utils.clip_grad_norm_`` over the shards would clip each rank by its own piece's norm,
a quietly different gradient on every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn.utils import parametrize

log = logging.getLogger(__name__)


class GatheredParameter(nn.Module):
    """The parametrization of one sharded parameter: this rank's flat shard -> the whole parameter (Note
    [Parameters gathered in the graph])."""

    def __init__(self, shape: torch.Size, group: dist.ProcessGroup):
        super().__init__()
        self.shape = tuple(shape)
        self.numel = int(torch.Size(shape).numel())
        self.group = group

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        whole = funcol.all_gather_tensor_autograd(shard, 0, self.group)
        return whole[: self.numel].view(self.shape)

    def right_inverse(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``whole`` (called once, when the parametrization is registered)."""
        ranks, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        per_rank = shard_numel(self.numel, ranks)
        flat = nn.functional.pad(whole.detach().reshape(-1), (0, per_rank * ranks - self.numel))
        return flat[rank * per_rank:(rank + 1) * per_rank].clone()


def shard_numel(numel: int, ranks: int) -> int:
    """Elements of each rank's shard of a parameter of ``numel`` elements split over ``ranks`` (the last padded):
    what `GatheredParameter` keeps and what the planner's ledger prices for ZeRO 3."""
    return -(-numel // ranks)


@dataclass(frozen=True)
class ShardedParameters:
    """What `shard_parameters` did: the shards' identities (their gradients arrive summed over the group) and the
    names of the parameters left whole."""

    shard_ids: frozenset[int]
    whole: tuple[str, ...]


def shard_parameters(module: nn.Module, group: dist.ProcessGroup) -> ShardedParameters:
    """Replace each parameter of ``module`` owned by one module with this rank's shard over ``group``, gathered on
    use (Note [Parameters gathered in the graph]).  Every rank of ``group`` must call it on the same model."""
    if any(parametrize.is_parametrized(m) for m in module.modules()):
        raise ValueError("shard_parameters: the model already has parametrizations (is it sharded already?); "
                         "compile the unsharded model")
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for path, mod in module.named_modules(remove_duplicate=False):
        for name, param in mod.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((path, mod, name))
    shard_ids, whole = set(), []
    for places in owners.values():
        distinct = {(id(mod), name) for _, mod, name in places}
        if len(distinct) > 1:
            whole.append(".".join(filter(None, (places[0][0], places[0][2]))))
            continue
        _, mod, name = places[0]
        param = getattr(mod, name)
        parametrize.register_parametrization(mod, name, GatheredParameter(param.shape, group), unsafe=True)
        shard_ids.add(id(mod.parametrizations[name].original))
    if whole:
        log.info("shard_parameters: %d parameter(s) shared by several modules stay whole: %s", len(whole),
                 ", ".join(whole))
    return ShardedParameters(frozenset(shard_ids), tuple(whole))


def clip_grad_norm_(module: nn.Module, max_norm: float, group: dist.ProcessGroup,
                    shard_ids: frozenset[int]) -> torch.Tensor:
    """Scale every gradient of ``module`` so that their total 2-norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does on one device; returns the total norm before clipping.  A shard holds a
    disjoint piece of its parameter, so the squares of its gradient are summed over ``group`` (torch's function,
    called on the shards, would clip each rank by its own piece's norm); whole parameters' gradients are the same on
    every rank and counted once.  A collective: every rank must call it."""
    with_grads = [p for p in module.parameters() if p.grad is not None]
    device = with_grads[0].grad.device if with_grads else torch.device("cpu")
    squares = {True: torch.zeros((), dtype=torch.float64, device=device),
               False: torch.zeros((), dtype=torch.float64, device=device)}
    for p in with_grads:
        squares[id(p) in shard_ids] += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(squares[True], group=group)
    total = (squares[True] + squares[False]).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in with_grads:
        p.grad.mul_(scale.to(p.grad.dtype))
    return total.to(with_grads[0].grad.dtype if with_grads else torch.float32)


def _parametrized(name: str) -> tuple[str, str] | None:
    """``layers.0.q.parametrizations.weight.original`` -> (``layers.0.q``, ``weight``); None for a plain name."""
    owner, marker, rest = name.rpartition("parametrizations.")
    if not marker or (owner and not owner.endswith(".")):
        return None
    return owner.removesuffix("."), rest.removesuffix(".original")


def original_name(name: str) -> str:
    """``layers.0.q.parametrizations.weight.original`` -> ``layers.0.q.weight`` (any other name as it is)."""
    split = _parametrized(name)
    return name if split is None else ".".join(filter(None, split))


def full_parameters(module: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` whole, by its original name (or, ``grads=True``, every gradient that is set):
    sharded ones gathered from the group, whole ones as they are.  A collective: every rank must call it."""
    out = {}
    for name, tensor in module.named_parameters():
        value = tensor.grad if grads else tensor.detach()
        if value is None:
            continue
        split = _parametrized(name)
        if split is not None:
            owner_path, tensor_name = split
            gathered = module.get_submodule(owner_path).parametrizations[tensor_name][0]
            pieces = [torch.empty_like(value) for _ in range(dist.get_world_size(gathered.group))]
            dist.all_gather(pieces, value.contiguous(), group=gathered.group)
            value = torch.cat(pieces)[: gathered.numel].view(gathered.shape)
        out[original_name(name)] = value
    return out
