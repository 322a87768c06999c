"""Note [One trace per length class] (experiments/paper_scale/simulate.py): a workload interpolated between traces
at three lengths is the workload a real trace gives, for every system whose checkpointing plan does not depend on
the length; SAC is traced at every length.  A small Llama (2 layers, 8 heads over 8 ranks) keeps it lean: each
class is traced at four lengths (three anchors, one check) and interpolated at a fifth."""

from __future__ import annotations

from dataclasses import replace

import pytest

from experiments.baselines.autosp_system import autosp_options
from experiments.models import PaperModel
from experiments.paper_scale.config import PAPER_CONFIG
from experiments.paper_scale.simulate import (
    TraceCache,
    interpolate_trace,
    simulate_dynamic,
    step_workload,
    trace_workload,
)
from simulator import Cluster

MODEL = PaperModel(name="tiny-llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                   num_kv_heads=8, vocab_size=256)
ANCHORS, CHECK, LENGTH = (512, 4096, 2048), 3072, 1536  # in the order a search might ask for them


@pytest.fixture(scope="module")
def fast() -> TraceCache:
    return TraceCache(interpolate_lengths=True)


def test_interpolated_whole_steps_equal_traced_ones_for_every_length_invariant_system(fast):
    cluster = Cluster.from_preset("a100-80gb-sxm")
    slow = TraceCache()
    for system in ("ulysses", "ring", "ulysses+ckpt", "zero3"):
        for n in (*ANCHORS, CHECK):
            step_workload(system, MODEL, n, MODEL.num_layers, cache=fast)
        quick = step_workload(system, MODEL, LENGTH, MODEL.num_layers, cache=fast)
        real = step_workload(system, MODEL, LENGTH, MODEL.num_layers, cache=slow)
        assert quick == real, system
        (time_q, peak_q), (time_r, peak_r) = simulate_dynamic(quick, cluster), simulate_dynamic(real, cluster)
        assert peak_q == peak_r and time_q == pytest.approx(time_r, rel=1e-9), system
    # Three trace classes (ring attention rewrites the Ulysses trace), each traced at the anchors and at the check
    # length, where the interpolation equalled the trace.
    assert [c.checked for c in fast.length_classes.values()] == [True] * 3
    assert fast.misses == 3 * (len(ANCHORS) + 1) and fast.interpolated == 3


def test_sac_is_traced_at_every_length_and_a_different_program_is_not_interpolated(fast):
    before = fast.misses
    trace_workload(MODEL, LENGTH, MODEL.num_layers, sp_size=PAPER_CONFIG.sp_size_of("autosp", 8),
                   autosp_options=autosp_options("autosp"), cache=fast)
    assert fast.misses == before + 1  # SAC's plan depends on the length: traced, not interpolated
    options = autosp_options("ulysses")
    anchors = {n: trace_workload(MODEL, n, MODEL.num_layers, sp_size=8, autosp_options=options, cache=fast)
               for n in ANCHORS}
    assert fast.misses == before + 1  # the anchors are cached
    assert interpolate_trace(anchors, LENGTH, name="x") is not None
    assert trace_workload(MODEL, 8192, MODEL.num_layers, sp_size=8, autosp_options=options, cache=fast) \
        is not None and fast.misses == before + 2  # outside the traced lengths: traced
    rank, program = next(iter(anchors[ANCHORS[1]].workload.ranks.items()))
    changed = replace(program, ops=(replace(program.ops[0], kind="collective_wait"), *program.ops[1:]))
    other = replace(anchors[ANCHORS[1]], workload=replace(anchors[ANCHORS[1]].workload, ranks={rank: changed}))
    assert interpolate_trace({**anchors, ANCHORS[1]: other}, LENGTH, name="x") is None
