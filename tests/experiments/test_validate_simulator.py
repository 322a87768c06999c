"""The simulator validation (measured vs simulated step time and peak memory) at its smallest size, and the tracker.

The errors themselves are not asserted to be small: the machine is shared and noisy. What is checked is that
the table is complete and finite and that each error is computed from the measured and simulated values.
"""

from __future__ import annotations

import math

import pytest
import torch

from experiments.calibration import validate_simulator as vs
from experiments.cpu.peak_memory import PeakMemory


def test_peak_memory_counts_new_storages_once_and_frees_them():
    x = torch.randn(1000)  # 4000 bytes, static
    with PeakMemory(static=[x]) as pm:
        a = x * 2  # +4000
        b = a.view(10, 100)  # a view: nothing new
        c = torch.empty(2000)  # +8000: peak 12000 live
        del c
        a.add_(1)  # in place: nothing new
        del a, b
    assert pm.static_bytes == 4000
    assert pm.peak_live_bytes == 12000
    assert pm.peak_bytes == 16000
    assert pm.live_bytes == 0
    assert pm.breakdown()["by_op"] == {"mul": 4000, "empty": 8000}


def test_peak_memory_sees_the_ops_of_a_compiled_graph():
    torch._dynamo.reset()
    layer = torch.nn.Linear(16, 16)
    step = torch.compile(lambda x: torch.relu(layer(x)).sum(), backend="aot_eager", fullgraph=True)
    x = torch.randn(32, 16)
    step(x).backward()
    with PeakMemory(static=list(layer.parameters())) as pm:
        step(x).backward()
    # The forward output of the linear layer [32, 16] fp32 is live at some point.
    assert pm.peak_live_bytes >= 32 * 16 * 4
    torch._dynamo.reset()


@pytest.mark.timeout(300)
def test_validate_simulator_smallest_table_is_complete_and_finite(tmp_path):
    cases = vs.sweep(smallest=True)
    assert len(cases) == 1 and cases[0].world == 2
    rows = vs.run_validation(cases, warmup=2, steps=3, progress=False)
    assert len(rows) == 1
    row = rows[0]
    for key, _, _ in vs.COLUMNS[1:]:
        assert math.isfinite(row[key]), key
    assert row["measured_step_ms"] > 0 and row["simulated_step_ms"] > 0
    assert row["measured_peak_mib"] > 0 and row["simulated_peak_mib"] > 0
    assert row["step_error_pct"] == pytest.approx(
        100 * (row["simulated_step_ms"] - row["measured_step_ms"]) / row["measured_step_ms"])
    assert row["peak_error_pct"] == pytest.approx(
        100 * (row["simulated_peak_mib"] - row["measured_peak_mib"]) / row["measured_peak_mib"])
    s = vs.summary(rows)
    assert s["step_median_abs_error_pct"] == pytest.approx(abs(row["step_error_pct"]))
    vs.write_outputs(rows, tmp_path)
    table = (tmp_path / "validation.md").read_text()
    assert row["config"] in table and "median |error|" in table
    assert (tmp_path / "validation.csv").read_text().count("\n") == 2


def test_graph_call_overhead_is_charged_once_per_phase_before_its_first_op():
    import dataclasses

    from simulator.builder import ProgramBuilder
    from simulator.hardware import get_preset
    from simulator.schedule import compile_program

    b = ProgramBuilder()
    for phase in ("forward", "forward", "backward", "backward"):
        b.compute(f"{phase}.op", flops=1000, op_class="matmul", phase=phase)
    program = b.build()
    device = get_preset("a100-80gb-sxm").device
    base = compile_program(program, device).durations_s
    charged = compile_program(program, dataclasses.replace(device, graph_call_overhead_s=1e-3)).durations_s
    assert [c - d for c, d in zip(charged, base, strict=True)] == pytest.approx([1e-3, 0.0, 1e-3, 0.0])


def test_cpu_gloo_cluster_shares_cores_when_ranks_outnumber_them(tmp_path):
    import json

    from simulator.hardware import CPU_GLOO_JSON

    document = json.loads(CPU_GLOO_JSON.read_text())
    document["calibration"]["cpus"] = 2
    path = tmp_path / "preset.json"
    path.write_text(json.dumps(document))
    two, four = vs.cpu_gloo_cluster(2, path), vs.cpu_gloo_cluster(4, path)
    assert four.device.peak_flops_per_s == pytest.approx(two.device.peak_flops_per_s / 2)
    assert four.device.kernel_launch_overhead_s == pytest.approx(two.device.kernel_launch_overhead_s * 2)
    fit = document["calibration"]["fit_per_world"]["4"]
    assert four.preset.intra_node.latency_s == pytest.approx(fit["alpha_s"] / 2)
