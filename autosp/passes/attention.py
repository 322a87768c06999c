"""Wrap every attention in Ulysses all-to-alls.

Before the pass, each rank's ``scaled_dot_product_attention`` sees its own slice
of the sequence and all heads: q [B, H, S/P, D], k and v [B, Hkv, S/P, D].  The
pass sends q, k and v through an all-to-all that scatters heads and gathers the
sequence, so attention runs on the full sequence for H/P heads, and a second
all-to-all brings the output back to [B, H, S/P, D].  The attention's own flags
(``is_causal``, ``scale``, ``dropout_p``, ``enable_gqa``) are kept.

Note [GQA head replication]
With grouped-query attention each query head i uses kv head i // G (G = H / Hkv).
Rank r receives query heads [r·H/P, (r+1)·H/P).  When P divides Hkv, rank r
receives exactly kv heads [r·Hkv/P, (r+1)·Hkv/P), which are the ones its query
heads use, so nothing extra is shipped.  Otherwise each kv head is replicated f
times (``repeat_interleave`` on the head dim, f = P / gcd(Hkv, P), or G when f
does not divide G) before the all-to-all; expanded head j stands for original
head j // f and the local GQA group size becomes G / f, which maps every local
query head to the copy of its own kv head: (i // (G/f)) // f = i // G.

A model that computes attention with matmul + softmax instead of SDPA would
attend only within each rank's shard; it is refused with an error naming the
module.
"""

from __future__ import annotations

import logging
import math
import operator

import torch
import torch.nn.functional as F
from torch import fx

from autosp.context import AttentionSite, TraceContext
from autosp.errors import AutoSPError
from autosp.passes.graph_utils import bind, module_name, shape_of

log = logging.getLogger(__name__)

SDPA_TARGETS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
_SOFTMAX_TARGETS = (torch.softmax, F.softmax, torch.nn.functional.log_softmax)
_MATMUL_TARGETS = (torch.matmul, operator.matmul, torch.bmm, torch.einsum, torch.baddbmm)

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


def _is_matmul(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _MATMUL_TARGETS:
        return True
    return node.op == "call_method" and node.target in ("matmul", "bmm", "__matmul__")


def _is_softmax(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _SOFTMAX_TARGETS:
        return True
    return node.op == "call_method" and node.target in ("softmax", "log_softmax")


def _activation_matmul_feeding(node: fx.Node, hops: int = 4) -> fx.Node | None:
    """A matmul of two non-parameter tensors within ``hops`` producers of ``node`` (scores = q @ k^T)."""
    frontier = [node]
    for _ in range(hops):
        nxt = []
        for n in frontier:
            for arg in n.all_input_nodes:
                if _is_matmul(arg):
                    operands = [a for a in arg.all_input_nodes if a.op != "get_attr"]
                    if len(operands) >= 2 and not any("parameters" in a.name for a in operands):
                        return arg
                nxt.append(arg)
        frontier = nxt
    return None


def check_no_eager_attention(gm: fx.GraphModule) -> None:
    """Refuse attention computed as softmax(q @ k^T): sharding would make it attend within a shard only."""
    for node in gm.graph.nodes:
        if _is_softmax(node) and _activation_matmul_feeding(node) is not None:
            raise AutoSPError(
                f"module {module_name(node)} computes attention with matmul + softmax, which AutoSP cannot make "
                "sequence-parallel; call torch.nn.functional.scaled_dot_product_attention instead "
                "(Hugging Face: attn_implementation='sdpa')"
            )


def insert_all_to_all_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
    check_no_eager_attention(gm)
    graph, p = gm.graph, ctx.sp_size
    sites = [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    if not sites:
        raise AutoSPError(
            "no torch.nn.functional.scaled_dot_product_attention call found in the model's graph; AutoSP "
            "needs the model's attention to use SDPA (Hugging Face: attn_implementation='sdpa')"
        )
    a2a = torch.ops.autosp_testbed.all_to_all.default
    for node in sites:
        where = module_name(node)
        args = bind(_sdpa_signature, node).arguments
        if args["attn_mask"] is not None:
            raise AutoSPError(
                f"module {where} passes an attn_mask to scaled_dot_product_attention; AutoSP supports causal "
                "(is_causal=True) or unmasked attention only.  Hugging Face models build such a mask from a padding "
                "attention_mask (autosp.prepare_inputs refuses one), from position_ids when use_cache=False "
                "(leave use_cache at its default), or for sliding-window attention (not supported)"
            )
        q_shape, k_shape = shape_of(args["query"]), shape_of(args["key"])
        if len(q_shape) != 4:
            raise AutoSPError(f"module {where}: attention inputs must be [batch, heads, seq, dim], got {q_shape}")
        heads, kv_heads = q_shape[HEAD_DIM], k_shape[HEAD_DIM]
        if heads % p:
            raise AutoSPError(
                f"module {where} has {heads} attention heads, not divisible by sp_size={p}; "
                "choose an sp_size that divides the number of heads"
            )
        if ctx.layout is not None and ctx.layout.pad_tokens and not args["is_causal"]:
            raise AutoSPError(
                f"module {where} uses non-causal attention and the sequence ({ctx.layout.seq_len} tokens) was "
                f"padded to a multiple of sp_size={p}; padding is exact only under causal attention: pass a "
                f"multiple of {p} tokens"
            )
        replicate = kv_replication_factor(heads, kv_heads, p) if kv_heads != heads else 1
        with graph.inserting_before(node):
            key, value = args["key"], args["value"]
            if replicate > 1:
                key = graph.call_method("repeat_interleave", (key, replicate), {"dim": HEAD_DIM})
                value = graph.call_method("repeat_interleave", (value, replicate), {"dim": HEAD_DIM})
            gathered = {}
            for name, tensor in (("query", args["query"]), ("key", key), ("value", value)):
                if tensor not in gathered:
                    gathered[tensor] = graph.call_function(a2a, (tensor, HEAD_DIM, SEQ_DIM, ctx.group_name, p))
                args[name] = gathered[tensor]
            args["enable_gqa"] = kv_heads * replicate != heads
            qkv = (args.pop("query"), args.pop("key"), args.pop("value"))
            attention = graph.call_function(node.target, qkv, dict(args))
            attention.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
            out = graph.call_function(a2a, (attention, SEQ_DIM, HEAD_DIM, ctx.group_name, p))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        ctx.report.attention_sites.append(
            AttentionSite(where, heads, kv_heads, replicate, bool(args["is_causal"]))
        )
        log.debug("all-to-all around %s (heads %d, kv heads %d x%d)", where, heads, kv_heads, replicate)
    return gm
