"""Learn the attention mask a model builds from its inputs (mask_learner.py), and apply it over the whole sequence.

Note [Attention masks built from the inputs]
Hugging Face models called with ``use_cache=False`` (what gradient checkpointing
forces), with packed position ids or with a padding ``attention_mask`` build an
attention mask under tracing and hand it to ``scaled_dot_product_attention`` as
``attn_mask``.  On a shard that mask is the shard's [L, L] block; after the
Ulysses all-to-all the attention needs the rule over the whole [S, S] sequence.
A mask is a function of the inputs it reads, so the pass learns which function:

1. the mask's subgraph must read only the position ids, the padding mask and
   constants (anything else, e.g. the tokens, is left to the attention rule,
   which refuses it), and its values must be a pure mask (booleans, or 0 and
   -inf / the dtype's minimum: a bias such as ALiBi is refused);
2. the subgraph is evaluated on *probe* inputs of the shard's shape, as if the
   shard were the block of tokens [o, o+L) for offsets o stepping by L-1 over the
   whole sequence, its in-graph ``arange`` shifted to o (Note [Mask probes at
   other offsets] in mask_probes.py; the packed and padded probes at o = 0 only,
   unless chunks were learnt): plain positions o..o+L-1 (the mask must be
   causal, possibly within a window, the most keys a row reads, and within chunks,
   which start where a token cannot read its predecessor: the first such index is
   the chunk size), positions one ahead of the index (are chunks counted by index
   or by position?), positions restarting and jumping mid-row (does the model
   separate documents where a position is not its predecessor's plus one?), and a
   padding mask with a left-padded and a middle token (are padding keys masked?).
   Each probe must equal the rule of Note [Document masks]
   (autosp.document_attention) with the learnt ingredients, row for row; a model
   whose mask is anything else (bidirectional, prefix-LM, documents or chunks split
   another way) is refused, naming the module;
3. a window at least as long as the shard is invisible to the probes: its length
   comes from the model's configuration (autosp.guards), and is refused when the
   configuration mixes sliding and full layers (which layers slide cannot be
   told apart on the shard);
4. the subgraph is evaluated once more on the traced call's real inputs, and must
   equal the learnt rule on every rank's block of the real sequence (so every rank
   decides alike);
5. the attention is rewritten: a rule that is the plain causal mask over the whole
   sequence becomes ``is_causal=True`` (Ulysses' SDPA), any other becomes
   `document_attention` over document ids computed in the graph from the
   all-gathered position ids and padding mask (a few integers per token, every
   step, so each batch is masked by its own layout).  In a checkpointed layer the
   mask operand of the higher-order op is replaced by the document ids.  A rule
   that separates documents by position only, traced on plain positions, is the
   causal mask as long as the positions stay plain: it becomes ``is_causal=True``
   too, checked on every call, and a packed batch goes to the model's document
   program (Note [Document program] in autosp/model.py).

The sequence-sharding analysis then runs `document_attention` through the
Ulysses rule like SDPA (autosp.passes.dynamo.attention).  Under strategy="ring"
and "hybrid" the all-gathered positions come in rank order, which the zig-zag
layout permutes: they are put back in sequence order before the ids are computed,
and the rule passes the ids to ring attention (Note [Ring attention] in
autosp/ring_attention.py), which takes documents by position only (padding,
chunks and windows are refused here).

A decision's traces share each learnt rule (Note [Mask rules shared between a decision's traces] in
mask_learner.py, which learns the rules: steps 1-4).
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from autosp.config import ZIGZAG_STRATEGIES
from autosp.context import TraceContext
from autosp.document_attention import document_attention, document_ids
from autosp.errors import AutoSPError, DocumentAttentionUnavailable
from autosp.inputs import gathered_in_sequence_order
from autosp.passes.dynamo.attention import SDPA_TARGETS, _sdpa_signature
from autosp.passes.dynamo.mask_learner import MaskLearner, MaskRule
from autosp.passes.dynamo.rules import higher_order_body
from autosp.passes.dynamo.tag_inputs import ROLE
from autosp.passes.graph_utils import bind, eliminate_dead_code, fake_value, infer_fake_value, module_name

log = logging.getLogger(__name__)


def _sdpa_nodes(gm: fx.GraphModule, hop: fx.Node | None = None):
    """(graph module, SDPA node, enclosing higher-order op node or None), bodies one level deep included."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            yield gm, node, hop
        body = higher_order_body(gm, node) if hop is None else None
        if body is not None:
            yield from _sdpa_nodes(body[0], node)


def _operand_index(gm_body: fx.GraphModule, hop: fx.Node, placeholder: fx.Node) -> int:
    """Index in ``hop.args`` of the operand a body placeholder receives."""
    placeholders = [n for n in gm_body.graph.nodes if n.op == "placeholder"]
    return len(hop.args) - len(placeholders) + placeholders.index(placeholder)


def _to_outer(gm_body: fx.GraphModule, hop: fx.Node | None, value):
    """The top-level node a body placeholder receives (the value itself in the top graph)."""
    if hop is None or not isinstance(value, fx.Node):
        return value
    if value.op != "placeholder":
        return None  # a mask computed inside the body: not recognised here
    return hop.args[_operand_index(gm_body, hop, value)]


class _DocumentIds:
    """The graph's document-id nodes (one per rule's inputs), inserted at the top level on first use."""

    def __init__(self, gm: fx.GraphModule, ctx: TraceContext):
        self.gm, self.ctx = gm, ctx
        self.nodes: dict[tuple, fx.Node] = {}

    def node(self, rule: MaskRule) -> fx.Node:
        key = (rule.by_position, rule.padding, rule.chunk, rule.chunk_by_position)
        if key not in self.nodes:
            self.nodes[key] = self._insert(*key)
        return self.nodes[key]

    def _insert(self, by_position: bool, padding: bool, chunk: int | None, chunk_by_position: bool) -> fx.Node:
        graph, ctx = self.gm.graph, self.ctx
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        by_role = {n.meta.get(ROLE): n for n in placeholders}
        gather = torch.ops.autosp_testbed.all_gather.default
        # Without a document rule the positions (or the tokens) only give the ids' shape.
        sources = [by_role.get("position_ids", by_role.get("input_ids"))] + ([by_role["attention_mask"]] if padding else [])
        first = next(n for n in graph.nodes if n.op != "placeholder")
        layout = ctx.layout
        with graph.inserting_before(first):  # inserted in order, after every placeholder
            gathered = [graph.call_function(gather, (source, 1, ctx.group_name, ctx.sp_size)) for source in sources]
            inserted = list(gathered)
            if layout is not None and ctx.strategy in ZIGZAG_STRATEGIES:  # rank order is not sequence order
                # (Note [Zig-zag layout]; a hybrid rank's piece can be one contiguous range all the same)
                gathered = [graph.call_function(gathered_in_sequence_order, (g, 1, layout.every_rank))
                            for g in gathered]
                inserted += gathered
            documents = graph.call_function(document_ids, (gathered[0], gathered[1] if padding else None),
                                            {"by_position": by_position, "padding": padding, "chunk": chunk,
                                             "chunk_by_position": chunk_by_position})
        for node in (*inserted, documents):
            infer_fake_value(node)
        return documents


def attention_mask_pass(gm: fx.GraphModule, example_inputs, *, ctx: TraceContext) -> fx.GraphModule:
    """Apply every attention mask the model builds from its inputs over the whole sequence (see the Note)."""
    learner, documents = MaskLearner(gm, ctx), _DocumentIds(gm, ctx)
    seq_len = ctx.layout.padded_seq_len if ctx.layout is not None else None
    changed = False
    sites = [(graph_module, node, hop, _to_outer(graph_module, hop, bind(_sdpa_signature, node).arguments["attn_mask"]))
             for graph_module, node, hop in _sdpa_nodes(gm)]  # before any rewrite moves an operand
    for graph_module, node, hop, outer in sites:
        call = bind(_sdpa_signature, node).arguments
        mask = call["attn_mask"]
        if not isinstance(outer, fx.Node) or call["dropout_p"]:
            continue  # the attention rule refuses these, naming the module
        where = module_name(node)
        rule = learner.rule(outer, where)
        if rule is None:
            continue
        changed = True
        if ctx.strategy in ZIGZAG_STRATEGIES and not (seq_len is None or rule.plain_causal(seq_len)):
            _check_ring_rule(rule, ctx, where)  # the ring applies the ids itself, under any code generator
        elif not ctx.documents_program and not (seq_len is None or rule.plain_causal(seq_len)):
            # Plain positions: causal SDPA, checked on every call; a batch this program cannot run goes to the
            # model's document program (Note [Document program] in autosp/model.py).
            rule = _without_document_attention(rule, ctx, where)
        if seq_len is None or rule.plain_causal(seq_len):
            call["attn_mask"], call["is_causal"] = None, True
            q, k, v = call.pop("query"), call.pop("key"), call.pop("value")
            grouped = None if call["enable_gqa"] else _unrepeated_kv(k, v)
            if grouped is not None:  # Note [Key and value heads repeated for a mask]
                (k, v), call["enable_gqa"] = grouped, True
            node.args, node.kwargs = (q, k, v), dict(call)
            ctx.report.causal_masks_replaced += 1
            log.info("attention in %s: the mask built from the inputs is causal; using is_causal=True", where)
            continue
        ids = documents.node(rule)
        if hop is not None:  # the body's mask operand now carries the document ids
            index = _operand_index(graph_module, hop, mask)
            hop.args = hop.args[:index] + (ids,) + hop.args[index + 1:]
            mask.meta.update({k: ids.meta[k] for k in ("example_value", "val") if k in ids.meta})
        start = ctx.layout.start
        with graph_module.graph.inserting_before(node):
            replaced = graph_module.graph.call_function(document_attention, (call["query"], call["key"], call["value"],
                                                                             ids if hop is None else mask), {
                "q_start": start, "kv_start": start, "window": rule.window, "scale": call["scale"],
                "enable_gqa": call["enable_gqa"]})
        replaced.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
        infer_fake_value(replaced)
        node.replace_all_uses_with(replaced)
        graph_module.graph.erase_node(node)
        ctx.report.document_masks.append(rule)
        log.info("attention in %s: mask %s applied over the whole sequence", where, rule)
    applied = {learner.kept.get(rule) for rule in ctx.report.document_masks}
    if len(applied) > 1:
        log.warning("attention masks keep different fractions of the scores (%s); the export prices them as causal",
                    sorted(applied, key=str))
    ctx.report.attention_kept_fraction = applied.pop() if len(applied) == 1 else None
    if changed:
        _drop_unused_operands(gm)
        eliminate_dead_code(gm.graph)
        for body in {higher_order_body(gm, n)[0] for n in gm.graph.nodes if higher_order_body(gm, n)}:
            body.recompile()
        gm.recompile()
    return gm


# Note [Key and value heads repeated for a mask]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Hugging Face lets SDPA group the query heads of grouped-query attention (``enable_gqa``) only when it passes no
# mask; with a mask (the one it builds from the position ids when no KV cache is passed) it repeats the key and
# value heads itself, ``x[:, :, None].expand(B, Hkv, n, S, D).reshape(B, Hkv * n, S, D)``, so that the
# all-to-alls move, and backward keeps, H heads of keys and values instead of Hkv.  Where the mask becomes the
# causal mask, the attention reads the unrepeated heads with ``enable_gqa=True`` instead: query head i reads key
# and value head i // n either way, so the result is the same, without the copies (the Ulysses rule then ships
# the Hkv heads as for a model that passed no mask, Note [GQA head replication] in
# autosp/passes/dynamo/attention.py).


def _unrepeated_kv(key, value) -> tuple[fx.Node, fx.Node] | None:
    """The key and value before Hugging Face's repeat of their heads (Note [Key and value heads repeated for a
    mask]), when both are repeated by the same factor; None otherwise."""
    sources = [_repeat_source(key), _repeat_source(value)]
    if None in sources:
        return None
    (key_source, key_repeat), (value_source, value_repeat) = sources
    return (key_source, value_source) if key_repeat == value_repeat else None


def _repeat_source(node) -> tuple[fx.Node, int] | None:
    """(x, n) when ``node`` is ``x[:, :, None].expand(B, Hkv, n, S, D).reshape(B, Hkv * n, S, D)``, checked on the
    traced shapes; None otherwise."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "reshape"):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"
            and len(expand.users) == 1):
        return None
    index = expand.args[0]
    if not (isinstance(index, fx.Node) and index.op == "call_function" and index.target is operator.getitem
            and len(index.users) == 1):
        return None
    source, key = index.args
    whole = slice(None, None, None)
    if not isinstance(source, fx.Node) or key != (whole, whole, None, whole, whole):
        return None
    shapes = [fake_value(n) for n in (source, expand, node)]
    if not all(isinstance(t, torch.Tensor) for t in shapes):
        return None
    x, expanded, out = (tuple(t.shape) for t in shapes)
    if len(x) != 4 or len(expanded) != 5 or expanded[:2] != x[:2] or expanded[3:] != x[2:]:
        return None
    n = expanded[2]
    if out != (x[0], x[1] * n, x[2], x[3]):
        return None
    return source, n


def _check_ring_rule(rule: MaskRule, ctx: TraceContext, where: str) -> None:
    """strategy="ring" and "hybrid" apply packed documents (Note [Ring attention] in autosp/ring_attention.py);
    padding masks, chunks and sliding windows are refused.  (The padding AutoSP adds at the end of the sequence
    needs no mask: no earlier query reads it, under causal attention.)"""
    if rule.by_position and not rule.padding and rule.window is None and rule.chunk is None:
        return
    what = [name for name, present in (("a padding mask", rule.padding), ("a sliding window", rule.window),
                                       ("chunks", rule.chunk)) if present] or ["a mask other than packed documents"]
    raise AutoSPError(f"module {where} attends with {' and '.join(what)} ({rule}), which strategy={ctx.strategy!r} "
                      "does not apply (it applies causal attention within packed documents only): use "
                      "strategy='ulysses'" + (", or pass no attention_mask (padding added by AutoSP at the end "
                                              "of the sequence needs none)" if rule.padding else ""))


def _without_document_attention(rule: MaskRule, ctx: TraceContext, where: str) -> MaskRule:
    """In a model's own program (not its document program, Note [Document program] in autosp/model.py): a rule that
    only separates documents by position is the causal mask while the positions are 0..S-1 in every row, which the
    program then checks on every call (autosp.guards.ProgramGuard).  Any other rule is kept where the code
    generator compiles `document_attention` (aot_eager) and raises `DocumentAttentionUnavailable` where it does not
    (Inductor), so that the compiled model runs the batch through its document program."""
    plain = ctx.positions_plain
    if rule.by_position and not rule.padding and rule.window is None and rule.chunk is None and plain:
        ctx.report.requires_plain_positions = True
        return MaskRule(by_position=False, padding=False, window=None)
    if ctx.document_attention_compiles:
        return rule
    raise DocumentAttentionUnavailable(f"module {where} attends with a mask over packed documents, chunks, padding "
                                       f"or a sliding window ({rule}); AutoSP applies it with flex_attention, which "
                                       "Inductor does not compile yet")


def _drop_unused_operands(gm: fx.GraphModule) -> None:
    """Remove body inputs nothing reads any more (the replaced masks), from the body and its call."""
    for node in list(gm.graph.nodes):
        body = higher_order_body(gm, node)
        if body is None:
            continue
        sub, operands = body
        eliminate_dead_code(sub.graph)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        first = len(node.args) - len(operands)
        keep = [i for i, ph in enumerate(placeholders) if ph.users]
        if len(keep) == len(placeholders):
            continue
        for i, ph in enumerate(placeholders):
            if i not in keep:
                sub.graph.erase_node(ph)
        node.args = tuple(node.args[:first]) + tuple(operands[i] for i in keep)
        sub.recompile()
