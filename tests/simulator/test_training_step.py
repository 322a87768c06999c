"""Gradient reduction and optimizer step appended to a workload: exact timelines on a toy cluster.

Toy numbers (tests/simulator/toys.py): 1 GFLOP = 1 ms, every link moves 1 MB/ms; memory bandwidth 11.25 GB/s, so
that Adam over 375,000 bf16-backed elements (16 bytes read + 14 written each) takes exactly 1 ms. Two ranks:
a reduce-scatter of M bytes takes M/2 / (1 MB/ms), an all-reduce M / (1 MB/ms), an all-gather of a shard S bytes
S / (1 MB/ms).
"""

from __future__ import annotations

import pytest

from simulator import ProgramBuilder, TrainingConfig, Workload, simulate, validate_workload
from simulator.training_step import GradientReady, add_training_step, bucket_gradients, reduction_plan
from simulator.workload import WorkloadError
from tests.simulator.toys import GFLOP, MS, toy_cluster

CLUSTER = toy_cluster(memory_bandwidth_bytes_per_s=11.25e9)


def _backward(layers: int = 3, extra: int = 0) -> tuple[Workload, list[int]]:
    b = ProgramBuilder()
    ids = [b.compute(f"B{i}", flops=GFLOP, phase="backward") for i in range(layers)]
    for i in range(extra):
        b.compute(f"X{i}", flops=GFLOP, phase="backward")
    return Workload(name="bwd", world_size=2, groups={"dp": [0, 1]}, ranks={0: b.build()}, symmetric=True), ids


def _times(result, name):
    tl = result.timelines[0]
    pos = next(i for i, op in enumerate(tl.compiled.program.ops) if op.name == name)
    return pytest.approx((tl.begin_s[pos] / MS, tl.end_s[pos] / MS))


def _end(result, name):
    return _times(result, name).expected[1]


def _run(cfg, numel, *, layers=3, extra=0):
    workload, ids = _backward(layers, extra)
    stepped = add_training_step(workload, [GradientReady(op_id=i, numel=numel) for i in ids], cfg)
    validate_workload(stepped)
    return simulate(stepped, CLUSTER)


def _cfg(**kw):
    return TrainingConfig(**{"parameter_numels": (250_000,) * 3, "precision": "bf16", "dp_world_size": 2, **kw})


def test_training_step_zero2_blocking_reduce_scatter_per_bucket():
    result = _run(_cfg(zero_stage=2, reduce_bucket_size=250_000), 250_000)
    # B0 0-1, rs 1-1.25 (500 kB, half crosses), B1 1.25-2.25, rs, B2 2.5-3.5, rs 3.5-3.75, Adam 1 ms, gather
    assert _times(result, "grad_reduce_0") == (1.0, 1.25)
    assert _times(result, "B2") == (2.5, 3.5)
    assert _times(result, "optimizer_step") == (3.75, 4.75)
    assert _times(result, "param_all_gather_0") == (4.75, 5.5)  # 375,000 bf16 elements per rank
    assert result.step_time_s == pytest.approx(5.5 * MS)


def test_training_step_zero2_overlap_comm_hides_the_reductions_behind_backward():
    result = _run(_cfg(zero_stage=2, reduce_bucket_size=250_000, overlap_comm=True), 250_000)
    assert _times(result, "B1") == (1.0, 2.0)
    assert _end(result, "grad_reduce_2") == pytest.approx(3.25)
    assert _times(result, "optimizer_step") == (3.25, 4.25)
    assert result.step_time_s == pytest.approx(5.0 * MS)


def test_training_step_two_buffers_stall_backward_when_reductions_fall_behind():
    cfg = TrainingConfig(parameter_numels=(2_500_000,) * 3, precision="bf16", dp_world_size=2, zero_stage=2,
                         reduce_bucket_size=2_500_000, overlap_comm=True)
    result = _run(cfg, 2_500_000, extra=1)
    # reduce-scatters of 5 MB take 2.5 ms each, back to back on the comm stream: 1-3.5, 3.5-6, 6-8.5.
    # Bucket 2 reuses bucket 0's buffer: after B2 (2-3) backward waits for it until 3.5, so X0 runs 3.5-4.5.
    assert _times(result, "X0") == (3.5, 4.5)
    assert _end(result, "grad_reduce_2") == pytest.approx(8.5)
    assert _times(result, "optimizer_step") == (8.5, 18.5)  # 3.75M elements: 10 ms
    assert result.step_time_s == pytest.approx((18.5 + 7.5) * MS)  # all-gather of 7.5 MB


def test_training_step_bf16_optimizer_all_reduces_fp32_after_backward():
    cfg = _cfg(zero_stage=1, grad_accum_dtype="fp32")
    assert cfg.wrapper == "BF16_Optimizer"
    result = _run(cfg, 250_000)
    # one 5e8-element bucket: 750,000 fp32 = 3 MB all-reduce, 3 ms, after B2
    assert _times(result, "grad_reduce_0") == (3.0, 6.0)
    assert _times(result, "optimizer_step") == (6.0, 7.0)
    assert result.step_time_s == pytest.approx(7.75 * MS)


def test_training_step_zero3_overlaps_by_default_and_gathers_nothing_after_the_step():
    result = _run(_cfg(zero_stage=3, reduce_bucket_size=250_000), 250_000)
    names = [op.name for op in result.timelines[0].compiled.program.ops]
    assert not any(n.startswith("param_all_gather") for n in names)
    assert reduction_plan(_cfg(zero_stage=3)).overlapped and not reduction_plan(_cfg(zero_stage=2)).overlapped
    assert _times(result, "optimizer_step") == (3.25, 4.25)


def test_training_step_buckets_close_before_overflowing():
    grads = [GradientReady(op_id=i, numel=n) for i, n in enumerate((3, 4, 2, 9, 1))]
    assert [[g.numel for g in b] for b in bucket_gradients(grads, 7)] == [[3, 4], [2], [9], [1]]


def test_training_step_checks_the_group():
    workload, ids = _backward()
    grads = [GradientReady(op_id=i, numel=10) for i in ids]
    with pytest.raises(WorkloadError):
        add_training_step(workload, grads, _cfg(zero_stage=2), group="nope")
    with pytest.raises(WorkloadError):
        add_training_step(workload, grads, _cfg(zero_stage=2, dp_world_size=4))
    with pytest.raises(WorkloadError):
        add_training_step(workload, [GradientReady(op_id=99, numel=1)], _cfg(zero_stage=2))
    added = add_training_step(workload, grads, _cfg(zero_stage=2), group="world", group_instances=[0, 1])
    assert added.groups["world"] == ((0, 1),)


def test_training_step_gradients_from_modules_use_the_last_gradient_op():
    from simulator.training_step import gradients_from_modules

    workload, ids = _backward()
    grads = gradients_from_modules(workload.ranks[0], [(("B0", "B2"), 10), (("B1",), 20), (("absent",), 5)])
    assert grads == [GradientReady(op_id=ids[2], numel=10), GradientReady(op_id=ids[1], numel=20)]
