"""Process-group layout: which ranks share a sequence and which are data-parallel replicas.

A group of W ranks is split into W / sp_size sequence-parallel (SP) groups of
``sp_size`` contiguous ranks; ranks with the same position in their SP group are
data-parallel replicas.  Gradients are summed over an SP group (each rank holds
part of one sequence's gradient) and averaged over replicas.
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

    @property
    def sp_group_name(self) -> str:
        return self.sp_group.group_name


def build_groups(sp_size: int, process_group: dist.ProcessGroup | None = None) -> SequenceParallelGroups:
    """Split ``process_group`` (default: the whole world) into SP groups of ``sp_size`` contiguous ranks.

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
    if sp_size == size:
        sp_group = group
    else:
        members = dist.get_process_group_ranks(group)
        block = members[dp_rank * sp_size : (dp_rank + 1) * sp_size]
        # Only the ranks of each block take part in creating it.
        sp_group = dist.new_group(block, use_local_synchronization=True)
    return SequenceParallelGroups(
        group=group, sp_group=sp_group, sp_size=sp_size, sp_rank=sp_rank, dp_size=size // sp_size, dp_rank=dp_rank
    )
