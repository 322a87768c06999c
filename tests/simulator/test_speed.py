"""Speed of the engine on a Llama-3.1-8B-sized workload: 32 layers, ~9,000 ops per rank, 8 ranks."""

from __future__ import annotations

import time

import pytest

from simulator import Cluster, simulate
from simulator.synthetic import llama_ulysses_workload


@pytest.mark.parametrize("collapse", [False, True], ids=["all-8-ranks", "collapsed"])
def test_speed_llama_8b_size_step_simulates_within_seconds(collapse, record_property):
    workload = llama_ulysses_workload(seq_len=65536, sp_degree=8, symmetric=False)
    ops = len(workload.ranks[0].ops)
    assert 8500 <= ops <= 9500
    cluster = Cluster.from_preset("a100-80gb-sxm")
    start = time.perf_counter()
    result = simulate(workload, cluster, collapse_symmetric=collapse)
    elapsed = time.perf_counter() - start
    record_property("simulate_s", elapsed)
    print(f"\n{ops} ops/rank x 8 ranks ({'collapsed' if collapse else 'all ranks simulated'}): "
          f"simulate() took {elapsed:.3f} s; simulated step {result.step_time_s:.3f} s, "
          f"peak {result.peak_memory_bytes / 2**30:.1f} GiB")
    assert result.collapsed == collapse
    assert elapsed < 5.0
