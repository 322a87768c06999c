"""Note [One trace per length class] (experiments/paper_scale/simulate.py): a workload interpolated between traces
at three lengths is the workload a real trace gives, for every system whose checkpointing plan does not depend on
the length; SAC's program at a length is re-sized from the joint graphs of two traces (Note [The joint graph at
another length] in autosp/joint_template.py) and equals a real trace there too.  A small Llama (one layer, 8 heads
over 8 ranks) keeps it lean: what depends on the length is in every layer alike, and a trace's time grows with its
layers; each class is traced at four lengths (three anchors, one check) and interpolated at a fifth; SAC is traced
at three (two captures, one check) and re-sized at a fourth."""

from __future__ import annotations

import pytest

from experiments.baselines.autosp_system import autosp_options
from experiments.models import PaperModel
from experiments.paper_scale.simulate import (
    TraceCache,
    simulate_dynamic,
    step_workload,
    trace_workload,
)
from simulator import Cluster

MODEL = PaperModel(name="tiny-llama", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8,
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


def test_sac_is_resized_from_two_joint_graphs_and_equals_its_trace_where_its_plan_differs():
    from autosp.joint_template import joint_at

    cache, options, sp = TraceCache(interpolate_lengths=True), autosp_options("autosp"), 8
    traced = {n: trace_workload(MODEL, n, MODEL.num_layers, sp_size=sp, autosp_options=options, cache=cache)
              for n in ANCHORS}
    (joint,) = cache.length_classes.values()
    assert joint.how == "resized"
    assert cache.misses == 3 and joint.checked  # two captures, then the check: re-sized == traced at 2048
    resized = trace_workload(MODEL, 1024, MODEL.num_layers, sp_size=sp, autosp_options=options, cache=cache)
    real = trace_workload(MODEL, 1024, MODEL.num_layers, sp_size=sp, autosp_options=options, cache=TraceCache())
    assert cache.misses == 3 and cache.resized == 1 and resized == real
    # SAC decided afresh at 1024 tokens: it recomputes other matmuls than at 4096 (a different program).
    ops = {n: len(next(iter(t.workload.ranks.values())).ops) for n, t in {**traced, 1024: resized}.items()}
    assert ops[1024] != ops[4096], ops
    # Outside the traced range: traced (and the range widens).
    trace_workload(MODEL, 8192, MODEL.num_layers, sp_size=sp, autosp_options=options, cache=cache)
    assert cache.misses == 4 and cache.resized == 1
    # A length whose shard sizes are not integers on the line through the captures has no template.
    assert joint_at(*joint.captures, 1028) is None  # 1028 / 8 ranks
