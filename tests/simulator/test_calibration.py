"""The cpu-gloo calibration's fit and preset document (the measurements themselves run in the script)."""

from __future__ import annotations

import pytest

from simulator.cost_model import all_to_all_time_s
from simulator.hardware import preset_from_dict


def test_calibration_fit_recovers_a_known_alpha_and_bandwidth():
    calibrate = pytest.importorskip("experiments.calibration.calibrate_cpu")
    alpha, bandwidth = 50e-6, 3e9
    samples = {world: {n: all_to_all_time_s(n, world, latency_s=alpha, bandwidth_bytes_per_s=bandwidth)
                       for n in calibrate.A2A_BYTES} for world in calibrate.WORLDS}
    fit_alpha, fit_bandwidth = calibrate.fit_alpha_beta(samples)
    assert fit_alpha == pytest.approx(alpha, rel=1e-6)
    assert fit_bandwidth == pytest.approx(bandwidth, rel=1e-6)


def test_calibration_attention_fit_recovers_a_known_matmul_rate_and_time_per_score():
    calibrate = pytest.importorskip("experiments.calibration.calibrate_cpu")
    rate, score_s = 6e10, 0.6e-9
    samples = []
    for dim in calibrate.ATTENTION_HEAD_DIMS:
        scores = 8 * 1024 * 1024 // 2
        flops = 4 * dim * scores
        samples.append({"flops": flops, "scores": scores, "seconds": flops / rate + scores * score_s})
    fit_rate, fit_score_s = calibrate.fit_attention(samples)
    assert fit_rate == pytest.approx(rate, rel=1e-6)
    assert fit_score_s == pytest.approx(score_s, rel=1e-6)


def test_calibration_preset_document_loads_as_a_calibrated_preset():
    calibrate = pytest.importorskip("experiments.calibration.calibrate_cpu")
    compute = {"matmul_fp32_flops_per_s": 1e11, "matmul_bf16_flops_per_s": 2e11, "elementwise_bytes_per_s": 2e10,
               "copy_bytes_per_s": 1e10, "reduction_bytes_per_s": 3e10, "attention_flops_per_s": 5e10,
               "kernel_launch_overhead_s": 2e-6, "view_op_overhead_s": 1e-6, "attention_score_time_s": 5e-10,
               "host_copy_bytes_per_s": 4e9, "host_copy_latency_s": 1e-5}
    a2a = {w: {n: all_to_all_time_s(n, w, latency_s=1e-4, bandwidth_bytes_per_s=2e9) for n in calibrate.A2A_BYTES}
           for w in calibrate.WORLDS}
    preset = preset_from_dict(calibrate.build_preset(compute, a2a))
    assert preset.calibrated and preset.name == "cpu-gloo"
    assert preset.device.peak_flops_per_s == 1e11
    assert preset.device.efficiency["attention"].flops == pytest.approx(0.5)
    assert preset.device.efficiency["memory"].memory == pytest.approx(0.5)
    assert preset.device.view_op_overhead_s == 1e-6
    assert preset.device.attention_score_time_s == 5e-10
    assert preset.intra_node.latency_s == pytest.approx(0.5e-4)  # alpha split over two hops
    assert preset.intra_node.bandwidth_bytes_per_s == pytest.approx(2e9)
    # host memory: the RAM; its link: the measured offload copy
    assert preset.host_memory_kind == "memory" and preset.host_memory_bytes >= 4 * preset.device.memory_bytes
    assert (preset.host_memory_link.bandwidth_bytes_per_s, preset.host_memory_link.latency_s) == (4e9, 1e-5)


def test_calibration_step_factor_scales_compute_but_not_the_measured_link():
    calibrate = pytest.importorskip("experiments.calibration.calibrate_cpu")
    validate = pytest.importorskip("experiments.calibration.validate_simulator")
    from simulator import Workload, simulate
    from simulator.builder import ProgramBuilder

    compute = {"matmul_fp32_flops_per_s": 1e11, "matmul_bf16_flops_per_s": 2e11, "elementwise_bytes_per_s": 2e10,
               "copy_bytes_per_s": 1e10, "reduction_bytes_per_s": 3e10, "attention_flops_per_s": 5e10,
               "kernel_launch_overhead_s": 2e-6, "view_op_overhead_s": 1e-6, "attention_score_time_s": 5e-10,
               "graph_call_overhead_s": 3e-5, "host_copy_bytes_per_s": 4e9, "host_copy_latency_s": 1e-5}
    a2a = {w: {n: all_to_all_time_s(n, w, latency_s=1e-4, bandwidth_bytes_per_s=2e9) for n in calibrate.A2A_BYTES}
           for w in calibrate.WORLDS}
    preset = calibrate.build_preset(compute, a2a)

    def step_s(document, with_collective: bool) -> float:
        b = ProgramBuilder()
        mm = b.compute("mm", op_class="matmul", flops=10**9, bytes_read=10**6)
        b.compute("sdpa", op_class="attention", flops=4 * 16 * 10**6, attention_scores=10**6, deps=[mm])
        b.compute("view", deps=[mm])
        if with_collective:
            b.collective("a2a", kind="all_to_all", group="sp", message_bytes=2**20, deps=[mm])
        workload = Workload(name="w", world_size=2, groups={"sp": [[0, 1]]}, ranks={0: b.build()}, symmetric=True)
        return simulate(workload, validate.cpu_gloo_cluster(2, document)).step_time_s

    scaled = calibrate.apply_step_factor(preset, 1.5)
    assert scaled["calibration"]["step_factor"] == 1.5
    assert step_s(scaled, False) == pytest.approx(1.5 * step_s(preset, False), rel=1e-9)
    collective_s = step_s(preset, True) - step_s(preset, False)
    assert collective_s > 0
    assert step_s(scaled, True) - step_s(scaled, False) == pytest.approx(collective_s, rel=1e-9)
    assert preset["calibration"]["compute"] is not scaled["calibration"]["compute"]
    assert scaled["calibration"]["compute"] == preset["calibration"]["compute"]
    assert scaled["host_memory_link"] == preset["host_memory_link"]  # measured, not scaled

