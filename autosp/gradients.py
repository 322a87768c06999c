"""Gradient reduction inside the compiled model's backward: summed over the SP group, averaged over replicas.

Note [Gradient reduction in backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each rank's backward gives the part of every parameter gradient that flows through
its tokens; the single-device gradient is the sum over the SP group, and
data-parallel replicas (SP groups training different samples) are averaged.  The
compiled model does this itself, as DDP does, so it can be neither forgotten nor
done twice:

- every call of the compiled program is one autograd node (AOTAutograd's compiled
  function) whose inputs include the parameters; a hook on that node receives this
  call's fresh gradient contributions *before* they are accumulated into ``.grad``,
  all-reduces them (one all-reduce per bucket of up to ``BUCKET_BYTES`` per dtype)
  over the whole group, divides by the number of replicas and hands them on;
- so gradient accumulation (several backwards into ``.grad``), several calls before
  one backward, ``torch.autograd.grad`` and ``retain_graph`` are all exact: each
  contribution is reduced exactly once, when it is produced;
- gradients that do not flow through the compiled program (a regulariser computed
  outside the model on the parameters) are the same on every rank and are left alone.

An engine that reduces gradients itself and knows the SP group (DeepSpeed given
AutoSP's mpu: `autosp.deepspeed_initialize`, `autosp.SequenceParallelMPU`) takes the
reduction over: `hand_to_engine` turns this one off.  An engine that does not know
the SP group and averages over all ranks (``deepspeed.initialize`` without an mpu,
accelerate's DeepSpeed plugin) receives gradients already equal on every rank, whose
average is the same gradient: exact, at the price of a second (redundant) reduction.
Parameters sharded in the graph (``shard_parameters=True``) receive their gradients already summed over the whole
group by their gather's reduce-scatter (Note [Parameters gathered in the graph] in autosp/parameter_sharding.py):
they are only divided by the number of replicas here.  DDP is refused (autosp.api); FSDP2 around the whole
compiled model averages gradients already reduced, the engine case above (Note [FSDP2 on the AutoSP model] in
autosp/model.py).  The reduction is not overlapped with
the backward's compute: the compiled backward is one node, and the reduction follows it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from autosp.errors import AutoSPError
from autosp.groups import SequenceParallelGroups

log = logging.getLogger(__name__)

BUCKET_BYTES = 25 * 2**20
"""Largest flat buffer one all-reduce carries (DDP's default bucket size)."""


class GradientReduction:
    """The in-backward gradient reduction of one compiled model (see the Note)."""

    def __init__(self, module: nn.Module, groups: SequenceParallelGroups, *, sharded: frozenset[int] = frozenset()):
        self.module = module
        self.groups = groups
        self.sharded = sharded
        """Identities of the parameter shards whose gradients arrive summed over the group (see the Note)."""
        self.engine: str | None = None
        """Name of the engine that reduces the gradients instead (None: this reduction does)."""

    @property
    def active(self) -> bool:
        return self.engine is None and dist.get_world_size(self.groups.group) > 1

    def hand_to_engine(self, engine: str) -> None:
        """An engine that knows the SP group reduces the gradients from now on; this reduction stops."""
        if self.sharded:
            raise AutoSPError(
                f"{engine} would reduce the gradients of parameters that shard_parameters=True already reduces in the "
                "compiled backward (summing them twice): compile without shard_parameters for this engine, or train "
                "the sharded model with a plain optimizer over model.parameters()")
        self.engine = engine

    def attach(self, program_outputs: Iterable) -> None:
        """Reduce, in backward, the parameter gradients of the program call that produced ``program_outputs``."""
        if not self.active or not torch.is_grad_enabled():
            return
        params = {id(p) for p in self.module.parameters() if p.requires_grad}
        for node, indices, shard_indices in _parameter_nodes(program_outputs, params, self.sharded):
            node.register_hook(self._reduce_hook(indices, shard_indices))

    def _reduce_hook(self, indices: list[int], shard_indices: list[int]):
        def reduce(grad_inputs, grad_outputs):
            grads = list(grad_inputs)
            self.reduce([i for i in indices if grads[i] is not None], grads)
            if self.groups.dp_size > 1:  # summed over the group by the gather's reduce-scatter: average replicas
                for i in (i for i in shard_indices if grads[i] is not None):
                    grads[i] = grads[i] / self.groups.dp_size
            return tuple(grads)

        return reduce

    def reduce(self, indices: list[int], grads: list[torch.Tensor]) -> None:
        """All-reduce ``grads[i]`` for ``i`` in ``indices`` (replacing them): sum over the group / replicas."""
        buckets: dict[torch.dtype, list[list[int]]] = {}
        for i in indices:
            per_dtype = buckets.setdefault(grads[i].dtype, [[]])
            size = sum(grads[j].numel() * grads[j].element_size() for j in per_dtype[-1])
            if per_dtype[-1] and size + grads[i].numel() * grads[i].element_size() > BUCKET_BYTES:
                per_dtype.append([])
            per_dtype[-1].append(i)
        for bucket in (b for per_dtype in buckets.values() for b in per_dtype):
            flat = torch.cat([grads[i].reshape(-1) for i in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups.group)
            if self.groups.dp_size > 1:
                flat /= self.groups.dp_size
            offset = 0
            for i in bucket:
                n = grads[i].numel()
                grads[i] = flat[offset:offset + n].view_as(grads[i])
                offset += n


def _parameter_nodes(outputs: Iterable, params: set[int], sharded: frozenset[int]
                     ) -> list[tuple[torch.autograd.graph.Node, list[int], list[int]]]:
    """The autograd nodes whose inputs include the model's parameters, reached from ``outputs`` (the compiled
    program's node), each with the positions of its whole parameters' inputs and of its shards' inputs."""
    found, seen = [], set()
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        indices = [i for i, (fn, _) in enumerate(node.next_functions)
                   if fn is not None and id(getattr(fn, "variable", None)) in params]
        if indices:
            found.append((node, [i for i in indices if id(node.next_functions[i][0].variable) not in sharded],
                          [i for i in indices if id(node.next_functions[i][0].variable) in sharded]))
        else:
            stack.extend(fn for fn, _ in node.next_functions)
    return found
