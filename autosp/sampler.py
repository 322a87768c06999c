"""Data loading for sequence parallelism: every rank of an SP group reads the same samples.

A plain ``DistributedSampler`` over the world would give each rank a different
sample; under sequence parallelism the ranks of one SP group must hold the *same*
full-length sample (each then keeps its slice of the tokens), and only the
data-parallel replicas (different SP groups) split the dataset.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset, DistributedSampler

from autosp.errors import AutoSPError
from autosp.groups import SequenceParallelGroups


def _groups_of(obj: Any) -> SequenceParallelGroups:
    if isinstance(obj, SequenceParallelGroups):
        return obj
    for attr in ("groups", "module"):  # SequenceParallelModel, SequenceParallelMPU, DeepSpeed engine
        inner = getattr(obj, attr, None)
        if isinstance(inner, SequenceParallelGroups):
            return inner
        if inner is not None and isinstance(getattr(inner, "groups", None), SequenceParallelGroups):
            return inner.groups
    raise AutoSPError(
        f"cannot find AutoSP's groups in a {type(obj).__name__}; pass the model from autosp.compile, the engine "
        "from autosp.deepspeed_initialize, or its SequenceParallelGroups"
    )


def sequence_parallel_sampler(
    dataset: Dataset, parallel: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
) -> DistributedSampler:
    """A ``DistributedSampler`` over data-parallel replicas: the ranks of one SP group get the same indices.

    ``parallel`` is the model from `autosp.compile`, the engine from
    `autosp.deepspeed_initialize`, or a `SequenceParallelGroups`.  Call
    ``sampler.set_epoch(epoch)`` each epoch, as with any ``DistributedSampler``.
    """
    groups = _groups_of(parallel)
    return DistributedSampler(
        dataset, num_replicas=groups.dp_size, rank=groups.dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
