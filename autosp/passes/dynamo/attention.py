"""Wrap every attention in Ulysses all-to-alls, make it ring attention (strategy="ring", `_ring_attention`), or
both (strategy="hybrid", Note [Hybrid attention]).

Before the pass, each rank's ``scaled_dot_product_attention`` sees its own slice
of the sequence and all heads: q [B, H, S/P, D], k and v [B, Hkv, S/P, D].  The
pass sends q, k and v through an all-to-all that scatters heads and gathers the
sequence, so attention runs on the full sequence for H/P heads, and a second
all-to-all brings the output back to [B, H, S/P, D].  The attention's own flags
(``is_causal``, ``scale``, ``enable_gqa``) are kept.  `document_attention` (what
the mask pass makes of a packed-document, padding or sliding-window mask, Note
[Attention masks built from the inputs]) is wrapped the same way, its queries and
keys then covering the whole sequence from token 0.

Note [GQA head replication]
With grouped-query attention each query head i uses kv head i // G (G = H / Hkv).
Rank r receives query heads [r·H/P, (r+1)·H/P).  When P divides Hkv, rank r
receives exactly kv heads [r·Hkv/P, (r+1)·Hkv/P), which are the ones its query
heads use, so nothing extra is shipped.  Otherwise each kv head is replicated f
times (``repeat_interleave`` on the head dim, f = P / gcd(Hkv, P), or G when f
does not divide G) before the all-to-all; expanded head j stands for original
head j // f and the local GQA group size becomes G / f, which maps every local
query head to the copy of its own kv head: (i // (G/f)) // f = i // G.

Note [Hybrid attention]
Under strategy="hybrid" the SP group of P ranks is cut into Ulysses groups of U consecutive ranks and ring groups
of the ranks U apart (autosp/groups.py; R = P / U groups in a ring).  The tokens follow the ring's zig-zag over
the R Ulysses groups (Note [Zig-zag layout] in autosp/inputs.py): group j holds chunks j and 2R-1-j of 2R, split
into U consecutive pieces over its ranks.  The attention is the Ulysses rewrite above with P replaced by U (heads
divisible by U; kv heads replicated only where U does not divide them, by the same rule) and the all-to-alls on
the Ulysses group, so that after the first all-to-all each rank holds its group's two chunks whole, for H/U
heads (and their kv heads); in place of the attention call runs ``autosp_testbed::ring_attention`` over the ring
group with the zig-zag layout of R ranks (Note [Ring attention] in autosp/ring_attention.py: fused per-chunk
attention, log-sum-exp merged online in fp32, kv heads expanded only inside the kernel calls); the second
all-to-all brings the output back to the rank's own tokens, all heads.  U = P is Ulysses over a ring of one, U = 1
the ring.  Packed documents (`document_attention`) reach the ring op as the whole sequence's document ids, as
under the ring; what the ring refuses (padding masks, sliding windows) the hybrid refuses too.

This is the sequence-sharding analysis's rule for attention (see Note
[Sequence-sharding analysis] in autosp.passes.dynamo.sharding).  A model that
computes attention with matmul + softmax instead of SDPA contracts the token
axis in a matmul, which the analysis refuses, naming the module.
"""

from __future__ import annotations

import logging
import math
import operator

import torch
import torch.nn.functional as F
from torch import fx

from autosp.context import AttentionSite, TraceContext
from autosp.document_attention import document_attention
from autosp.errors import AutoSPError
from autosp.inputs import zigzag_ranges
from autosp.passes.dynamo.placements import REPLICATE, Partial, Shard
from autosp.passes.dynamo.registry import rule
from autosp.passes.graph_utils import bind, infer_fake_value, module_name, shape_of
from autosp.ring_attention import default_scale

log = logging.getLogger(__name__)

SDPA_TARGETS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
ATTENTION_TARGETS = (*SDPA_TARGETS, document_attention)
"""Attention calls the Ulysses rule wraps: SDPA, and the mask pass's document-masked attention."""

HEAD_DIM, SEQ_DIM = 1, 2
"""SDPA tensors are [B, heads, sequence, head_dim]."""


def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Python mirror of F.scaled_dot_product_attention's signature (the builtin has none to inspect)."""


def kv_replication_factor(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many copies of each kv head to make so every rank gets whole GQA groups.  See Note [GQA head replication]."""
    if num_kv_heads % sp_size == 0:
        return 1
    group = num_heads // num_kv_heads
    factor = sp_size // math.gcd(num_kv_heads, sp_size)
    return factor if group % factor == 0 else group


@rule("attention (Ulysses, ring or hybrid)", targets=ATTENTION_TARGETS)
def ulysses_attention(an, gm: fx.GraphModule, node: fx.Node):
    """The analysis's rule for scaled_dot_product_attention (in the top graph or a nested body).

    Token-sharded q, k, v ([B, H, S/P, D], tokens on dim 2) are wrapped in all-to-alls, under
    strategy="ring" replaced by ring attention (`_ring_attention`), under strategy="hybrid" wrapped in
    all-to-alls over the Ulysses group around ring attention over the ring group (Note [Hybrid attention]);
    replicated ones (attention over something other than the tokens) stay as they are.
    """
    ctx: TraceContext = an.ctx
    graph, p = gm.graph, ctx.sp_size
    where = module_name(node)
    documents = node.target is document_attention
    args = bind(document_attention if documents else _sdpa_signature, node).arguments
    places = [an.of(args[k]) for k in ("query", "key", "value")]
    if not any(isinstance(q, (Shard, Partial)) for q in places):
        return REPLICATE
    if not all(isinstance(q, Shard) and not q.tentative and (q.dim, q.inner) == (SEQ_DIM, 1) for q in places):
        raise AutoSPError(
            f"module {where} calls scaled_dot_product_attention with q/k/v placed {[str(q) for q in places]}; "
            "AutoSP needs [batch, heads, sequence, head_dim] tensors with every rank holding its slice of the "
            "sequence in q, k and v"
        )
    if args.get("dropout_p"):
        raise AutoSPError(
            f"module {where} applies attention dropout (dropout_p={args['dropout_p']}): every rank of the SP group "
            "draws the same random stream, so masks would repeat across head shards; set the attention dropout "
            "to 0 (e.g. Hugging Face attention_dropout=0.0) or call model.eval()"
        )
    if args.get("attn_mask") is not None:
        raise AutoSPError(
            f"module {where} passes an attn_mask to scaled_dot_product_attention that AutoSP cannot apply over the "
            "whole sequence: it supports causal or unmasked attention and masks built from the position ids and "
            "the padding mask alone (packed documents, padding, sliding windows: Note [Attention masks built from "
            "the inputs]); a mask computed from anything else (the tokens, a buffer) is not supported"
        )
    if documents and an.of(args["documents"]) != REPLICATE:
        raise AutoSPError(f"module {where}: the document ids of its attention are {an.of(args['documents'])}, "
                          "not the whole sequence's; this is a bug in AutoSP's mask pass")
    layout = ctx.sp_layout  # the kind's traits, degrees and heads rule (simulator.workload.SPLayout)
    if layout.zigzag:
        _check_zigzag(ctx, where, args, documents)
    if not layout.kind.all_to_all:  # the ring alone
        return _ring_attention(an, gm, node, args, documents)
    q_shape, k_shape = shape_of(args["query"]), shape_of(args["key"])
    heads, kv_heads = q_shape[HEAD_DIM], k_shape[HEAD_DIM]
    why = layout.heads_rule(heads)
    if why is not None:
        raise AutoSPError(f"module {where} has {why}")
    hybrid = layout.kind.grouped
    group_name, p = (ctx.ulysses_group_name if hybrid else ctx.group_name), layout.ulysses_size
    causal = documents or bool(args["is_causal"])
    if not causal:  # checked again on every call of the program: autosp.context.TraceContext.require_unpadded
        ctx.require_unpadded(f"module {where} uses non-causal attention (padding is exact only under causal "
                             "attention)")
    replicate = kv_replication_factor(heads, kv_heads, p) if kv_heads != heads else 1
    a2a = torch.ops.autosp_testbed.all_to_all.default
    token_sharded = Shard(SEQ_DIM)
    with graph.inserting_before(node):
        key, value = args["key"], args["value"]
        if replicate > 1:
            key = graph.call_method("repeat_interleave", (key, replicate), {"dim": HEAD_DIM})
            value = graph.call_method("repeat_interleave", (value, replicate), {"dim": HEAD_DIM})
            for expanded in (key, value):
                infer_fake_value(expanded)
                an.set(expanded, token_sharded)
        gathered = {}
        for name, tensor in (("query", args["query"]), ("key", key), ("value", value)):
            if tensor not in gathered:
                gathered[tensor] = graph.call_function(a2a, (tensor, HEAD_DIM, SEQ_DIM, group_name, p))
                infer_fake_value(gathered[tensor])
                an.set(gathered[tensor], Shard(HEAD_DIM))  # head-sharded, whole sequence (the hybrid: the group's)
            args[name] = gathered[tensor]
        args["enable_gqa"] = kv_heads * replicate != heads
        qkv = (args.pop("query"), args.pop("key"), args.pop("value"))
        if hybrid:  # the ring across the Ulysses groups, on the heads this rank now holds
            attention = _insert_ring(an, node, qkv, args, causal, ctx.ring_group_name, layout.ring_size,
                                     Shard(HEAD_DIM), args.pop("documents") if documents else None)
        else:
            if documents:  # whole sequences now: queries and keys both start at token 0
                args["q_start"] = args["kv_start"] = 0
                qkv = (*qkv, args.pop("documents"))
            attention = graph.call_function(node.target, qkv, dict(args))
            _keep_meta(attention, node)
            infer_fake_value(attention)
            an.set(attention, Shard(HEAD_DIM))
        out = graph.call_function(a2a, (attention, SEQ_DIM, HEAD_DIM, group_name, p))
        infer_fake_value(out)
        _keep_meta(out, node)
    an.set(out, token_sharded)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    an.result.attention.append(out)
    ctx.report.attention_sites.append(AttentionSite(where, heads, kv_heads, replicate, causal))
    log.debug("all-to-all%s around %s (heads %d, kv heads %d x%d)", " and ring" if hybrid else "", where, heads,
              kv_heads, replicate)
    return token_sharded


def _keep_meta(new: fx.Node, node: fx.Node) -> None:
    new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})


def _check_zigzag(ctx: TraceContext, where: str, args: dict, documents: bool) -> None:
    """What the ring and the hybrid refuse, and the layout they assume (Note [Zig-zag layout]).  Of the masks
    `document_attention` applies they take packed documents only (the mask pass refuses the others)."""
    if documents and args["window"] is not None:
        raise AutoSPError(f"module {where} attends within a sliding window of {args['window']} tokens, which "
                          f"strategy={ctx.strategy!r} does not apply: use strategy='ulysses'")
    layout = ctx.layout
    if layout is not None and ctx.sp_size > 1 and layout.ranges != zigzag_ranges(
            layout.padded_seq_len, ctx.sp_size, ctx.sp_rank, ctx.ulysses_size):
        raise AutoSPError(f"module {where}: strategy={ctx.strategy!r} needs the zig-zag layout; this is a bug in AutoSP")
    heads, kv_heads = shape_of(args["query"])[HEAD_DIM], shape_of(args["key"])[HEAD_DIM]
    if kv_heads != heads and (not args["enable_gqa"] or heads % kv_heads):
        raise AutoSPError(f"module {where} calls scaled_dot_product_attention with {heads} query heads and {kv_heads} "
                          "key/value heads without enable_gqa; expand the key/value heads or pass enable_gqa=True")


def _insert_ring(an, node: fx.Node, qkv: tuple, args: dict, causal: bool, group_name: str, size: int,
                 placement, documents: fx.Node | None = None) -> fx.Node:
    """``autosp_testbed::ring_attention`` of ``qkv`` over the ``size`` ranks of ``group_name`` (zig-zag layout),
    inserted where the graph's insertion point is; returns its output node, placed ``placement``.  ``documents``:
    the whole sequence's document ids in sequence order (replicated: the mask pass gathers them), for causal
    attention within documents."""
    graph = node.graph
    scale = args["scale"] if args["scale"] is not None else default_scale(shape_of(qkv[0])[-1])
    ring = graph.call_function(torch.ops.autosp_testbed.ring_attention.default,
                               (*qkv, float(scale), causal or documents is not None, "zigzag", group_name, size),
                               {} if documents is None else {"documents": documents})
    infer_fake_value(ring)
    out = graph.call_function(operator.getitem, (ring, 0))
    infer_fake_value(out)
    for new in (ring, out):
        _keep_meta(new, node)
    an.set(ring, (placement, placement))
    an.set(out, placement)
    return out


def _ring_attention(an, gm: fx.GraphModule, node: fx.Node, args: dict, documents: bool):
    """strategy="ring": the attention becomes ``autosp_testbed::ring_attention`` over the zig-zag shards
    (Note [Ring attention] in autosp/ring_attention.py); q, k and v keep every head and stay token-sharded, the
    output is this rank's tokens like the input.  Key/value heads are not replicated under GQA.  Document-masked
    attention (``documents``) passes the whole sequence's document ids to the ring."""
    ctx: TraceContext = an.ctx
    graph, p, where = gm.graph, ctx.sp_size, module_name(node)
    q_shape, k_shape = shape_of(args["query"]), shape_of(args["key"])
    heads, kv_heads = q_shape[HEAD_DIM], k_shape[HEAD_DIM]
    causal = documents or bool(args["is_causal"])
    if not causal:  # checked again on every call of the program: autosp.context.TraceContext.require_unpadded
        ctx.require_unpadded(f"module {where} uses non-causal attention (padding is exact only under causal "
                             "attention)")
    token_sharded = Shard(SEQ_DIM)
    with graph.inserting_before(node):
        out = _insert_ring(an, node, (args["query"], args["key"], args["value"]), args, causal, ctx.group_name, p,
                           token_sharded, args["documents"] if documents else None)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    an.result.attention.append(out)
    ctx.report.attention_sites.append(AttentionSite(where, heads, kv_heads, 1, causal))
    log.debug("ring attention in %s (heads %d, kv heads %d, %d ranks)", where, heads, kv_heads, p)
    return token_sharded
