"""Process-group layout: which ranks share a sequence and which are data-parallel replicas.

A group of W ranks is split into W / sp_size sequence-parallel (SP) groups of
``sp_size`` contiguous ranks; ranks with the same position in their SP group are
data-parallel replicas.  Gradients are summed over an SP group (each rank holds
part of one sequence's gradient) and averaged over replicas.

Under strategy="hybrid" an SP group is split once more (Note [Hybrid rank layout] in simulator/strategies.py):
Ulysses groups of ``ulysses_size`` consecutive ranks of the SP group, and ring groups of the ranks
``ulysses_size`` apart (one from each Ulysses group).  SP rank ``s`` is Ulysses rank ``s % ulysses_size`` and
ring rank ``s // ulysses_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from autosp.errors import AutoSPError


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
                 ulysses_size: int | None = None) -> SequenceParallelGroups:
    """Split ``process_group`` (default: the whole world) into SP groups of ``sp_size`` contiguous ranks, and with
    ``ulysses_size`` (strategy="hybrid") each SP group into its Ulysses and ring groups (see the module docstring).

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
    if size % sp_size:
        raise AutoSPError(
            f"sp_size={sp_size} does not divide the process group's {size} ranks; choose an sp_size that "
            f"divides {size} (the rest of the ranks become data-parallel replicas)"
        )
    sp_rank, dp_rank = rank % sp_size, rank // sp_size
    needs_block = sp_size != size or ulysses_size is not None
    block = dist.get_process_group_ranks(group)[dp_rank * sp_size : (dp_rank + 1) * sp_size] if needs_block else []
    sp_group = group if sp_size == size else _subgroup(block)
    ulysses_group = ring_group = None
    if ulysses_size is not None:
        if ulysses_size < 1 or sp_size % ulysses_size:
            raise AutoSPError(f"ulysses_size={ulysses_size} does not divide sp_size={sp_size}; pass a divisor")
        # Every rank creates its Ulysses group, then its ring group: the same order everywhere.
        first = sp_rank - sp_rank % ulysses_size
        ulysses_group = sp_group if ulysses_size == sp_size else _subgroup(block[first : first + ulysses_size])
        ring_group = sp_group if ulysses_size == 1 else _subgroup(block[sp_rank % ulysses_size :: ulysses_size])
    return SequenceParallelGroups(
        group=group, sp_group=sp_group, sp_size=sp_size, sp_rank=sp_rank, dp_size=size // sp_size, dp_rank=dp_rank,
        ulysses_group=ulysses_group, ring_group=ring_group,
    )


def _subgroup(ranks: list[int]) -> dist.ProcessGroup:
    """A process group of ``ranks`` (global ranks); only they take part in creating it."""
    return dist.new_group(ranks, use_local_synchronization=True)
