"""Custom ops used by the sequence-parallel graph: collectives, and the copies of the activation offload.

Each op is a ``torch.library.custom_op`` with a fake (shape) implementation and an
autograd formula, so Dynamo, AOTAutograd and Inductor treat it as one opaque node
in forward and backward graphs.  The process group travels as an argument: its
c10d name, resolved by torch's own registry at run time (no registry of ours).
The namespace is ``autosp_testbed``: DeepSpeed's own AutoSP registers
``autosp::all_to_all`` with another signature, and both must live in one process.

- ``autosp_testbed::all_to_all(x, scatter_dim, gather_dim, group_name, group_size)``:
  split ``x`` into ``group_size`` chunks along ``scatter_dim``, send chunk j to
  group rank j, concatenate what arrives along ``gather_dim`` in rank order.
  Its gradient is the all-to-all with the two dims swapped.
- ``autosp_testbed::all_reduce_sum(x, group_name)``: sum over the group; the gradient is
  the identity.  See Note [Loss all-reduce gradient].
- ``autosp_testbed::all_reduce_sum_sum_grad(x, group_name)``: the same sum, whose
  gradient is summed over the group (Note [Gradient placements]).
- ``autosp_testbed::all_gather(x, dim, group_name, group_size)``: every rank's ``x``
  concatenated along ``dim`` in rank order.  For integer metadata (positions, a
  padding mask) only: it has no gradient.
- ``autosp_testbed::all_to_all_start(x, scatter_dim, group_name, group_size)`` and
  ``autosp_testbed::all_to_all_wait(in_flight, gather_dim)``: the same all-to-all
  split in two, so that computation can run between them.  See Note [All-to-all as
  start and wait].
- ``autosp_testbed::offload_to_host(x)``, ``reload_from_host(h, device)`` and ``reload_wait(x)``: the copies of the
  activation offload pass, to host memory and back.  See Note [Activation offload ops].
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = ["all_gather", "all_reduce_max", "all_reduce_sum", "all_reduce_sum_sum_grad", "all_to_all", "all_to_all_start",
           "all_to_all_wait", "offload_to_host", "reload_from_host", "reload_wait"]


def _send_layout(x: torch.Tensor, scatter_dim: int, group_size: int) -> torch.Tensor:
    """[P, ...chunk]: chunk j (along ``scatter_dim``) goes to rank j."""
    return torch.stack(torch.chunk(x, group_size, dim=scatter_dim)).contiguous()


def _receive_layout(recv: torch.Tensor, gather_dim: int) -> torch.Tensor:
    """recv[j] came from rank j: concatenate in rank order along ``gather_dim``."""
    return torch.cat(recv.unbind(0), dim=gather_dim).contiguous()


def _all_to_all_shape(shape: torch.Size, scatter_dim: int, gather_dim: int, group_size: int) -> list[int]:
    out = list(shape)
    if out[scatter_dim] % group_size:
        raise ValueError(
            f"all_to_all: dim {scatter_dim} of size {out[scatter_dim]} is not divisible by the group size {group_size}"
        )
    out[scatter_dim] //= group_size
    out[gather_dim] *= group_size
    return out


@torch.library.custom_op("autosp_testbed::all_to_all", mutates_args=())
def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group_name: str, group_size: int) -> torch.Tensor:
    send = _send_layout(x, scatter_dim, group_size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=_resolve_process_group(group_name))
    return _receive_layout(recv, gather_dim)


@all_to_all.register_fake
def _(x, scatter_dim, gather_dim, group_name, group_size):
    return x.new_empty(_all_to_all_shape(x.shape, scatter_dim, gather_dim, group_size))


def _all_to_all_backward(ctx, grad):
    return all_to_all(grad, ctx.gather_dim, ctx.scatter_dim, ctx.group_name, ctx.group_size), None, None, None, None


def _all_to_all_setup_context(ctx, inputs, output):
    _, ctx.scatter_dim, ctx.gather_dim, ctx.group_name, ctx.group_size = inputs


all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup_context)


# Note [Loss all-reduce gradient]
# Every rank of an SP group computes the partial loss of its shard and the
# all-reduce makes the total visible on every rank.  Each rank then calls
# backward on its copy with seed 1.  Differentiating "total = sum_r partial_r"
# with an all-reduce in backward would hand each partial a gradient of P (one per
# rank's seed) and scale every parameter gradient by P.  Only one copy of the
# total is the objective, so the backward is the identity: partial_r receives
# gradient 1 on its own rank, and summing parameter gradients over the group
# (the reduction in backward, autosp.gradients) yields the gradient of the total exactly once.


def _all_reduce(x: torch.Tensor, group_name: str, op: dist.ReduceOp) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, op=op, group=_resolve_process_group(group_name))
    return out


def _all_reduce_fake(x, group_name):
    return torch.empty_like(x)


@torch.library.custom_op("autosp_testbed::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _all_reduce(x, group_name, dist.ReduceOp.SUM)


all_reduce_sum.register_fake(_all_reduce_fake)


def _all_reduce_sum_backward(ctx, grad):
    # See Note [Loss all-reduce gradient]
    return grad, None


all_reduce_sum.register_autograd(_all_reduce_sum_backward)


@torch.library.custom_op("autosp_testbed::all_reduce_sum_sum_grad", mutates_args=())
def all_reduce_sum_sum_grad(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum over the group whose gradient is summed over the group too (see Note [Gradient placements] in
    autosp/passes/dynamo/reductions.py): for a reduction read by token-sharded computations."""
    return all_reduce_sum(x, group_name)


all_reduce_sum_sum_grad.register_fake(_all_reduce_fake)


def _all_reduce_sum_sum_grad_backward(ctx, grad):
    return all_reduce_sum(grad, ctx.group_name), None


def _all_reduce_sum_sum_grad_setup_context(ctx, inputs, output):
    ctx.group_name = inputs[1]


all_reduce_sum_sum_grad.register_autograd(
    _all_reduce_sum_sum_grad_backward, setup_context=_all_reduce_sum_sum_grad_setup_context)


@torch.library.custom_op("autosp_testbed::all_reduce_max", mutates_args=())
def all_reduce_max(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Elementwise maximum over the group, for values outside autograd (the shift of a log-sum-exp)."""
    return _all_reduce(x, group_name, dist.ReduceOp.MAX)


all_reduce_max.register_fake(_all_reduce_fake)


# Note [All-to-all as start and wait]
# The overlap pass (autosp.passes.partitioned.overlap) runs on the partitioned forward and
# backward graphs, which are not differentiated again, so these two ops need no
# autograd formula.  ``all_to_all_start`` lays out the send buffer and issues
# torch's functional all_to_all_single, which returns the receive buffer at once
# while the collective proceeds in the background; torch's c10d layer ties the
# in-flight work to that buffer, and ``_c10d_functional.wait_tensor`` in
# ``all_to_all_wait`` blocks on it.  Between the two the buffer is touched by
# nothing else.  The result equals ``all_to_all`` exactly: same chunks, same order.


@torch.library.custom_op("autosp_testbed::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, group_name: str, group_size: int) -> torch.Tensor:
    if x.is_floating_point():
        raise TypeError("autosp_testbed::all_gather carries integer metadata only (it has no gradient)")
    parts = [torch.empty_like(x) for _ in range(group_size)]
    dist.all_gather(parts, x.contiguous(), group=_resolve_process_group(group_name))
    return torch.cat(parts, dim=dim)


@all_gather.register_fake
def _(x, dim, group_name, group_size):
    shape = list(x.shape)
    shape[dim] *= group_size
    return x.new_empty(shape)


@torch.library.custom_op("autosp_testbed::all_to_all_start", mutates_args=())
def all_to_all_start(x: torch.Tensor, scatter_dim: int, group_name: str, group_size: int) -> torch.Tensor:
    send = _send_layout(x, scatter_dim, group_size)
    splits = [1] * group_size
    return torch.ops._c10d_functional.all_to_all_single(send, splits, splits, group_name)


@all_to_all_start.register_fake
def _(x, scatter_dim, group_name, group_size):
    if x.shape[scatter_dim] % group_size:
        raise ValueError(
            f"all_to_all_start: dim {scatter_dim} of size {x.shape[scatter_dim]} is not divisible by the group "
            f"size {group_size}"
        )
    chunk = list(x.shape)
    chunk[scatter_dim] //= group_size
    return x.new_empty([group_size, *chunk])


@torch.library.custom_op("autosp_testbed::all_to_all_wait", mutates_args=())
def all_to_all_wait(in_flight: torch.Tensor, gather_dim: int) -> torch.Tensor:
    recv = torch.ops._c10d_functional.wait_tensor(in_flight)
    return _receive_layout(recv, gather_dim)


@all_to_all_wait.register_fake
def _(in_flight, gather_dim):
    shape = list(in_flight.shape[1:])
    shape[gather_dim] *= in_flight.shape[0]
    return in_flight.new_empty(shape)


# Note [Activation offload ops]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Three ops that the activation offload pass (Note [Activation offload] in
# autosp/passes/partitioned/offload.py) inserts into the partitioned forward and backward graphs, which are not
# differentiated again, so they have fake impls and no autograd formula (like all_to_all_start/wait).
#
# - ``offload_to_host(x)``: a copy of x in host memory, placed after x's last forward use; the forward returns it
#   as the saved tensor instead of x, so x dies in forward.  CUDA: a pinned CPU tensor written by a non_blocking
#   copy on the device's side stream (`_side_stream`), which first waits for the current stream;
#   ``x.record_stream(side)`` keeps x's memory from the allocator until the copy is done.  CPU: ``x.clone()``;
#   host and device are the same memory there, so the memory tracker (experiments/cpu/peak_memory.py) counts this
#   op's outputs in its host pool.
# - ``reload_from_host(h, device)``: starts the copy of h to ``device`` and returns the device tensor, whose contents
#   are valid only after ``reload_wait``.  CUDA: the tensor is allocated on the current stream, then copied
#   non_blocking on the same side stream (after the offload copy of h, and after the current stream's work so far:
#   the allocation may reuse memory the current stream just freed).  CPU: a copy.  Placed ahead of the first
#   backward use (the prefetch point is the pass's choice).
# - ``reload_wait(x)``: returns nothing and declares that it mutates x, so every later reader of x is ordered after
#   it, by fx and by Inductor's scheduler alike.  CUDA: the current stream waits for the side stream (all its copies
#   issued so far, this one among them).  CPU: nothing.  Placed right before x's first backward reader.
#
# The side stream is one per device, made on first use and kept (`_side_stream` is a cache of a device resource,
# not state that changes results).  The CUDA halves are written but untried on a GPU (docs/design.md, "Stage 3:
# the partitioned graphs").


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    """The stream the offload copies of one CUDA device run on (one per device, so reloads order after offloads)."""
    return torch.cuda.Stream(device=device_index)


@torch.library.custom_op("autosp_testbed::offload_to_host", mutates_args=())
def offload_to_host(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cuda":
        return x.clone()
    side = _side_stream(x.device.index)
    host = torch.empty_like(x, device="cpu", pin_memory=True)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
    x.record_stream(side)
    return host


@offload_to_host.register_fake
def _(x):
    return torch.empty_like(x, device="cpu")  # the strides of x, like clone


@torch.library.custom_op("autosp_testbed::reload_from_host", mutates_args=())
def reload_from_host(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return h.to(device, copy=True)
    side = _side_stream(device.index if device.index is not None else torch.cuda.current_device())
    current = torch.cuda.current_stream(device)
    out = torch.empty_like(h, device=device)  # allocated on the current stream, read there
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out.copy_(h, non_blocking=True)
    return out


@reload_from_host.register_fake
def _(h, device):
    return torch.empty_like(h, device=device)


@torch.library.custom_op("autosp_testbed::reload_wait", mutates_args=("x",))
def reload_wait(x: torch.Tensor) -> None:
    if x.device.type == "cuda":
        torch.cuda.current_stream(x.device).wait_stream(_side_stream(x.device.index))


@reload_wait.register_fake
def _(x):
    return None
