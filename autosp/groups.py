"""Process-group layout: which ranks share a sequence and which are data-parallel replicas.

A group of W ranks is split into W / sp_size sequence-parallel (SP) groups of
``sp_size`` contiguous ranks; ranks with the same position in their SP group are
data-parallel replicas.  Gradients are summed over an SP group (each rank holds
part of one sequence's gradient) and averaged over replicas.

Under strategy="hybrid" an SP group is split once more (Note [Hybrid rank layout] in simulator/strategies.py):
Ulysses groups of ``ulysses_size`` consecutive ranks of the SP group, and ring groups of the ranks
``ulysses_size`` apart (one from each Ulysses group).  SP rank ``s`` is Ulysses rank ``s % ulysses_size`` and
ring rank ``s // ulysses_size``.  Which ranks form which group is `simulator.workload.SPLayout`'s (its
``sp_groups``, ``ulysses_groups`` and ``ring_groups``); this module makes torch process groups of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from autosp.errors import AutoSPError
from simulator.workload import SPKind, SPLayout, SPLayoutError


@dataclass(frozen=True)
class SequenceParallelGroups:
    """The groups one rank belongs to."""

    group: dist.ProcessGroup
    """All ranks taking part (SP groups × data-parallel replicas)."""
    sp_group: dist.ProcessGroup
    """The ranks that share this rank's sequence."""
    sp_size: int
    sp_rank: int
    """This rank's index inside its SP group: it holds the sp_rank-th slice of the tokens."""
    dp_size: int
    dp_rank: int
    ulysses_group: dist.ProcessGroup | None = None
    """strategy="hybrid": this rank's Ulysses group (consecutive SP ranks); None otherwise."""
    ring_group: dist.ProcessGroup | None = None
    """strategy="hybrid": this rank's ring group (the SP ranks ``ulysses_size`` apart); None otherwise."""

    @property
    def sp_group_name(self) -> str:
        return self.sp_group.group_name


def build_groups(sp_size: int, process_group: dist.ProcessGroup | None = None, *,
                 ulysses_size: int | None = None, layout: SPLayout | None = None) -> SequenceParallelGroups:
    """Split ``process_group`` (default: the whole world) into SP groups of ``sp_size`` contiguous ranks, and with
    ``ulysses_size`` (strategy="hybrid") each SP group into its Ulysses and ring groups (see the module docstring).
    ``layout``: the strategy's layout (`AutoSPConfig.layout`) instead of ``ulysses_size``; its rank tuples
    (`simulator.workload.SPLayout`, positions in ``process_group``) are the groups made.

    Every rank of ``process_group`` must call this, in the same order as any other
    group creation, since it may create new process groups.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise AutoSPError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group() "
            "(torchrun or the deepspeed launcher do the rendezvous) before autosp.compile"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise AutoSPError("this rank is not a member of the process_group passed to autosp.compile")
    try:
        if layout is None:
            layout = SPLayout.from_options(SPKind.HYBRID if ulysses_size is not None else SPKind.ULYSSES, sp_size,
                                           ulysses_size=ulysses_size)
        elif layout.sp_size != sp_size or ulysses_size not in (None, layout.ulysses_size):
            raise AutoSPError(f"build_groups: sp_size={sp_size}, ulysses_size={ulysses_size} differ from {layout}")
        sp_members = _mine(layout.sp_groups(size), rank)
    except SPLayoutError as err:
        raise AutoSPError(str(err)) from None
    sp_rank, dp_rank = rank % sp_size, rank // sp_size
    positions = dist.get_process_group_ranks(group) if sp_size != size or layout.kind.grouped else []

    def subgroup(members: tuple[int, ...]) -> dist.ProcessGroup:  # the SP group where it is the whole of it
        return sp_group if len(members) == sp_size else _subgroup([positions[p] for p in members])

    sp_group = group if sp_size == size else _subgroup([positions[p] for p in sp_members])
    ulysses_group = ring_group = None
    if layout.kind.grouped:  # every rank creates its Ulysses group, then its ring group: the same order everywhere
        ulysses_group = subgroup(_mine(layout.ulysses_groups(size), rank))
        ring_group = subgroup(_mine(layout.ring_groups(size), rank))
    return SequenceParallelGroups(
        group=group, sp_group=sp_group, sp_size=sp_size, sp_rank=sp_rank, dp_size=size // sp_size, dp_rank=dp_rank,
        ulysses_group=ulysses_group, ring_group=ring_group,
    )


def _mine(groups: tuple[tuple[int, ...], ...], rank: int) -> tuple[int, ...]:
    """The group of ``groups`` holding ``rank``."""
    return next(g for g in groups if rank in g)


def _subgroup(ranks: list[int]) -> dist.ProcessGroup:
    """A process group of ``ranks`` (global ranks); only they take part in creating it."""
    return dist.new_group(ranks, use_local_synchronization=True)
