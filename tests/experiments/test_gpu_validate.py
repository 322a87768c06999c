"""``python -m experiments.gpu_validate --cpu-only``: every section of the GPU validation on CPU gloo ranks.

One run (`main` with ``--cpu-only``: 2-rank Ulysses and ring and a planned SP 1 step of a tiny Hugging Face Llama,
well under a minute on 2 cores) must pass: the loss and every gradient equal single-device training, the profiler
saw fused attention forward and backward (and the ring's blocks ran it), the forced-math control was rejected, the
simulator's step and peak sit beside the measured ones (not judged on CPU), the planner chose a technique under a
target below the plain step's peak, and the calibration record reads back as a cpu-gloo preset. The kernel check
itself is shown failing on math paths (a list of names, and SDPA's math backend forced on this CPU); the GPU side
that needs no GPU (the cases, the GPU preset's document and its calibration record) is checked here too.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from experiments import gpu_validate as gv
from experiments.gpu_validate import ProfiledOp, check_kernels


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_validate")
    code = gv.main(["--cpu-only", "--out", str(out)])
    return code, out, json.loads((out / "gpu_validate.json").read_text())


@pytest.mark.slow  # the run: about 40 s on 2 cores
def test_cpu_only_run_passes_every_section(run):
    code, out, results = run
    assert code == 0, [r for r in results["summary"] if not r["passed"]]
    assert results["passed"] and results["mode"] == "cpu-only" and results["preset"] == "cpu-gloo"
    assert results["device"]["type"] == "cpu" and results["errors"] == {}
    names = ["sp2-ulysses", "sp2-ring", "sp1-planned"]
    for section in ("exactness", "prediction"):
        assert [r["case"] for r in results[section]] == names and all(r["passed"] for r in results[section])
    kernels = {k["case"]: k for k in results["kernels"]}
    assert list(kernels) == [*names, "control: forced math SDPA"]
    for name in names:
        k = kernels[name]
        assert k["passed"] and k["problems"] == []
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in k["attention"]
        assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in k["attention"]
    ring = kernels["sp2-ring"]["ring_blocks"]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu in autosp.ring.forward.compute" in ring
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward in autosp.ring.backward.compute" in ring
    assert kernels["sp2-ulysses"]["ring_blocks"] == []
    control = kernels["control: forced math SDPA"]
    assert control["passed"] and any("aten::_scaled_dot_product_attention_math" in n for n in control["notes"])
    for row in results["summary"]:
        assert {"section", "case", "passed", "detail"} <= row.keys()
    assert all("not judged on CPU" in r["detail"] for r in results["summary"] if r["section"] == "c prediction")
    assert (out / "summary.md").is_file() and (out / "summary.csv").is_file()
    assert sorted(p.name for p in (out / "workloads").iterdir()) == sorted(f"{n}.json" for n in names)


@pytest.mark.slow  # the run: about 40 s on 2 cores
def test_cpu_only_prediction_beside_measurement_and_the_plan_fits(run):
    results = run[2]
    for p in results["prediction"]:
        assert p["preset"] == "cpu-gloo" and p["measured_step_s"] > 0 and p["simulated_step_s"] > 0
        assert p["measured_peak_bytes"] > 0 and p["simulated_peak_bytes"] > 0
        assert {"step_error_pct", "peak_error_pct"} <= p.keys()
    planned = next(p for p in results["prediction"] if p["case"] == "sp1-planned")
    plan = planned["plan"]
    assert plan["fits"] and plan["predicted_peak_bytes"] <= plan["target_bytes"]
    assert any(plan["options"].get(k) != v for k, v in gv.PLAIN.items()) or plan["options"].get(
        "activation_offload") == "on", plan  # the target is below the plain step's peak: a technique was chosen
    assert all(p["plan"] is None for p in results["prediction"] if p["case"] != "sp1-planned")


@pytest.mark.slow  # the run: about 40 s on 2 cores
def test_cpu_only_calibration_record_reads_back_as_the_cpu_gloo_preset(run):
    from experiments.calibration.validate_simulator import cpu_gloo_cluster
    from simulator.hardware import preset_from_dict

    out, results = run[1], run[2]
    record_path = out / "calibration" / "cpu-gloo.json"
    assert results["calibration"]["passed"] and results["calibration"]["path"] == str(record_path)
    record = json.loads(record_path.read_text())
    preset = preset_from_dict(record)
    assert preset.name == "cpu-gloo" and preset.calibrated
    assert record["device"]["name"] == results["device"]["name"]
    calibration = record["calibration"]
    assert calibration["device"]["type"] == "cpu" and calibration["preset"] == "cpu-gloo"
    assert calibration["step_factor_of_this_run"] > 0 and calibration["timings_judged"] is False
    assert [c["case"] for c in calibration["cases"]] == ["sp2-ulysses", "sp2-ring", "sp1-planned"]
    assert "fit_per_world" in calibration  # the tracked preset's calibration kept: cpu_gloo_cluster reads it
    assert cpu_gloo_cluster(2, record).world_size >= 2


def _ops(*names, ring_block="", quadratic=False):
    return [ProfiledOp(name=n, ring_block=ring_block, quadratic=quadratic) for n in names]


FUSED = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def test_kernel_check_fails_on_math_and_quadratic_paths():
    assert check_kernels("fused", _ops(*FUSED, "aten::mm", "aten::_log_softmax", "SafeSoftmaxBackward0")).passed
    math = check_kernels("math", _ops("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_attention_math",
                                      "aten::bmm", "aten::_softmax", "aten::_softmax_backward_data"))
    assert not math.passed
    text = " ".join(math.problems)
    assert "math attention" in text and "aten::_softmax" in text and "no fused attention op in the forward" in text
    # bmm + softmax without the math op's name (a decomposed attention): still rejected
    assert not check_kernels("decomposed", _ops(*FUSED, "aten::bmm", "aten::_softmax")).passed
    # a GPU kernel named softmax (not the loss's log-softmax) is a math path too
    gpu = [*_ops(*FUSED), ProfiledOp(name="triton_per_fused__softmax_3", device=True),
           ProfiledOp(name="triton_red_fused__log_softmax_1", device=True)]
    assert check_kernels("gpu", gpu).problems == [
        "a softmax outside fused attention (matmul + softmax attention): triton_per_fused__softmax_3"]
    inside = ProfiledOp(name="cudnn_sdpa_softmax_kernel", device=True, in_fused_attention=True)
    assert check_kernels("gpu", [*_ops(*FUSED), inside]).passed  # a fused kernel's internals are not judged
    # ring blocks as plain matmuls, or without a fused kernel
    ring_math = check_kernels("ring", _ops(*FUSED) + _ops("aten::matmul", "aten::logsumexp",
                                                          ring_block="autosp.ring.forward.compute"), ring=True)
    assert any("ring blocks computed as plain matmuls" in p for p in ring_math.problems)
    assert "no ring block ran a fused attention kernel" in ring_math.problems
    ring_ok = check_kernels("ring", _ops(*FUSED) + _ops(FUSED[0], ring_block="autosp.ring.forward.compute")
                            + _ops(FUSED[1], ring_block="autosp.ring.backward.compute"), ring=True)
    assert ring_ok.passed and len(ring_ok.ring_blocks) == 2
    quadratic = check_kernels("mask", _ops(*FUSED) + _ops("aten::add", quadratic=True))
    assert quadratic.problems == ["quadratic tensors ([.., S, S]) read by aten::add"]
    offload = check_kernels("offload", _ops(*FUSED), offload=True)
    assert offload.problems == ["the plan offloads activations and no offload copy ran"]
    assert check_kernels("offload", _ops(*FUSED, "autosp_testbed::offload_to_host",
                                         "autosp_testbed::reload_from_host"), offload=True).passed


def test_kernel_check_fails_on_a_forced_math_path_on_this_cpu():
    found = check_kernels("forced", gv.math_control_ops("cpu"))
    assert not found.passed
    assert any("aten::_scaled_dot_product_attention_math" in p for p in found.problems)
    assert any(p.startswith("quadratic tensors") for p in found.problems)
    control = gv.math_control("cpu")
    assert control.passed and control.notes


def test_gpu_cases_fit_one_gpu_and_add_nccl_cases_with_two():
    one, two = gv.cases("cuda", 1), gv.cases("cuda", 2)
    assert [c.name for c in one] == ["sp1-planned", "sp1-bf16"] and all(c.world == 1 for c in one)
    assert [c.name for c in two] == [*(c.name for c in one), "sp2-ulysses", "sp2-ring", "sp2-bf16"]
    for case in two:
        assert case.compiler == "inductor" and case.world <= 2 and case.steps >= 3
        assert case.tolerance == (gv.BF16_TOL if case.dtype == "bfloat16" else gv.GPU_FP32_TOL)
        heads = case.sizes["heads"]
        assert max(case.sizes["hidden"] // heads, heads) < case.quadratic_from  # q/k/v are never "quadratic"
    assert set(gv.CASE_NAMES) == {c.name for c in two} | {c.name for c in gv.cases("cpu")}


@pytest.mark.parametrize("name", ["h100-sxm", "h200-sxm", "a100-80gb-sxm", "gh200", "b200", "mi300x"])
def test_gpu_preset_document_reads_back_as_the_preset(name):
    from autosp.plan.cluster_file import cluster_from_dict
    from simulator.hardware import get_preset, preset_from_dict

    preset = get_preset(name)
    document = json.loads(json.dumps(gv.preset_document(preset)))
    read = preset_from_dict(document)
    assert read.device == preset.device and read.intra_node == preset.intra_node
    assert read.host_memory_link == preset.host_memory_link and read.devices_per_node == preset.devices_per_node
    assert cluster_from_dict({"node": document}).preset.host_link == preset.host_link


@pytest.mark.slow  # the run: about 40 s on 2 cores
def test_gpu_calibration_record_is_a_preset_and_reproduces_the_median_step(run, tmp_path):
    """Section (d) on a GPU preset, fed the CPU run's exported steps as if a GPU had measured them."""
    from autosp.plan.cluster_file import cluster_from_dict
    from simulator import Workload, simulate
    from simulator.hardware import preset_from_dict

    out, results = run[1], run[2]
    document = gv.base_document("h100-sxm")
    cases = {c.name: c for c in gv.cases("cpu")}
    runs, predictions = [], []
    for p in results["prediction"]:
        case = cases[p["case"]]
        workload = json.loads((out / "workloads" / f"{case.name}.json").read_text())
        simulated = simulate(Workload.from_dict(workload), gv.cluster_of(document, case.world)).step_time_s
        runs.append((case, workload, 3 * simulated))  # "measured": three times the preset's prediction
        predictions.append(gv.Prediction(**{**{f.name: p.get(f.name) for f in dataclasses.fields(gv.Prediction)},
                                            "preset": "h100-sxm"}))
    device = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "count": 1}
    record = gv.calibration("h100-sxm", document, predictions, runs, device, tmp_path)
    assert record.passed, record.problems
    written = json.loads((tmp_path / "calibration" / "h100-sxm.json").read_text())
    assert written["device"]["name"] == device["name"] and written["calibration"]["device"] == device
    assert written["device"]["fuses_pointwise"] is True
    assert cluster_from_dict({"node": written}).preset.device.name == device["name"]
    assert preset_from_dict(written).device.peak_flops_per_s < document["device"]["peak_flops_per_s"]
    ratios = sorted(simulate(Workload.from_dict(w), gv.cluster_of(written, c.world)).step_time_s / m
                    for c, w, m in runs)
    assert ratios[1] == pytest.approx(1.0, rel=1e-3)  # the median case's simulation is its measurement


@pytest.mark.slow  # after the run: its gloo ranks' forkserver is warm
def test_a_case_that_raises_fails_alone_with_its_story(run):
    bad = dataclasses.replace(gv.cases("cpu")[0], name="bad", model="no-such-model")
    found = gv.run_cases([bad], "cpu", "cpu-gloo", deadline=time.monotonic() + 120)
    assert found["bad"].startswith("failed: --- rank 0 ---") and "unknown model 'no-such-model'" in found["bad"]
    rows = gv.summary_rows({"exactness": [], "kernels": [], "prediction": [], "calibration": None,
                            "device": {"type": "cpu"}, "errors": {"bad": found["bad"]}})
    assert rows == [{"section": "run", "case": "bad", "passed": False, "detail": rows[0]["detail"]}]
    assert "ValueError: unknown model 'no-such-model'" in rows[0]["detail"]  # the exception, the story's last line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_gpu_run_says_so(capsys, tmp_path):
    assert gv.main(["--out", str(tmp_path)]) == 1
    assert "no CUDA GPU visible" in capsys.readouterr().err and not any(tmp_path.iterdir())
