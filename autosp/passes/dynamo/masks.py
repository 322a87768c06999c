"""Learn the attention mask a model builds from its inputs, and apply it over the whole sequence.

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

Note [Mask rules shared between a decision's traces]
A planner decision traces the same model many times at one length (each
Dynamo-stage option set at two depths and an unrolling depth: twelve traces for
`python -m autosp.plan --memory-plan auto`), and every trace learns the same
mask from the same program: at 3.7M tokens on 8 ranks about 7 s of each trace.
Those traces are shape-only (no values in the batch's positions or padding mask,
so step 4 has nothing to check), and there the rule is a function of what the
pass reads: the mask program's code (its ops and every constant; a mask program
reads no parameter or buffer, `_mask_program`), its inputs' roles, shapes and
dtypes, the mask's shape, the layout, the SP degree, ``mask_probe_tokens`` and
the configured window (`_MaskLearner._program_key`).  With
``TraceContext.mask_rules`` (a dict the planner's `autosp.plan.traces.TraceReuse`
passes to each of its traces) a rule, or the refusal, learnt for one key is
taken by every later trace with the same key.  A trace with values (a compile of
a real job, or a trace with packed documents) never shares: step 4 runs on its
own batch.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from autosp.config import ZIGZAG_STRATEGIES
from autosp.context import TraceContext
from autosp.document_attention import document_attention, document_ids, kept_fraction
from autosp.errors import AutoSPError, DocumentAttentionUnavailable
from autosp.inputs import gathered_in_sequence_order, pad_end
from autosp.passes.dynamo.attention import SDPA_TARGETS, _sdpa_signature
from autosp.passes.dynamo.mask_probes import (
    SHARD_PROBE_BLOCKS,
    IndexFlow,
    NotResizable,
    ShiftedProgram,
    gap_indices,
    probe_length,
    probe_offsets,
    resized_program,
)
from autosp.passes.dynamo.rules import higher_order_body
from autosp.passes.dynamo.tag_inputs import ROLE
from autosp.passes.graph_utils import bind, fake_value, infer_fake_value, module_name

log = logging.getLogger(__name__)

MASK_INPUTS = ("position_ids", "attention_mask")
"""The inputs a mask may be computed from (step 1 of the Note)."""


@dataclass(frozen=True)
class MaskRule:
    """Which ingredients of Note [Document masks] a model's attention mask has."""

    by_position: bool
    """Documents start where a position is not its predecessor's plus one."""
    padding: bool
    """Keys whose attention_mask is 0 are read by no query."""
    window: int | None
    """Queries read the ``window`` most recent keys (themselves included); None: no window."""
    chunk: int | None = None
    """Queries read only keys of their own chunk of ``chunk`` tokens (chunked attention); None: no chunks."""
    chunk_by_position: bool = False
    """Chunks are counted by position (a chunk starts where a position is a multiple of ``chunk``), not by index."""

    def plain_causal(self, seq_len: int) -> bool:
        """True when, on ``seq_len`` tokens, the rule is the causal mask whatever the batch holds."""
        return (not self.by_position and not self.padding and (self.window is None or self.window >= seq_len)
                and self.chunk is None)

    def documents(self, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  first_index: int = 0) -> torch.Tensor:
        """Document ids of rows whose first token has index ``first_index`` (see `document_ids`)."""
        return document_ids(position_ids, attention_mask, by_position=self.by_position,
                            padding=self.padding and attention_mask is not None, chunk=self.chunk,
                            chunk_by_position=self.chunk_by_position, first_index=first_index)


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


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, stack, order = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        stack.extend(n.all_input_nodes)
    return order


def _mask_program(gm: fx.GraphModule, mask: fx.Node) -> tuple[fx.GraphModule, list[fx.Node]] | None:
    """The subgraph computing ``mask`` as a module, and the placeholders it reads (in order); None when it reads
    a parameter or buffer."""
    needed = set(_ancestors(mask))
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            env[node] = sub.placeholder(node.name)
            inputs.append(node)
        elif node.op == "get_attr":
            return None
        else:
            env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(env[mask])
    return fx.GraphModule(gm, sub), inputs


def _allowed(mask: torch.Tensor) -> torch.Tensor | None:
    """[B, L, L] booleans of a bool or additive mask (the same for every head); None for a bias or per-head mask."""
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        blocked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
        if not bool(((mask == 0) | blocked).all()):
            return None
        allowed = mask == 0
    while allowed.dim() < 4:  # SDPA broadcasts a mask from the right: [L, L] -> [1, 1, L, L]
        allowed = allowed[None]
    if allowed.dim() != 4 or allowed.shape[-1] != allowed.shape[-2] or (
            allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all())):
        return None
    return allowed[:, 0]  # [B or 1, L, L]


def expected_block(documents: torch.Tensor, start: int, length: int, window: int | None) -> torch.Tensor:
    """The rule of Note [Document masks] on tokens [start, start + length) of rows with ``documents``: [B, L, L]."""
    docs = documents[:, start:start + length]
    band = torch.ones(length, length, dtype=torch.bool).tril_()
    if window is not None:
        band.triu_(1 - window)
    return (docs.abs()[:, :, None] == docs[:, None, :]).logical_and_(band)


def _probe_inputs(batch: int, length: int, offset: int) -> dict[str, dict[str, torch.Tensor]]:
    """Probe (position_ids, attention_mask) pairs of step 2 of the Note, for the block of tokens starting at
    ``offset`` (positions shifted by it)."""
    plain = offset + torch.arange(length).expand(batch, length)
    ones = torch.ones(batch, length, dtype=torch.long)
    third = max(1, length // 3)
    packed = offset + torch.cat([torch.arange(third), torch.arange(third),
                                 third + 7 + torch.arange(length - 2 * third)]).expand(batch, length)
    padded = ones.clone()
    padded[:, 0] = 0
    padded[:, length // 2] = 0
    return {"plain": {"position_ids": plain, "attention_mask": ones},
            "ahead": {"position_ids": plain + 1, "attention_mask": ones},
            "packed": {"position_ids": packed, "attention_mask": ones},
            "padded": {"position_ids": plain, "attention_mask": padded},
            "packed+padded": {"position_ids": packed, "attention_mask": padded}}


_PROBE_NAMES = {"plain": "plain positions", "ahead": "positions one ahead of the index", "packed": "packed positions",
                "padded": "a padding mask (padded)", "packed+padded": "a padding mask (packed+padded)"}


def _border_rows(got: torch.Tensor, offset: int, length: int) -> tuple[int | None, int]:
    """What `_borders` reads of the plain-position probe at ``offset``: the first token index that cannot read its
    predecessor (None: every token can), and the most keys a row reads (in a causal mask within chunks and a window
    the widest rows are the last and those before a chunk border)."""
    found = (~got[0].diagonal(-1)).nonzero().flatten() + 1
    rows = torch.cat([found - 1, torch.tensor([length - 1])])
    return (offset + int(found[0]) if len(found) else None), int(got[0, rows].sum(-1).max())


def _borders(first_start: int | None, widest: int, length: int) -> tuple[int | None, int | None]:
    """(window, chunk) over the plain-position probes at every offset, from the first token that cannot read its
    predecessor and the widest row of any (`_border_rows`): a chunk starts at every token that cannot read its
    predecessor (the first such index is the chunk size), a window is the most keys any row reads, when fewer than
    a block's and a chunk's."""
    if widest <= 1:
        return 1, None
    return (widest if widest < min(length, first_start or length) else None), first_start


class _MaskLearner:
    """Steps 1-4 of Note [Attention masks built from the inputs] for one traced graph."""

    def __init__(self, gm: fx.GraphModule, ctx: TraceContext):
        self.gm, self.ctx = gm, ctx
        self.roles = {n: n.meta.get(ROLE) for n in gm.graph.nodes if n.op == "placeholder"}
        self.learnt: dict[fx.Node, MaskRule | None] = {}
        self.kept: dict[MaskRule, float] = {}
        """Fraction of the scores each rule keeps on the traced batch (see `kept_fraction`)."""

    def rule(self, mask: fx.Node, where: str) -> MaskRule | None:
        if mask not in self.learnt:
            with unset_fake_temporarily():  # probes are real tensors, also while a shape-only trace runs
                self.learnt[mask] = self._learn(mask, where)
        return self.learnt[mask]

    def _learn(self, mask: fx.Node, where: str) -> MaskRule | None:
        program = _mask_program(self.gm, mask)
        if program is None:
            return None
        module, inputs = program
        roles = [self.roles.get(n) for n in inputs]
        if any(r not in MASK_INPUTS for r in roles):
            return None
        examples = [fake_value(n) for n in inputs]
        shape = fake_value(mask).shape  # [B or 1, heads or 1, L, L]
        shared = self.ctx.mask_rules
        if shared is None or not self._shape_only():
            return self._learn_program(module, roles, examples, shape, where)
        key = self._program_key(module, roles, examples, shape, where)
        if key in shared:
            log.info("attention mask of %s: the rule an earlier trace learnt from the same program (Note [Mask rules "
                     "shared between a decision's traces])", where)
            rule, blocks = shared[key]
            if isinstance(rule, AutoSPError):
                raise rule
            self.ctx.report.mask_probe_blocks.append(blocks)
            return rule
        try:
            rule = self._learn_program(module, roles, examples, shape, where)
        except AutoSPError as err:
            shared[key] = (err, None)
            raise
        shared[key] = (rule, self.ctx.report.mask_probe_blocks[-1])
        return rule

    def _program_key(self, module: fx.GraphModule, roles: list[str], examples: list, shape, where: str) -> tuple:
        """What a learnt rule depends on in a shape-only trace (Note [Mask rules shared between a decision's
        traces]): the program's code (its ops and every constant: a mask program reads no parameter or buffer,
        `_mask_program`), its inputs' roles, shapes and dtypes, the mask's shape, the layout and the settings."""
        layout = self.ctx.layout
        return (where, module.code, tuple(roles), tuple((tuple(e.shape), e.dtype) for e in examples), tuple(shape),
                None if layout is None else (layout.seq_len, layout.padded_seq_len, layout.local_seq_len),
                self.ctx.sp_size, self.ctx.mask_probe_tokens, repr(self.ctx.sliding_window))

    def _learn_program(self, module: fx.GraphModule, roles: list[str], examples: list, shape, where: str
                       ) -> MaskRule:
        batch, length = (examples[0].shape[0] if examples else shape[0]), shape[-1]
        flow = IndexFlow(module, length, where)  # Note [Mask probes at other offsets]
        layout = self.ctx.layout
        seq_len = layout.padded_seq_len if layout is not None else length * self.ctx.sp_size
        resized, resized_flow, block = self._probed_program(module, flow, roles, examples, batch, length, where)
        if block < length:
            try:
                rule = self._learn_on(resized, resized_flow, where, roles, examples, batch, block, seq_len)
            except AutoSPError as err:  # e.g. a window longer than the block, built in the graph: seen on the shard
                self._check_shard_probes(where, length, batch, f"not learnt on blocks of {block} tokens: {err}")
                log.warning("attention mask of %s: not learnt on blocks of %d tokens (%s); probing the shard's %d "
                            "tokens", where, block, err, length)
            else:
                self.ctx.report.mask_probe_blocks.append((where, block, length))
                return rule
        rule = self._learn_on(module, flow, where, roles, examples, batch, length, seq_len)
        self.ctx.report.mask_probe_blocks.append((where, length, length))
        return rule

    def _learn_on(self, module: fx.GraphModule, flow: IndexFlow, where: str, roles: list, examples: list, batch: int,
                  block: int, seq_len: int) -> MaskRule:
        """Steps 2-4 of the Note on ``module`` (the traced mask program, or the program resized to ``block``
        tokens)."""

        program = ShiftedProgram(module, flow)

        def evaluate(values: dict[str, torch.Tensor], offset: int | torch.Tensor) -> torch.Tensor:
            args = [values[r].to(e.dtype) for r, e in zip(roles, examples, strict=True)]
            try:
                with torch.no_grad():
                    allowed = _allowed(program.run(args, offset))
            except Exception as err:  # noqa: BLE001 - a mask we cannot evaluate is refused below
                raise AutoSPError(f"module {where} attends with a mask built from {roles} that AutoSP could not "
                                  f"evaluate on probe inputs ({err}); {_FIX}") from err
            if allowed is None:
                raise AutoSPError(f"module {where} attends with an additive bias, or a mask that differs between heads, built from "
                                  f"{roles}, not a mask; {_FIX}")
            return allowed

        offsets = probe_offsets(block, seq_len)
        first: dict[str, torch.Tensor] = {}
        """Results at the first offset, which several rules are tried on (the others are evaluated as checked:
        at long context there are thousands of offsets, Note [Mask programs probed on shorter blocks])."""

        def check(name: str, rule: MaskRule) -> None:
            # Packed and padded probes at offset 0 alone unless the rule has chunks (which depend on the offset).
            for offset in offsets if name in ("plain", "ahead") or rule.chunk is not None else offsets[:1]:
                values = _probe_inputs(batch, block, offset)[name]
                if offset == offsets[0] and name not in first:
                    first[name] = evaluate(values, offset)
                got = first[name] if offset == offsets[0] else evaluate(values, offset)
                self._check(where, _PROBE_NAMES[name], got, rule, values, offset)

        rule = self._plain_rule(where, evaluate, batch, block, offsets)
        window = rule.window
        if "position_ids" in roles:
            if rule.chunk is not None:  # chunks counted by index or by position: positions one ahead tell
                rule = self._chunk_source(rule, where, check)
            if not self._matches(check, "packed", rule):
                rule = MaskRule(True, False, window, rule.chunk, rule.chunk_by_position)
            check("packed", rule)
        if "attention_mask" in roles:
            rule = MaskRule(rule.by_position, True, window, rule.chunk, rule.chunk_by_position)
            check("padded", rule)
            check("packed+padded", rule)
        if flow.token and not flow.indices and not rule.by_position:
            self._check_gaps(where, rule, evaluate, batch, block, seq_len)
        rule = self._configured_window(rule, where, block)
        self._check_real(where, rule, evaluate, block)
        return rule

    def _probed_program(self, module: fx.GraphModule, flow: IndexFlow, roles: list[str], examples: list, batch: int,
                        length: int, where: str) -> tuple[fx.GraphModule, IndexFlow, int]:
        """(program, flow, block length) the probes run: the traced program, or at long context the program
        resized to shorter blocks (Note [Mask programs probed on shorter blocks] in mask_probes.py)."""
        configured = self.ctx.sliding_window
        wanted = self.ctx.mask_probe_tokens
        if configured is not None and (self.ctx.layout is None or configured.window < self.ctx.layout.padded_seq_len):
            wanted = max(wanted, configured.window + 1)  # a window the configuration names shows on the probes
        if length <= wanted:
            return module, flow, length
        block = probe_length(length, wanted, module)
        plain = _probe_inputs(batch, block, 0)["plain"]
        try:
            resized, mapping = resized_program(module, length, block,
                                               [plain[r].to(e.dtype) for r, e in zip(roles, examples, strict=True)])
        except NotResizable as why:
            self._check_shard_probes(where, length, batch, f"its program cannot be resized: {why}")
            log.warning("attention mask of %s: probed on blocks of the shard's %d tokens, not %d (%s; Note [Mask "
                        "programs probed on shorter blocks]): %.1f GB of booleans a probe", where, length, block, why,
                        batch * length * length / 1e9)
            return module, flow, length
        log.info("attention mask of %s: probed on blocks of %d tokens (shards of %d)", where, block, length)
        return resized, flow.moved(mapping), block

    def _check_shard_probes(self, where: str, length: int, batch: int, why: str) -> None:
        """Refuse to learn a mask on a shard too long to probe (Note [Mask programs probed on shorter blocks])."""
        limit = SHARD_PROBE_BLOCKS * self.ctx.mask_probe_tokens
        if length > limit:
            raise AutoSPError(
                f"module {where} attends with a mask AutoSP would have to learn on blocks of the shard's {length} "
                f"tokens ({why}): {batch * length * length / 1e9:.1f} GB of booleans a probe, over the limit of "
                f"{limit} tokens ({SHARD_PROBE_BLOCKS} x mask_probe_tokens; Note [Mask programs probed on shorter "
                f"blocks]). Build the mask from arange(seq_len) or the position ids so that its sizes follow the "
                f"sequence, use more ranks (shorter shards), or pass mask_probe_tokens={length} to probe the shard "
                "anyway")

    def _plain_rule(self, where: str, evaluate, batch: int, block: int, offsets: list[int]) -> MaskRule:
        """The window and chunks of the plain-position probes at every offset (`_borders`), each probe checked
        against the rule: in one pass while the rule read so far stays the rule (it changes at the first chunk
        border and where a row is wider than any before), the probes checked against an earlier rule again."""
        first_start, widest, checked = None, 0, {}
        rule = None
        for offset in offsets:
            values = _probe_inputs(batch, block, offset)["plain"]
            got = evaluate(values, offset)
            start, wide = _border_rows(got, offset, block)
            first_start = start if first_start is None else first_start if start is None else min(first_start, start)
            widest = max(widest, wide)
            window, chunk = _borders(first_start, widest, block)
            rule = MaskRule(by_position=False, padding=False, window=window, chunk=chunk)
            checked[offset] = (rule, self._matches(self._check, where, _PROBE_NAMES["plain"], got, rule, values,
                                                   offset))
        for offset, (seen, passed) in checked.items():
            if seen != rule or not passed:  # raises for a probe that is not the final rule
                values = _probe_inputs(batch, block, offset)["plain"]
                self._check(where, _PROBE_NAMES["plain"], evaluate(values, offset), rule, values, offset)
        return rule

    @staticmethod
    def _check_gaps(where: str, rule: MaskRule, evaluate, batch: int, length: int, seq_len: int) -> None:
        """Pairs of tokens a shard or more apart (Note [Mask probes at other offsets]), on a plain row."""
        for index in gap_indices(length, seq_len):
            got = evaluate({"position_ids": index.expand(batch, length),
                            "attention_mask": torch.ones(batch, length, dtype=torch.long)}, index - torch.arange(length))
            q, k = index[:, None], index[None, :]
            expected = k <= q
            if rule.chunk is not None:
                expected &= q // rule.chunk == k // rule.chunk
            if rule.window is not None:
                expected &= q - k < rule.window
            if not torch.equal(got.expand(batch, length, length), expected.expand(batch, length, length)):
                head = max(1, length // 2)
                raise AutoSPError(
                    f"module {where} attends with a mask that, between tokens 0..{head - 1} and tokens "
                    f"{int(index[head])}..{int(index[-1])}, is not the rule its shard shows ({rule}): a window or "
                    f"chunk longer than a shard, built in the graph; give the model a config with its "
                    f"sliding_window, or use shards longer than the window (a smaller sp_size); {_FIX}")

    @staticmethod
    def _matches(check, *args) -> bool:
        try:
            check(*args)
        except AutoSPError:
            return False
        return True

    def _chunk_source(self, rule: MaskRule, where: str, check) -> MaskRule:
        for by_position in (False, True):
            candidate = MaskRule(rule.by_position, rule.padding, rule.window, rule.chunk, by_position)
            if self._matches(check, "ahead", candidate):
                return candidate
        raise AutoSPError(f"module {where} attends with chunks of {rule.chunk} tokens that start neither at "
                          f"multiples of {rule.chunk} of the token index nor of the position; {_FIX}")

    def _check(self, where: str, probe: str, got: torch.Tensor, rule: MaskRule, values: dict, offset: int) -> None:
        documents = rule.documents(values["position_ids"], values["attention_mask"], first_index=offset)
        expected = expected_block(documents, 0, got.shape[-1], rule.window)
        if not torch.equal(got.expand_as(expected), expected):
            raise AutoSPError(
                f"module {where} attends with a mask that, on {probe}, is not causal attention within documents "
                f"(a new document where a position is not its predecessor's plus one), chunks, padding and a "
                f"sliding window (probed as tokens {offset}..{offset + got.shape[-1] - 1}); {_FIX}")

    def _configured_window(self, rule: MaskRule, where: str, length: int) -> MaskRule:
        configured, layout = self.ctx.sliding_window, self.ctx.layout
        if rule.window is not None or configured is None or layout is None:
            return rule
        if configured.window < length or configured.window >= layout.padded_seq_len:
            return rule  # a window shorter than the shard would show: this layer has none; a long one never binds
        if not configured.every_layer:
            raise AutoSPError(
                f"module {where}: the model mixes sliding-window ({configured.window} tokens) and full attention "
                f"layers, and on a shard of {length} tokens the two masks look the same; use a smaller sp_size "
                f"(shards of more than {configured.window} tokens) or sequences of at most {configured.window} tokens")
        return MaskRule(rule.by_position, rule.padding, configured.window, rule.chunk, rule.chunk_by_position)

    def _shape_only(self) -> bool:
        """A shape-only trace (the planner's): no layout, or the batch's positions or padding mask are fake."""
        return self.ctx.layout is None or any(isinstance(self.ctx.full_inputs.get(r), FakeTensor) for r in MASK_INPUTS)

    def _check_real(self, where: str, rule: MaskRule, evaluate, block: int) -> None:
        """The learnt rule against the traced batch (the same outcome on every rank): on every rank's block, or on
        blocks of ``block`` tokens stepping by block - 1 when the program was resized (Note [Mask programs probed on
        shorter blocks] in mask_probes.py)."""
        if self._shape_only():
            return  # no values to check against
        full = self.ctx.full_inputs
        # A contiguous block of the real batch: under the zig-zag layout (ring, hybrid) this rank's own tokens
        # are two chunks, on which the model's mask would see a document boundary that is not in the batch.
        layout = self.ctx.layout.window()
        positions, padding = full.get("position_ids"), full.get("attention_mask")
        padded_positions = pad_end(positions, layout.pad_tokens, None)
        padded_mask = None if padding is None else pad_end(padding, layout.pad_tokens, 0)
        documents = rule.documents(padded_positions, padded_mask)
        self.kept[rule] = kept_fraction(documents, rule.window)
        if self.ctx.strategy in ZIGZAG_STRATEGIES:  # the ring skips chunk pairs by these ids; so does its export
            self.ctx.report.document_ids = documents
        length = layout.local_seq_len
        # Rank start // length's block, cut as shard_batch cuts the inputs (autosp.inputs.shard_tokens).
        starts = (range(0, layout.padded_seq_len, length) if block == length
                  else probe_offsets(block, layout.padded_seq_len))
        for start in starts:
            cut = slice(start, start + block)
            local = {"position_ids": padded_positions[:, cut],
                     "attention_mask": (torch.ones_like(padded_positions[:, cut]) if padded_mask is None
                                        else padded_mask[:, cut])}
            got = evaluate(local, start)
            expected = expected_block(documents, start, block, rule.window)
            if not torch.equal(got.expand_as(expected), expected):
                raise AutoSPError(f"module {where} attends with a mask that, on this batch's tokens {start}.."
                                  f"{start + block - 1}, differs from the rule learnt from probes ({rule}); {_FIX}")


_FIX = ("AutoSP applies causal attention within documents, chunks, padding masks and sliding windows over the whole "
        "sequence (Note [Attention masks built from the inputs]); other masks are not supported")


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
    learner, documents = _MaskLearner(gm, ctx), _DocumentIds(gm, ctx)
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
        gm.graph.eliminate_dead_code()
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
        sub.graph.eliminate_dead_code()
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
