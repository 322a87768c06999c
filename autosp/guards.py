"""Run-time checks: what a compiled program assumed, checked on every call; the same sample on every SP rank.

- `ProgramGuard` wraps each program the backend compiles.  torch.compile reuses a
  program for every batch of the same shapes, but some facts the passes relied on
  are not shapes: whether the sequence was padded (a padded batch can have an
  unpadded one's shapes, e.g. under ``length_bucket``), whether the positions were
  0..S-1.  The guard records them when the program is built and checks each call
  against them before the program runs, so no outcome depends on which batch came
  first (Note [Run-time guards] below).  It also gathers the program's
  token-sharded outputs to full length when the call passed no labels.
- `check_same_sample`: every rank of an SP group must hold the same full-length
  sample; one small all-gather of checksums per call says whether they do.
- `sliding_window_layers`: what the model's configuration says about its attention
  that a shard cannot show.  The mask pass (autosp.passes.dynamo.masks) learns a
  model's attention mask by evaluating it on the shard's length; a sliding window at
  least that long is invisible there, so its length and the layers it applies to come
  from the model's configuration (Hugging Face's ``sliding_window``,
  ``use_sliding_window``, ``layer_types``).

Note [Run-time guards]
A compile-time fact that is not a shape (padding present, plain positions) is
either refused at trace time *and* recorded in the program's `ProgramAssumptions`
(`TraceContext.require_unpadded`), or not relied on; the guard re-checks the
recorded facts on every call, so for any order of batches each batch is exact or
refused on its own merits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _resolve_process_group

from autosp.context import TraceContext, refuse_padding
from autosp.errors import AutoSPError, DocumentAttentionUnavailable
from autosp.inputs import in_sequence_order
from autosp.passes.dynamo.placements import Shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlidingWindow:
    window: int
    """Tokens a query attends to (itself included), as Hugging Face's ``sliding_window``."""
    every_layer: bool
    """True when every attention layer slides (no ``layer_types``, or all of them ``sliding_attention``)."""


def sliding_window_layers(module: nn.Module) -> SlidingWindow | None:
    """The sliding window of a Hugging Face model whose config has one in use, else None."""
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    every = layer_types is None or all(t == "sliding_attention" for t in layer_types)
    return SlidingWindow(window, every)


# --- programs ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProgramAssumptions:
    """What one compiled program took for granted about its batches, beyond their shapes."""

    padding_refusals: tuple[str, ...]
    """Why the program is not exact on a padded sequence (empty: padding is fine)."""
    plain_positions: bool
    """The program is exact only while the position ids are 0..S-1 in every row."""
    output_placements: tuple
    """Placement of each graph output (token-sharded outputs are gathered when no labels were passed)."""
    labels_passed: bool


class ProgramGuard:
    """The compiled program as the backend returns it, checked against its assumptions on every call.

    Called by Dynamo with the graph's flattened inputs, after the shard was cut and
    ``ctx`` updated for this call (`autosp.model.SequenceParallelModel.forward`), so a
    refusal happens before any collective of the program runs, identically on every
    rank of the SP group (whose batches were checked to be the same)."""

    def __init__(self, program, ctx: TraceContext):
        report = ctx.report
        self.program, self.ctx = program, ctx
        self.assumptions = ProgramAssumptions(
            padding_refusals=tuple(report.padding_refusals), plain_positions=report.requires_plain_positions,
            output_placements=tuple(report.output_placements), labels_passed=ctx.labels_passed)
        self._boxed_call = getattr(program, "_boxed_call", False)  # Dynamo's calling convention, passed through

    def __call__(self, *args):
        ctx, assumed = self.ctx, self.assumptions
        refuse_padding(list(assumed.padding_refusals), ctx.layout, ctx.sp_size)
        if assumed.plain_positions and not ctx.positions_plain:
            # Compiled as causal attention for plain positions: the model runs this batch through its document
            # program instead (Note [Document program] in autosp/model.py).
            raise DocumentAttentionUnavailable(
                "this program was compiled as causal attention for one unpacked sequence per row, and this batch "
                "packs documents (position ids restart)")
        outputs = self.program(*args)
        ctx.program_outputs = outputs  # the gradient reduction finds the program's backward from these
        if assumed.labels_passed or not any(isinstance(p, Shard) for p in assumed.output_placements):
            return outputs
        gathered = [_gather_output(o, p, ctx) for o, p in zip(outputs, assumed.output_placements, strict=True)]
        return type(outputs)(gathered) if isinstance(outputs, tuple) else gathered


# Note [Outputs of a call without labels]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Called with labels, the model returns the loss of the whole sequence (and its other outputs, e.g. the
# logits, for this rank's tokens only).  Called without labels, the caller can only want the outputs
# themselves -- to compute a loss or a metric outside the model -- so every token-sharded output is
# all-gathered to the whole sequence (padding cut off): the caller sees what one device returns, at the
# memory cost of the full-length output on every rank (for logits: batch x sequence x vocabulary, the
# largest activation of an LLM; pass labels to keep it sharded).  Every rank then computes the same
# loss from the same gathered tensor, and its gradient reaches this rank's shard as the matching slice
# of the full gradient: the gather's backward is the slice, not a sum (as the loss all-reduce's backward
# is the identity, Note [Loss all-reduce gradient] in autosp/ops.py), and the gradient reduction sums
# the ranks' contributions once.


class _GatherTokens(torch.autograd.Function):
    """Every rank's tokens in sequence order: each rank's pieces put back where the layout took them from (rank
    order for contiguous shards; Note [Zig-zag layout] in autosp/inputs.py).  The backward is this rank's tokens of
    the gradient."""

    @staticmethod
    def forward(ctx, x, dim: int, group_name: str, every_rank: tuple, rank: int):
        parts = [torch.empty_like(x) for _ in every_rank]
        dist.all_gather(parts, x.contiguous(), group=_resolve_process_group(group_name))
        ctx.dim, ctx.ranges = dim, every_rank[rank]
        return in_sequence_order(parts, every_rank, dim)

    @staticmethod
    def backward(ctx, grad):
        mine = torch.cat([grad.narrow(ctx.dim, begin, end - begin) for begin, end in ctx.ranges], ctx.dim)
        return mine, None, None, None, None


def _gather_output(value, placement, ctx: TraceContext):
    if not isinstance(placement, Shard):
        return value
    if placement.tentative or placement.inner != 1 or not isinstance(value, torch.Tensor):
        raise AutoSPError(
            f"the model, called without labels, returns a per-token output ({placement}) that AutoSP cannot "
            "gather to the whole sequence (its token axis is merged with another); pass labels so that the model "
            "returns the loss of the whole sequence, or return the per-token output as [batch, sequence, ...]")
    length = value.shape[placement.dim]
    every_rank = (ctx.layout.every_rank if ctx.layout is not None
                  else tuple(((r * length, (r + 1) * length),) for r in range(ctx.sp_size)))
    full = _GatherTokens.apply(value, placement.dim, ctx.group_name, every_rank, ctx.sp_rank)
    return full.narrow(placement.dim, 0, ctx.layout.seq_len) if ctx.layout is not None else full


# --- the same sample on every rank of an SP group ---------------------------------------------------------------

SAMPLE_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")
_PRIME = 2**31 - 1


def sample_checksums(batch: dict, device: torch.device) -> torch.Tensor:
    """Per input of ``SAMPLE_KEYS``: [present, rows, columns, two weighted sums mod 2^31-1] (int64).

    The sums weight element i by i + 1 and by (i^2 + i + 1) mod p: a change of one element, a swap of two,
    a shift of the sequence all change them; every term stays below 2^62 and the sums below 2^63 up to 2^32
    elements per tensor, so int64 arithmetic is exact on every backend."""
    rows = []
    for key in SAMPLE_KEYS:
        t = batch.get(key)
        if t is None:
            rows.append(torch.zeros(5, dtype=torch.int64, device=device))
            continue
        flat = t.reshape(-1).to(device=device, dtype=torch.int64) % _PRIME
        index = torch.arange(flat.numel(), device=device, dtype=torch.int64)
        linear = ((flat * (index + 1)) % _PRIME).sum()
        quadratic = ((flat * ((index * index + index + 1) % _PRIME)) % _PRIME).sum()
        header = torch.tensor([1, *t.shape], dtype=torch.int64, device=device)
        rows.append(torch.cat([header, linear[None], quadratic[None]]))
    return torch.stack(rows)


def check_same_sample(batch: dict, group: dist.ProcessGroup, size: int, device: torch.device) -> None:
    """Refuse, on every rank of the SP group, a call whose ranks hold different samples.

    One all-gather of ``len(SAMPLE_KEYS) x 5`` integers; every rank compares all of them, so all ranks take
    the same decision.  (The buffers start as this rank's own checksums, so a backend that moves no data, as
    the test suite's fake groups, sees a consistent group.)"""
    mine = sample_checksums(batch, device)
    parts = [mine.clone() for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    differing = [key for k, key in enumerate(SAMPLE_KEYS) if any(not torch.equal(p[k], parts[0][k]) for p in parts)]
    if differing:
        ranks = [r for r, p in enumerate(parts) if not torch.equal(p, parts[0])]
        raise AutoSPError(
            f"the ranks of this SP group hold different samples ({', '.join(differing)} differ between group ranks "
            f"0 and {ranks}): under sequence parallelism every rank of an SP group must be given the same "
            "full-length sample, each then keeps its slice of the tokens.  Load data with "
            "autosp.sequence_parallel_sampler(dataset, model) (it splits the data over data-parallel replicas "
            "only) instead of a DistributedSampler over all ranks, or, with the Hugging Face Trainer, use "
            "autosp.integrations.hf.  (AutoSPConfig.check_same_sample=False turns this check off.)")
