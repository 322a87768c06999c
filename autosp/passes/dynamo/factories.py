"""Op family: factories, metadata queries and AutoSP's own collectives.

See Note [Op rule registry] in autosp.passes.dynamo.registry.
"""

from __future__ import annotations

import torch
from torch import fx

from autosp.passes.dynamo.placements import REPLICATE, Partial, Shard
from autosp.passes.dynamo.pointwise import token_count_scale
from autosp.passes.dynamo.registry import FIX_GENERIC, arguments, op_name, rule, sharded_inputs
from autosp.passes.graph_utils import fake_value


@rule("metadata", "size", "dim", "numel", "is_floating_point", "is_contiguous", "get_device", "is_complex",
      "element_size", "stride", "_log_api_usage_once", "_set_grad_enabled", "is_grad_enabled",
      "is_autocast_enabled", "set_", "_assert", "_check")
def metadata(an, gm, node: fx.Node):
    return REPLICATE


_LIKE_RECEIVER = frozenset(("new_ones", "new_zeros", "new_empty", "new_full"))
"""``x.new_zeros(shape)`` and kin: a tensor made from ``x``'s properties (see `factory`)."""


@rule("factory (replicated)", "zeros", "ones", "empty", "full", "tensor", "as_tensor", "scalar_tensor", "eye",
      "linspace", "logspace", "rand", "randn", "randint", "tril", "triu", *_LIKE_RECEIVER, "new_tensor", "finfo",
      "iinfo", "get_default_dtype")
def factory(an, gm, node: fx.Node):
    """A made tensor is the same on every rank, but for one made like a token-sharded ``x`` with ``x``'s own token
    axis (``kv.new_empty(*kv.shape[:-1], d)``, a buffer the model then fills per token, as multi-head latent
    attention assembles its keys): that one is token-sharded as ``x`` is, as ``zeros_like(x)`` is.  Its entries
    are a constant or unwritten, the same in every row of the sequence, so each rank's rows are the single-device
    tensor's rows of its tokens."""
    bound = arguments(node)
    like = _like_receiver(an, node)
    if like is not None:
        return like
    for key in ("data", "fill_value", "s"):
        if token_count_scale(an, fake_value(bound.get(key))) is not None:
            raise an.refuse(node, f"makes a tensor from {bound[key].name}, this rank's token count read from a "
                            "shape (in the single-device program, the sequence's)",
                            "count the tokens with a reduction (e.g. torch.ones_like(x).sum())")
    for _, p in sharded_inputs(an, node):
        if isinstance(p, Shard) and not p.tentative and op_name(node) in ("tril", "triu"):
            raise an.refuse(node, "masks a token-sharded tensor by position within the shard", FIX_GENERIC)
    return REPLICATE


def _like_receiver(an, node: fx.Node):
    """The placement of ``x.new_*(shape)`` where ``x`` is token-sharded and ``shape`` keeps ``x``'s rank and its
    token axis's local length (None otherwise: replicated, as any made tensor)."""
    if op_name(node) not in _LIKE_RECEIVER or node.op != "call_method" or not node.args:
        return None
    receiver = node.args[0]
    p = an.of(receiver) if isinstance(receiver, fx.Node) else None
    made, like = fake_value(node), fake_value(receiver)
    if (not isinstance(p, Shard) or p.tentative or not isinstance(made, torch.Tensor)
            or not isinstance(like, torch.Tensor) or made.dim() != like.dim()
            or made.shape[p.dim] != like.shape[p.dim]):
        return None
    return p


def _autosp_op(name: str):
    return lambda node: (node.op == "call_function" and getattr(node.target, "namespace", None) == "autosp_testbed"
                         and name in node.target._opname)


@rule("collective", when=_autosp_op("all_reduce"))
def all_reduce(an, gm, node: fx.Node):
    """An all-reduce a rule inserted (the loss's, a reduction's): it completes a reduction over the sequence."""
    if not isinstance(an.of(node.args[0]), Partial):
        raise an.refuse(node, "all-reduces a value that is not a partial sum", "this is a bug in AutoSP's rules")
    if node not in an.sequence_reduced:
        an.sequence_reduced.add(node)
        if node.target == torch.ops.autosp_testbed.all_reduce_sum.default:
            an.result.sequence_reductions.append(node)
    return REPLICATE


@rule("collective (gather)", when=_autosp_op("all_gather"))
def gather(an, gm, node: fx.Node):
    """all_gather of token-sharded metadata (the mask pass's positions and padding mask): the whole sequence."""
    return REPLICATE


@rule("metadata", when=lambda node: (node.op == "call_function"
                                     and getattr(node.target, "namespace", None) == "autosp_testbed"))
def other_autosp_op(an, gm, node: fx.Node):
    return REPLICATE
