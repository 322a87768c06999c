"""A single-process fake multi-rank process group for tracing and graph tests.

PyTorch's fake backend accepts every collective and returns without moving data,
so a model with collectives can be traced and compiled for any world size in one
process.  Values produced by collectives are meaningless; use it for graph
structure and shapes only.  Kept inside tests/ because it relies on
``torch.testing._internal``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

MAX_FAKE_WORLD_SIZE = 64


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[object]:
    """Initialise the default process group as a fake group of ``world_size`` ranks."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 1 <= world_size <= MAX_FAKE_WORLD_SIZE:
        raise ValueError(f"fake world size must be in 1..{MAX_FAKE_WORLD_SIZE}, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
