"""One rank's program as the export builds it: its ops, tensors and frees, accumulated across the forward and
backward graphs (autosp/export.py walks the graphs, autosp/export_ring.py writes out a ring attention node's steps)
and turned into a `simulator.workload.RankProgram` at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from simulator.workload import Collective, Op, RankProgram, SPLayout, StaticMemory


@dataclass
class RankEmitter:
    """Accumulates one rank's ops and tensors across the forward and backward graphs."""

    group: str
    masked_fraction: float | None = None
    """Fraction of the scores document-masked attention keeps (see `export_workload`)."""
    rank: int = 0
    """The rank (in its SP group) whose program this is: a ring's steps and neighbours depend on it."""
    sp_layout: SPLayout | None = None
    """A ring or hybrid program's rank layout: its ring ranks and neighbours (Note [Hybrid attention in the
    export])."""
    named_groups: dict[str, str] | None = None
    """c10d group name -> workload group, for collectives not on ``group`` (a hybrid's all-to-alls)."""
    document_ids: torch.Tensor | None = None
    """A ring over packed documents: the traced batch's document ids, [B, S] (see `export_workload`)."""

    node_costs: dict | None = None
    """What the export's `_node_costs` (autosp/export.py) found for each node, shared by the emitters of one
    export's ranks (their programs differ in the ring's ops only)."""

    def __post_init__(self):
        if self.node_costs is None:
            self.node_costs = {}
        self.ops: list[Op] = []
        self.tensors: dict[int, int] = {}
        self.host_tensors: set[int] = set()
        self.frees_at: dict[int, list[int]] = {}
        self.collectives = 0
        self.started: dict[fx.Node, Collective] = {}
        self.held: set[int] = set()
        """The caller's outputs it holds to the end of the step (Note [Outputs and tangents in the export])."""

    def new_tensor(self, nbytes: int) -> int:
        """The id of a new tensor of ``nbytes`` bytes."""
        tid = len(self.tensors)
        self.tensors[tid] = int(nbytes)
        return tid

    def program(self, static: StaticMemory) -> RankProgram:
        ops = []
        for op in self.ops:  # an op whose frees are already as they would be built stays as it is
            frees = tuple(sorted(set(op.frees) | set(self.frees_at.get(op.id, ()))))
            ops.append(op if frees == op.frees else Op(**{**_op_fields(op), "frees": frees}))
        return RankProgram(ops=tuple(ops), tensors=dict(self.tensors), static_memory=static,
                           host_tensors=frozenset(self.host_tensors))


def _op_fields(op: Op) -> dict:
    return {f: getattr(op, f) for f in Op.__dataclass_fields__}
