"""Public entry points: `compile`, `prepare_inputs` (re-exported) and `sync_gradients`.

`compile` wraps a model in `SequenceParallelModel`.  On each call it takes the
full-length batch from `prepare_inputs`, cuts out this rank's shard (padding,
global positions, labels shifted over the whole sequence) and runs the model
compiled by the AutoSP backend.  The loss it returns is the single-device loss
of the full sequence on every rank; after ``loss.backward()``,
`sync_gradients` makes every gradient the single-device gradient.
"""

from __future__ import annotations

import inspect
import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn

from autosp.backend import make_backend
from autosp.config import AutoSPConfig
from autosp.context import CompileReport, TraceContext
from autosp.errors import AutoSPError
from autosp.groups import SequenceParallelGroups, build_groups
from autosp.inputs import PREPARED_KEY, shard_batch, shard_layout
from autosp.pipeline import SEQUENCE_PARALLEL_PASSES

log = logging.getLogger(__name__)


def _accepts(forward, name: str) -> bool:
    params = inspect.signature(forward).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class SequenceParallelModel(nn.Module):
    """A model compiled for sequence parallelism; call it with ``**autosp.prepare_inputs(...)``."""

    def __init__(self, module: nn.Module, config: AutoSPConfig, groups: SequenceParallelGroups):
        super().__init__()
        self.module = module
        self.config = config
        self.groups = groups
        self._ctx = TraceContext(
            sp_size=config.sp_size, sp_rank=groups.sp_rank, group_name=groups.sp_group_name,
            ignore_index=config.ignore_index,
        )
        # sp_size=1: no sequence-parallel passes, but the same AOTAutograd path (checkpointing option,
        # graphs recorded in the report for autosp.export).
        backend = make_backend(self._ctx, config, passes=() if config.sp_size == 1 else SEQUENCE_PARALLEL_PASSES)
        self._compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)
        self._accepts_positions = _accepts(module.forward, "position_ids")

    @property
    def report(self) -> CompileReport:
        """What the AutoSP passes found and did (attention sites, per-pass op changes, graphs)."""
        return self._ctx.report

    def forward(self, *args, **kwargs):
        batch = kwargs.pop(PREPARED_KEY, None)
        if batch is None or args:
            raise AutoSPError(
                "inputs were not prepared: call the compiled model as model(**autosp.prepare_inputs(input_ids, "
                "labels=labels)) with the full-length sample on every rank of the SP group"
            )
        cfg = self.config
        layout = shard_layout(batch.seq_len, sp_size=cfg.sp_size, sp_rank=self.groups.sp_rank,
                              pad_to_multiple=cfg.pad_to_multiple)
        if layout.pad_tokens and self.report.attention_sites and not self.report.all_attention_causal:
            raise AutoSPError(
                f"the model uses non-causal attention, where padding {batch.seq_len} tokens to a multiple of "
                f"sp_size={cfg.sp_size} is not exact; pass a multiple of {cfg.sp_size} tokens"
            )
        if cfg.sp_size == 1:
            local = dict(kwargs)  # plain compile: the model sees the whole sample as it is
        else:
            local = shard_batch(kwargs, layout, ignore_index=cfg.ignore_index, pad_token_id=cfg.pad_token_id)
        if not self._accepts_positions:
            local.pop("position_ids")
        ctx = self._ctx
        ctx.layout = layout
        ctx.labels_passed = local.get("labels") is not None
        ctx.positions_passed = "position_ids" in local
        ctx.input_roles = {id(local[k]): k for k in ("input_ids", "labels", "position_ids") if local.get(k) is not None}
        try:
            return self._compiled(**local)
        except torch._dynamo.exc.BackendCompilerFailed as err:
            if isinstance(err.inner_exception, AutoSPError):
                raise err.inner_exception from None
            raise
        except torch._dynamo.exc.FailOnRecompileLimitHit as err:
            raise AutoSPError(
                f"torch.compile's recompile limit for {type(self.module).__name__}.forward was reached: every "
                "compiled model instance (and every new input shape) compiles that code again.  Call "
                "torch._dynamo.reset() between compiles of throwaway models, or raise "
                "torch._dynamo.config.recompile_limit"
            ) from err
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as err:
            raise AutoSPError(
                "the model does not trace as one graph (AutoSP compiles with fullgraph=True, since a graph "
                f"break would split attention from its all-to-alls); remove the graph break: {err}"
            ) from err
        finally:
            ctx.input_roles = {}

    def sync_gradients(self) -> None:
        """See `sync_gradients`."""
        sync_gradients(self)


def compile(  # noqa: A001 - mirrors torch.compile
    model: nn.Module,
    *,
    sp_size: int,
    process_group: dist.ProcessGroup | None = None,
    compiler: str = "inductor",
    **options,
) -> SequenceParallelModel:
    """Compile ``model`` for Ulysses sequence parallelism over ``sp_size`` ranks.

    ``process_group`` (default: the world) is split into SP groups of ``sp_size``
    contiguous ranks; the groups are data-parallel replicas.  ``options`` are the
    other fields of `AutoSPConfig`.  Every rank of the group must call this.
    """
    config = AutoSPConfig.from_options(sp_size=sp_size, compiler=compiler, options=options)
    groups = build_groups(sp_size, process_group)
    if sp_size == 1:
        warnings.warn("autosp.compile with sp_size=1 compiles the model without sequence parallelism "
                      "(the checkpointing option still applies)", stacklevel=2)
    return SequenceParallelModel(model, config, groups)


def _grads_by_dtype(model: nn.Module) -> dict[torch.dtype, list[torch.Tensor]]:
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            buckets.setdefault(p.grad.dtype, []).append(p.grad)
    return buckets


def sync_gradients(model: SequenceParallelModel) -> None:
    """Make each gradient the single-device one: sum over the SP group, average over data-parallel replicas.

    Call after ``loss.backward()`` on every rank.  One all-reduce per gradient dtype
    (gradients are flattened into one buffer).
    """
    if not isinstance(model, SequenceParallelModel):
        raise AutoSPError("sync_gradients expects the model returned by autosp.compile")
    groups = model.groups
    if dist.get_world_size(groups.group) == 1:
        return
    for grads in _grads_by_dtype(model).values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=groups.group)
        if groups.dp_size > 1:
            flat /= groups.dp_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
