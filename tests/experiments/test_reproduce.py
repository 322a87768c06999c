"""`python -m experiments.reproduce --quick` runs and writes every table, plot and trace it promises."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import pytest

from experiments.paper_scale.simulate import simulate_autosp_step

pytestmark = pytest.mark.timeout(1800)  # the first test to use quick_results pays for the whole quick run


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    proc = subprocess.run([sys.executable, "-m", "experiments.reproduce", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _rows(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_reproduce_max_seq_len_table_has_every_system_and_model(quick_results):
    rows = _rows(quick_results / "max-seq-len.csv")
    assert {(r["model"], r["system"]) for r in rows} == {
        (m, s) for m in ("llama-3.2-3b", "llama-3.1-8b", "llama-2-13b")
        for s in ("zero3", "ring_attention", "ulysses", "autosp", "ulysses+ckpt")
    }
    for r in rows:  # every system simulated (baselines: see experiments.paper_scale.baselines)
        simulated = float(r["simulated_tokens"])
        assert math.isfinite(simulated) and simulated > 0
        if r["system"] == "ulysses+ckpt":  # no published figure
            assert r["published_tokens"] == "" and r["simulated_over_published"] == ""
            continue
        assert float(r["simulated_over_published"]) == pytest.approx(simulated / float(r["published_tokens"]), 1e-2)
    assert (quick_results / "max-seq-len.md").read_text().count("|") > 20


@pytest.mark.slow
def test_reproduce_iteration_table_records_simulated_against_published(quick_results):
    rows = _rows(quick_results / "iteration-time.csv")
    assert {(int(r["seq_len"]), r["system"]) for r in rows} == {
        (s, system) for s in (8000, 24000, 90000)
        for system in ("zero3", "ring_attention", "ulysses", "autosp", "ulysses+ckpt")}
    for r in rows:
        assert r["simulated_s"] or r["note"] == "simulated OOM", r
        assert math.isfinite(float(r["simulated_peak_gib"]))
        if r["simulated_s"]:
            assert math.isfinite(float(r["simulated_s"]))
        if r["simulated_s"] and r["published_s"] not in ("OOM", ""):  # ulysses+ckpt has no published figure
            assert float(r["simulated_over_published"]) > 0
    autosp_8k = next(r for r in rows if r["system"] == "autosp" and r["seq_len"] == "8000")
    assert autosp_8k["simulated_s"]


@pytest.mark.slow
def test_reproduce_plots_and_traces_exist_and_parse(quick_results):
    from experiments.reproduce import STEP_FILES

    for png in ("max-seq-len.png", STEP_FILES["timeline"], STEP_FILES["memory"]):
        assert (quick_results / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((quick_results / STEP_FILES["trace"]).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert any(e.get("ph") == "X" for e in events)


def test_paper_scale_layer_extrapolation_matches_a_direct_trace():
    # See Note [Layer extrapolation]: x(L) = x(1) + (L-1)(x(2) - x(1)), checked against L = 4 traced directly.
    import torch

    from autosp.export import export_workload, trace_fake_step
    from experiments.models import PAPER_MODELS
    from experiments.paper_scale.simulate import ADAM_BYTES_PER_PARAMETER_BYTE
    from simulator import Cluster, simulate

    model = PAPER_MODELS["llama-3.2-3b"]
    seq_len, cluster = 4096, Cluster.from_preset("a100-80gb-sxm")

    def direct(layers):
        import transformers

        torch._dynamo.reset()
        compiled, pbytes = trace_fake_step(lambda: transformers.LlamaForCausalLM(model.hf_config(num_layers=layers)),
                                           seq_len=seq_len, sp_size=8, vocab_size=model.vocab_size)
        w = export_workload(compiled.report.aot_graphs, name="x", sp_size=8, parameter_bytes=pbytes,
                            optimizer_bytes_per_parameter_byte=ADAM_BYTES_PER_PARAMETER_BYTE, zero_shards=8)
        r = simulate(w, cluster)
        return r.step_time_s, r.ranks[0].peak_memory_bytes - r.ranks[0].static_memory_bytes

    (t1, m1), (t2, m2), (t4, m4) = direct(1), direct(2), direct(4)
    assert t1 + 3 * (t2 - t1) == pytest.approx(t4, rel=0.02)
    assert m1 + 3 * (m2 - m1) == pytest.approx(m4, rel=0.05)
    step = simulate_autosp_step("llama-3.2-3b", seq_len)
    assert step.step_time_s > 0 and step.peak_memory_bytes > step.static_memory_bytes


MEASURED = {"autosp", "autosp-nosac", "ulysses", "ulysses+ckpt", "ring", "zero3", "deepspeed-autosp"}


@pytest.mark.slow
def test_reproduce_measured_cpu_table_has_every_system_with_finite_numbers(quick_results):
    rows = _rows(quick_results / "measured-cpu.csv")
    assert {r["system"] for r in rows} == MEASURED
    assert {int(r["ranks"]) for r in rows} == {2}
    for r in rows:
        for column in ("first_step_s", "median_step_ms", "ratio_to_ulysses", "loss_error", "grad_max_rel_error",
                       "peak_mib"):
            assert math.isfinite(float(r[column])), (r["system"], column, r[column])
        assert float(r["median_step_ms"]) > 0 and float(r["peak_mib"]) > 0
        if r["system"] != "deepspeed-autosp":  # the exact systems
            assert float(r["grad_max_rel_error"]) < 1e-3 and "inexact" not in r["note"], r
        assert int(r["graph_breaks"]) >= 0 and int(r["recompiles"]) >= 0
        assert ("graph breaks" in r["note"]) == (int(r["graph_breaks"]) > 0), r
    for fullgraph in ("autosp", "ulysses", "ulysses+ckpt"):  # compiled whole: no graph break
        assert next(r for r in rows if r["system"] == fullgraph)["graph_breaks"] == "0"
    ulysses = next(r for r in rows if r["system"] == "ulysses")
    assert float(ulysses["ratio_to_ulysses"]) == pytest.approx(1.0)
    assert float(next(r for r in rows if r["system"] == "deepspeed-autosp")["grad_max_rel_error"]) > 1e-3


@pytest.mark.slow
def test_reproduce_memory_cap_table_finds_a_length_for_every_system(quick_results):
    rows = _rows(quick_results / "memory-cap.csv")
    assert {r["system"] for r in rows} == MEASURED
    for r in rows:
        probes = [p.split(":") for p in r["probes_tokens_mib"].split(", ")]
        cap = float(r["cap_mib"])
        fits = [int(s) for s, mib in probes if float(mib) <= cap]
        assert int(r["max_seq_len"]) == max(fits, default=0), r
    assert (quick_results / "memory-cap.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_paper_builds_from_quick_results_with_every_placeholder_filled(quick_results, tmp_path):
    from experiments.paper import PLACEHOLDER, build_paper

    built = build_paper(quick_results, tmp_path / "build")
    text = built.read_text()
    assert not PLACEHOLDER.search(text) and "{{" not in text
    assert "| system | ranks | seq_len |" in text  # the measured-cpu table
    for image in ("max-seq-len.png", "measured-cpu.png", "memory-cap.png"):
        assert f"(figures/{image})" in text
        assert (tmp_path / "build" / "figures" / image).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_reproduce_run_json_records_the_command_line_and_what_the_step_shows(quick_results):
    run = json.loads((quick_results / "run.json").read_text())
    assert run["argv"] == ["--quick", "--out", str(quick_results)]
    assert run["command"] == f"python -m experiments.reproduce --quick --out {quick_results}"
    assert set(run["tables"]) == {"max-seq-len", "iteration-time", "measured-cpu", "memory-cap"}
    assert {t["command"] for t in run["tables"].values()} == {run["command"]}
    assert run["simulated_step"]["model"] == run["iteration_model"]


def test_reproduce_help_shows_defaults_and_what_quick_changes_without_markup(capsys):
    from experiments.reproduce import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "(default: results)" in text and "what --quick changes" in text and "1024 -> 8192" in text
    assert "``" not in text and "`" not in text


def test_reproduce_run_json_keeps_the_commands_of_tables_an_only_run_did_not_redo(tmp_path):
    from experiments.reproduce import _write_run_json

    path = tmp_path / "run.json"
    _write_run_json(path, {"command": "full"}, {"a": {"command": "full", "seconds": 1.0},
                                                "b": {"command": "full", "seconds": 2.0}})
    _write_run_json(path, {"command": "only b"}, {"b": {"command": "only b", "seconds": 3.0}})
    run = json.loads(path.read_text())
    assert run["command"] == "only b" and run["commands"] == ["full", "only b"]
    assert run["table_s"] == {"a": 1.0, "b": 3.0}


def test_autosp_max_seq_len_search_reports_a_fit_at_its_ceiling(monkeypatch):
    from types import SimpleNamespace

    from experiments.paper_scale import simulate

    limit = {"tokens": 10**9}
    monkeypatch.setattr(simulate, "simulate_autosp_step",
                        lambda model, seq_len, **_: SimpleNamespace(fits=seq_len <= limit["tokens"]))
    at_ceiling = simulate.max_trainable_seq_len("llama-3.1-8b", granularity=1024, high=16384)
    assert (at_ceiling.max_seq_len, at_ceiling.hit_upper_bound, str(at_ceiling)) == (16384, True, "≥ 16384")
    limit["tokens"] = 5000
    below = simulate.max_trainable_seq_len("llama-3.1-8b", granularity=1024, high=16384)
    assert (below.max_seq_len, below.hit_upper_bound, str(below)) == (4096, False, "4096")


def test_paper_calibration_placeholders_come_from_the_preset(tmp_path):
    from experiments.paper import build_paper

    preset = tmp_path / "preset.json"
    preset.write_text(json.dumps({"calibration": {
        "date": "d", "step_factor": 1.25, "reference_step": {"config": "P=2 S=512 h=64 overlap=on"},
        "all_to_all_in_step_s": {"2": {"8": 0.3, "16": 0.2}}, "all_to_all_isolated_s": {"2": {"8": 0.1, "16": 0.1}},
        "compute": {"attention_samples": [{"head_dim": 32}, {"head_dim": 16}, {"head_dim": 32}]}}}))
    source = tmp_path / "paper.md"
    source.write_text("{{calibration:date}} {{calibration:step_factor}} {{calibration:reference_step}} / "
                      "{{calibration:all_to_all_in_step_over_isolated}} / {{calibration:attention_head_dims}}\n")
    text = build_paper(tmp_path, tmp_path / "out", source, preset).read_text()
    assert text == "d 1.25 2 ranks, 512 tokens, hidden 64, overlap on / 2.0–3.0 / 16, 32\n"


def test_paper_placeholders_are_filled_from_the_results_folder(tmp_path):
    from experiments.paper import MissingResult, build_paper

    results = tmp_path / "results"
    results.mkdir()
    (results / "t.md").write_text("| a | b |\n|---|---|\n| x | 1 |\n")
    (results / "t.csv").write_text("a,b\nx,1\ny,2\n")
    (results / "f.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (results / "run.json").write_text(json.dumps({"preset": "quick", "ranks": [2, 4], "t": {"x": 1.5}}))
    source = tmp_path / "paper.md"
    source.write_text("{{table:t}}\n{{cell:t:a=y:b}} {{run:preset}} {{run:ranks}} {{run:t}}\n{{figure:f.png|cap}}\n"
                      "{{table:absent|optional}}\n")
    text = build_paper(results, tmp_path / "out", source).read_text()
    assert text.splitlines()[:4] == ["| a | b |", "|---|---|", "| x | 1 |", "2 quick 2, 4 x 1.5"]
    assert "![cap](figures/f.png)" in text and (tmp_path / "out" / "figures" / "f.png").exists()
    assert "not in the results folder" in text
    source.write_text("{{table:absent}}")
    with pytest.raises(MissingResult, match="absent.md is missing"):
        build_paper(results, tmp_path / "out", source)


def test_paper_scale_baselines_simulate_every_baseline_and_ring_reuses_the_ulysses_traces():
    from experiments.paper_scale.baselines import SIMULATED_BASELINES, simulate_baseline_step
    from experiments.paper_scale.simulate import TraceCache

    cache = TraceCache()
    ulysses = simulate_baseline_step("ulysses", "llama-3.2-3b", 4096, cache=cache)
    assert ulysses.sp_size == 8 and ulysses.fits
    assert ulysses.step_time_s > 0 and ulysses.peak_memory_bytes > ulysses.static_memory_bytes
    ring = simulate_baseline_step("ring_attention", "llama-3.2-3b", 4096, cache=cache)
    assert (cache.misses, cache.hits) == (2, 2)  # ring attention is a rewrite of the same two traces
    assert ring.static_memory_bytes == ulysses.static_memory_bytes and ring.step_time_s > 0
    assert ring.peak_memory_bytes >= ulysses.peak_memory_bytes  # plus its receive buffers
    zero3 = simulate_baseline_step("zero3", "llama-3.2-3b", 4096, cache=cache)
    assert zero3.sp_size == 1 and zero3.static_memory_bytes < ulysses.static_memory_bytes  # every state sharded
    assert zero3.step_time_s > ulysses.step_time_s  # each rank computes the whole sequence
    ckpt = simulate_baseline_step("ulysses+ckpt", "llama-3.2-3b", 4096, cache=cache)
    assert ckpt.static_memory_bytes == ulysses.static_memory_bytes
    assert ckpt.peak_memory_bytes < ulysses.peak_memory_bytes  # per-layer recomputation keeps less
    assert ckpt.step_time_s > ulysses.step_time_s  # ... and recomputes the forward in backward
    assert set(SIMULATED_BASELINES) == {"zero3", "ring_attention", "ulysses", "ulysses+ckpt"}
    with pytest.raises(ValueError, match="ulysses"):
        simulate_baseline_step("megatron", "llama-3.2-3b", 4096)


def test_paper_scale_search_runs_on_memory_above_static():
    from experiments.paper_scale.baselines import search_max_seq_len
    from experiments.paper_scale.simulate import SimulatedStep

    def stepper(static):  # 1 MB per token above static memory, 80 GB capacity
        return lambda length: SimulatedStep(model="m", seq_len=length, sp_size=8, step_time_s=1.0,
                                            peak_memory_bytes=static + 1_000_000 * length, static_memory_bytes=static,
                                            capacity_bytes=80_000_000_000)

    # 30 GB static: 50 GB left is 50_000 tokens; the first probe's proportional guess lands next to it
    fit, converged, probes = search_max_seq_len(stepper(30_000_000_000), granularity=1024, start=8192,
                                                max_len=262144, max_probes=6)
    assert (fit, converged) == (49152, True) and len(probes) == 3
    # static memory alone over the capacity: nothing fits, after one probe
    fit, converged, probes = search_max_seq_len(stepper(90_000_000_000), granularity=1024, start=8192,
                                                max_len=262144, max_probes=6)
    assert (fit, converged, len(probes)) == (0, True, 1)


@pytest.mark.parametrize("peak, start, answer", [
    (lambda s: 500_000 + 2_400 * s, 512, 3840),                            # linear: the cap is at 3958 tokens
    (lambda s: 6_000_000 + 100 * s if s < 2000 else 2_400 * s, 512, 4096),  # flat, then steeper (cap at 4166)
    (lambda s: 1_000_000 + 2_400 * s, 65536, 3584),                         # the first probe already fails
])
def test_memory_cap_search_finds_the_longest_fitting_length_in_few_probes(peak, start, answer):
    from experiments.cpu.memory_cap import next_probe

    probes, length = [], start
    while length is not None:
        probes.append((length, peak(length)))
        length = next_probe(probes, 10_000_000, granularity=256, max_len=65536)
        assert len(probes) <= 8, probes
    assert max(s for s, p in probes if p <= 10_000_000) == answer
    assert min(s for s, p in probes if p > 10_000_000) == answer + 256
