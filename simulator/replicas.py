"""A sequence-parallel group's workload widened to its data-parallel replicas.

A workload exported from one SP group describes ranks ``0..P-1``; a job with ``dp_size`` replicas runs it
on ``dp_size x P`` ranks (`data_parallel_replicas`), which is what the planner simulates its gradient
reduction and optimizer step on.
"""

from __future__ import annotations

import dataclasses

from simulator.workload import RankProgram, Workload


def data_parallel_replicas(workload: Workload, dp_size: int) -> Workload:
    """``workload`` (one SP group: ranks ``0..P-1``) on ``dp_size x P`` ranks: replica ``d`` is ranks
    ``d*P .. d*P+P-1``, every group instance repeated in each replica, a non-symmetric program copied to its rank
    in every replica with its point-to-point peers moved there (keys stay: a p2p op is matched by its pair of
    ranks and its key)."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be positive, got {dp_size}")
    p = workload.world_size
    groups = {name: [[d * p + r for r in members] for d in range(dp_size) for members in instances]
              for name, instances in workload.groups.items()}
    if workload.symmetric:
        ranks = dict(workload.ranks)
    else:
        def moved(program: RankProgram, offset: int) -> RankProgram:
            if not offset:
                return program
            ops = tuple(dataclasses.replace(op, collective=dataclasses.replace(op.collective, peer=op.collective.peer
                                                                               + offset))
                        if op.collective is not None and op.collective.kind in ("send", "recv") else op
                        for op in program.ops)
            return dataclasses.replace(program, ops=ops)

        ranks = {d * p + r: moved(program, d * p) for d in range(dp_size) for r, program in workload.ranks.items()}
    return dataclasses.replace(workload, world_size=p * dp_size, groups=groups, ranks=ranks,
                               metadata={**workload.metadata, "dp_size": dp_size})
