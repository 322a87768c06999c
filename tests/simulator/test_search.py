"""Maximum trainable sequence length by binary search over a caller-supplied workload generator."""

from __future__ import annotations

import pytest

from simulator import ProgramBuilder, StaticMemory, Workload, max_sequence_length
from tests.simulator.toys import GFLOP, toy_cluster

BYTES_PER_TOKEN = 1000


def _linear_memory_workload(seq_len: int) -> Workload:
    b = ProgramBuilder()
    t = b.tensor(seq_len * BYTES_PER_TOKEN)
    b.compute("activations", flops=GFLOP, allocates=[t])
    b.compute("backward", flops=GFLOP, frees=[t])
    return Workload(name=f"S={seq_len}", world_size=2, groups={"sp": [0, 1]}, symmetric=True,
                    ranks={0: b.build(StaticMemory(parameter_bytes=10**6))}, metadata={"seq_len": seq_len})


CLUSTER = toy_cluster(memory_bytes=10**6 + 50_000 * BYTES_PER_TOKEN)  # fits up to 50,000 tokens


def test_search_finds_the_largest_fitting_multiple_of_the_granularity():
    found = max_sequence_length(_linear_memory_workload, CLUSTER, low=1024, high=1024 * 100, granularity=1024)
    assert found.max_seq_len == 48 * 1024  # 49 * 1024 = 50,176 > 50,000
    assert found.result.fits and not found.hit_upper_bound
    assert len(found.trials) <= 10
    assert any(not t.fits and t.seq_len == 49 * 1024 for t in found.trials)


def test_search_reports_none_when_the_shortest_length_does_not_fit():
    found = max_sequence_length(_linear_memory_workload, CLUSTER, low=60_000, high=100_000, granularity=1000)
    assert found.max_seq_len is None and found.result is None
    assert found.to_dict()["trials"][0]["fits"] is False


def test_search_flags_an_upper_bound_that_still_fits():
    found = max_sequence_length(_linear_memory_workload, CLUSTER, low=1000, high=8000, granularity=1000)
    assert found.max_seq_len == 8000 and found.hit_upper_bound


@pytest.mark.parametrize(("low", "high", "granularity"), [(1000, 500, 100), (10, 20, 64), (100, 1000, 0)])
def test_search_rejects_an_empty_grid(low, high, granularity):
    with pytest.raises(ValueError):
        max_sequence_length(_linear_memory_workload, CLUSTER, low=low, high=high, granularity=granularity)
