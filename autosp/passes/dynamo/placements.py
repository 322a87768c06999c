"""The values of the sequence-sharding analysis and the shape arithmetic that moves them.

See Note [Sequence-sharding analysis] in `autosp.passes.dynamo.sharding` for how
they are used.  Everything here is plain data and pure functions of shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import fx


@dataclass(frozen=True)
class Replicate:
    """Every rank of the SP group holds the same, whole value (parameters, constants, the loss)."""

    def __str__(self) -> str:
        return "replicated"


@dataclass(frozen=True)
class Shard:
    """Token-sharded: this rank holds its contiguous slice of the tokens along one dimension.

    ``dim`` is the dimension that indexes tokens.  When the token axis was merged
    with others by a reshape (``[B, S, H] -> [B*S, H]``) the tokens run through
    ``dim`` with stride ``inner`` (the product of the merged sizes to their right).
    ``positions`` is non-empty for a tentative shard: a value built from
    ``arange(local_seq_len)`` that is token-indexed only if it ever meets a
    token-sharded value along its token axis (see Note [Positions built in the graph]).
    """

    dim: int
    inner: int = 1
    positions: frozenset = field(default=frozenset(), compare=False)

    @property
    def tentative(self) -> bool:
        return bool(self.positions)

    def moved(self, dim: int, inner: int | None = None) -> Shard:
        return Shard(dim, self.inner if inner is None else inner, self.positions)

    def __str__(self) -> str:
        kind = "positions" if self.tentative else "token-sharded"
        return f"{kind}(dim {self.dim}{'' if self.inner == 1 else f', stride {self.inner}'})"


@dataclass(frozen=True)
class Partial:
    """Each rank holds a partial sum; the value is the sum over the SP group (a reduction before its all-reduce)."""

    def __str__(self) -> str:
        return "partial-sum"


Placement = Replicate | Shard | Partial
REPLICATE = Replicate()
PARTIAL = Partial()


def is_shard(p: object) -> bool:
    return isinstance(p, Shard)


def real_shard(p: object) -> bool:
    return isinstance(p, Shard) and not p.tentative


def _suffix_products(shape) -> list[int]:
    """suffix[i] = prod(shape[i:]); suffix[len] = 1."""
    out = [1] * (len(shape) + 1)
    for i in range(len(shape) - 1, -1, -1):
        out[i] = out[i + 1] * int(shape[i])
    return out


def reshaped(shard: Shard, in_shape, out_shape, seq_len: int) -> Shard | None:
    """Where the token axis lands when ``in_shape`` is reshaped (row-major) to ``out_shape``.

    The tokens occupy flat strides [s, s * seq_len) with s = inner * prod(in_shape[dim+1:]);
    they stay one axis only if some output dim holds that whole range.  None when a
    reshape splits the token axis across dims (it would reorder tokens within a shard).
    """
    in_suffix = _suffix_products(in_shape)
    flat_stride = shard.inner * in_suffix[shard.dim + 1]
    out_suffix = _suffix_products(out_shape)
    for d in range(len(out_shape)):
        if int(out_shape[d]) == 1 and seq_len > 1:
            continue
        lo, hi = out_suffix[d + 1], out_suffix[d]
        if lo <= flat_stride and flat_stride % lo == 0 and flat_stride * seq_len <= hi:
            return shard.moved(d, flat_stride // lo)
    return None


def broadcast_dim(dim: int, ndim: int, out_ndim: int) -> int:
    """Index in a broadcast result of dim ``dim`` of an operand with ``ndim`` dims (right-aligned)."""
    return dim + out_ndim - ndim


def normalize_dims(dims, ndim: int) -> tuple[int, ...]:
    """Reduction dims as sorted non-negative ints (None or () means every dim)."""
    if dims is None or dims == () or dims == []:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted(d % ndim if ndim else 0 for d in dims))


def token_extent(shard: Shard, shape, seq_len: int) -> int:
    """How many entries of dim ``shard.dim`` belong to one token stride (sanity: size == outer*seq*inner)."""
    size = int(shape[shard.dim])
    return size // max(1, seq_len * shard.inner)


def prod(values) -> int:
    return math.prod(int(v) for v in values)


def describe(node: fx.Node) -> str:
    """An op's name as a user would recognise it (torch.cumsum, Tensor.view, aten.mm ...)."""
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op == "call_module":
        return f"module {target}"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or str(target)
    if module.startswith("torch.nn.functional") or module == "torch._C._nn":
        return f"torch.nn.functional.{name}"
    if module.startswith("torch"):
        return f"torch.{name}"
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    return str(target)
