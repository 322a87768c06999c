"""Learn the rule of an attention mask a model builds from its inputs: steps 1-4 of Note [Attention masks built from
the inputs] in autosp/passes/dynamo/masks.py (which applies the rule, step 5).

`MaskLearner.rule` takes the node computing an SDPA's mask and returns the `MaskRule` (the ingredients of Note
[Document masks] in autosp/document_attention.py) the mask is, found from its subgraph evaluated on probe inputs
(autosp/passes/dynamo/mask_probes.py) and checked on the traced batch; None where the mask reads what a rule cannot
(the attention rule then refuses it), an `AutoSPError` where it is no such rule.

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
the configured window (`MaskLearner._program_key`).  With
``TraceContext.mask_rules`` (a dict the planner's `autosp.plan.traces.TraceReuse`
passes to each of its traces) a rule, or the refusal, learnt for one key is
taken by every later trace with the same key.  A trace with values (a compile of
a real job, or a trace with packed documents) never shares: step 4 runs on its
own batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from autosp.config import ZIGZAG_STRATEGIES
from autosp.context import TraceContext
from autosp.document_attention import document_ids, kept_fraction
from autosp.errors import AutoSPError
from autosp.inputs import pad_end
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
from autosp.passes.dynamo.tag_inputs import ROLE
from autosp.passes.graph_utils import fake_value

log = logging.getLogger(__name__)

MASK_INPUTS = ("position_ids", "attention_mask")
"""The inputs a mask may be computed from (step 1 of Note [Attention masks built from the inputs])."""


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


class MaskLearner:
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
