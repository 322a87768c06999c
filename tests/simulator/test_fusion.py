"""Inductor-style fusion of pointwise/reduction chains (simulator.fusion) and the GPU constants table."""

from __future__ import annotations

import dataclasses

import pytest

from simulator import Cluster, ProgramBuilder, Workload, get_preset, simulate
from simulator.cost_model import compute_times_s
from simulator.fusion import fuse_program
from simulator.gpu_constants import GPU_CONSTANTS, constants_for, moved
from simulator.hardware import DATASHEETS, DeviceSpec, OpClassEfficiency, build_preset, load_cpu_gloo
from simulator.schedule import compile_program

MB = 10**6
# 1 byte per ns of HBM, no FLOP limit, 1 us launch: a kernel's time is (bytes / 1e9) s + 1 us.
DEVICE = DeviceSpec(name="fuser", peak_flops_per_s=1e18, memory_bandwidth_bytes_per_s=1e9, memory_bytes=10**12,
                    kernel_launch_overhead_s=1e-6, fuses_pointwise=True,
                    efficiency={"other": OpClassEfficiency(flops=1.0, memory=1.0)})


def _chain(b: ProgramBuilder, n: int, *, source: int | None = None, size: int = MB, phase: str = "forward"):
    """``n`` pointwise ops, each reading the previous one's output (the first reads ``size`` untracked bytes or
    ``source``'s output); returns (op ids, tensor ids)."""
    ops, tensors, prev = [], [], source
    for i in range(n):
        t = b.tensor(size)
        deps = [] if prev is None else [prev]
        ops.append(b.compute(f"pw{i}", op_class="elementwise", flops=size // 2, bytes_read=size,
                             bytes_written=size, deps=deps, allocates=[t], phase=phase))
        tensors.append(t)
        prev = ops[-1]
    return ops, tensors


def _fused(program):
    unfused = compute_times_s([o.flops for o in program.ops], [o.bytes_read + o.bytes_written for o in program.ops],
                              [o.op_class for o in program.ops], DEVICE)
    return fuse_program(program, DEVICE, unfused), unfused


def _five_pointwise_program():
    b = ProgramBuilder()
    ops, tensors = [], []
    prev = None
    for i in range(5):
        t = b.tensor(MB)
        free = [tensors[-1]] if tensors else []
        ops.append(b.compute(f"pw{i}", op_class="elementwise", flops=MB // 2, bytes_read=MB, bytes_written=MB,
                             deps=[] if prev is None else [prev], allocates=[t], frees=free))
        tensors.append(t)
        prev = ops[-1]
    b.compute("consumer", op_class="matmul", flops=10**9, bytes_read=MB, deps=[prev], frees=[tensors[-1]])
    return b.build(), tensors


def test_fusion_a_chain_of_five_pointwise_ops_is_one_kernel_with_only_external_traffic():
    program, tensors = _five_pointwise_program()
    fused, unfused = _fused(program)
    assert fused.groups == [[0, 1, 2, 3, 4]]
    # External: the first op's 1 MB input and the last op's 1 MB output (read by the matmul).
    assert fused.group_bytes == [2 * MB]
    kernel = sum(fused.durations_s[:5])
    assert kernel == pytest.approx(2 * MB / 1e9 + 1e-6)
    assert sum(unfused[:5]) == pytest.approx(5 * (2 * MB / 1e9 + 1e-6))  # eager: 5 launches, 10 MB
    assert fused.internal_tensors == frozenset(tensors[:4])
    assert fused.durations_s[5] == unfused[5]  # the matmul is priced as before


def test_fusion_internal_tensors_leave_the_memory_timeline_so_the_peak_only_drops():
    program, _ = _five_pointwise_program()
    workload = Workload(name="chain", world_size=1, groups={"sp": [0]}, ranks={0: program})
    preset = dataclasses.replace(get_preset("a100-80gb-sxm"), device=dataclasses.replace(
        DEVICE, memory_bytes=10**12))
    fused = simulate(workload, Cluster.from_preset(preset))
    eager = simulate(workload, Cluster.from_preset(dataclasses.replace(
        preset, device=dataclasses.replace(preset.device, fuses_pointwise=False))))
    assert eager.peak_memory_bytes == 2 * MB  # producer and consumer live together
    assert fused.peak_memory_bytes == MB  # only the chain's output is ever allocated
    assert fused.step_time_s < eager.step_time_s


def test_fusion_a_matmul_breaks_the_group():
    b = ProgramBuilder()
    first, _ = _chain(b, 2)
    mm = b.compute("mm", op_class="matmul", flops=10**9, bytes_read=MB, bytes_written=MB, deps=[first[-1]],
                   allocates=[b.tensor(MB)])
    second, _ = _chain(b, 3, source=mm)
    fused, _ = _fused(b.build())
    assert fused.groups == [first, second]
    assert mm not in {p for g in fused.groups for p in g}


def test_fusion_outputs_read_outside_the_group_or_saved_stay_external():
    b = ProgramBuilder()
    ops, tensors = _chain(b, 3)  # nothing frees them: saved for backward, so every output is written
    fused, _ = _fused(b.build())
    assert fused.groups == [ops]
    assert fused.group_bytes == [MB + 3 * MB]
    assert fused.internal_tensors == frozenset()


def test_fusion_independent_chains_in_one_run_are_separate_kernels_and_views_are_free():
    b = ProgramBuilder()
    a, _ = _chain(b, 2)
    view = b.compute("view", deps=[a[-1]])  # no FLOPs, no bytes
    c = b.compute("after_view", op_class="reduction", flops=MB, bytes_read=MB, bytes_written=1000, deps=[view],
                  allocates=[b.tensor(1000)])
    d, _ = _chain(b, 2)  # unrelated to a
    fused, _ = _fused(b.build())
    assert sorted(fused.groups) == sorted([[*a, view, c], d])
    assert fused.durations_s[view] == 0.0


def test_fusion_is_off_for_cpu_gloo_and_the_eager_durations_are_unchanged():
    cpu = load_cpu_gloo().device
    assert not cpu.fuses_pointwise
    program, _ = _five_pointwise_program()
    cp = compile_program(program, cpu)
    eager = compute_times_s([o.flops for o in program.ops], [o.bytes_read + o.bytes_written for o in program.ops],
                            [o.op_class for o in program.ops], cpu)
    eager[0] += cpu.graph_call_overhead_s  # one compiled-graph entry per phase, unrelated to fusion
    assert cp.durations_s == pytest.approx(list(eager))
    assert set(cp.tensor_alloc_pos) == {t for o in program.ops for t in o.allocates}


def test_gpu_presets_fuse_and_read_every_constant_from_the_table():
    for name in DATASHEETS:
        preset = get_preset(name)
        assert preset.device.fuses_pointwise and preset.architecture
        used = constants_for(preset.architecture, "nvlink" if preset.intra_node_kind == "nvswitch" else "xgmi",
                             host=preset.host_memory_kind)
        for constant in used:
            for end in ("low", "high"):
                moved_preset = build_preset(name, moved(constant, end))
                if getattr(GPU_CONSTANTS[constant], end) != GPU_CONSTANTS[constant].nominal:
                    assert moved_preset != preset, (name, constant, end)


def test_every_gpu_constant_has_a_band_and_a_provenance():
    assert len(GPU_CONSTANTS) >= 15
    for name, u in GPU_CONSTANTS.items():
        assert u.name == name and u.low <= u.nominal <= u.high and u.low < u.high
        assert len(u.provenance) > 40 and u.unit
        if u.assumption:
            assert "assumption" in u.provenance.lower(), name
    # The attention constants cite the FlashAttention papers' measurements; they are not assumptions.
    assert "FlashAttention-2" in GPU_CONSTANTS["ampere.attention.flops"].provenance
    assert "FlashAttention-3" in GPU_CONSTANTS["hopper.attention.flops"].provenance


def test_fusion_crosses_an_independent_matmul_but_never_makes_a_cycle():
    b = ProgramBuilder()
    gate = b.compute("gate", op_class="matmul", flops=10**9, bytes_written=MB, allocates=[tg := b.tensor(MB)])
    silu = b.compute("silu", op_class="elementwise", flops=MB, bytes_read=MB, bytes_written=MB, deps=[gate],
                     allocates=[ts := b.tensor(MB)], frees=[tg])
    up = b.compute("up", op_class="matmul", flops=10**9, bytes_written=MB, allocates=[tu := b.tensor(MB)])
    mul = b.compute("mul", op_class="elementwise", flops=MB, bytes_read=2 * MB, bytes_written=MB,
                    deps=[silu, up], allocates=[b.tensor(MB)], frees=[ts, tu])
    # down depends on silu's group through mul only; after it, a pointwise op reading silu's group and down
    # must not join the group (group -> down -> op would be a cycle).
    down = b.compute("down", op_class="matmul", flops=10**9, bytes_read=MB, bytes_written=MB, deps=[mul],
                     allocates=[b.tensor(MB)])
    after = b.compute("after", op_class="elementwise", flops=MB, bytes_read=2 * MB, bytes_written=MB,
                      deps=[mul, down], allocates=[b.tensor(MB)])
    fused, _ = _fused(b.build())
    assert fused.groups == [[silu, mul], [after]]
    assert ts in fused.internal_tensors  # silu's output never reaches HBM
    # silu + mul: reads gate and up (1 MB each), writes mul's output (read by down and after).
    assert fused.group_bytes[0] == 3 * MB
