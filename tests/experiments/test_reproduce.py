"""`python -m experiments.reproduce --quick` runs and writes every table, plot and trace it promises."""

from __future__ import annotations

import csv
import json
import math
import statistics
import subprocess
import sys

import pytest

from experiments.paper_scale.simulate import simulate_step
from experiments.reproduction.common import published_figures
from simulator.strategies import STRATEGIES

pytestmark = pytest.mark.timeout(1800)  # the first test to use quick_results pays for the whole quick run


QUICK_MODELS = ("llama-3.1-8b",)
"""The paper model the quick run simulates: one of the three (the paper's placeholders read Llama-3.1-8B, the
iteration model), so that ``--models`` is exercised and the suite's time stays within budget (the full run does
all three)."""


QUICK_CPU_SYSTEMS = ("autosp", "ulysses", "ulysses+ckpt", "deepspeed-autosp", "autosp-ring", "autosp-sac")
"""The CPU-measured rows the quick run measures (``--cpu-systems``): those the write-up's sentences and the tables'
claims read (AutoSP, the reference and the tuned baseline, DeepSpeed's AutoSP, the planner) and the compiled ring.
The other systems' exactness is tested on their own (tests/experiments/test_baselines.py), and each table's rows of
every system without processes (test_measured_cpu_runs_a_system_only_on_the_ranks_it_declares...)."""
QUICK_ARGV = ["--quick", "--models", *QUICK_MODELS, "--cpu-systems", *QUICK_CPU_SYSTEMS]


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    proc = subprocess.run([sys.executable, "-m", "experiments.reproduce", *QUICK_ARGV, "--out", str(out)],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _rows(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_reproduce_max_seq_len_table_has_every_system_of_the_models_asked_for(quick_results):
    from simulator.search import STOP_REASONS

    rows = _rows(quick_results / "max-seq-len.csv")
    assert {(r["model"], r["system"]) for r in rows} == {
        (m, s) for m in QUICK_MODELS for s in STRATEGIES.table("paper-scale")
    }
    errors = []
    for r in rows:  # every system simulated (see experiments.paper_scale.simulate)
        simulated = float(r["simulated_nominal"])
        assert math.isfinite(simulated) and simulated > 0
        assert r["stopped"] in STOP_REASONS
        assert r["simulated_tokens"].endswith(r["simulated_nominal"])
        assert r["simulated_tokens"].startswith("≥") == (r["stopped"] in ("ceiling", "probe_budget"))
        shortest, longest = (int(x.lstrip("≥< ")) for x in r["band_tokens"].split(" – "))
        assert shortest <= simulated <= longest
        if r["system"] == "ulysses+ckpt":  # no published figure
            assert r["published_tokens"] == "" and r["error_pct"] == ""
            continue
        error = 100 * (simulated - float(r["published_tokens"])) / float(r["published_tokens"])
        assert float(r["error_pct"]) == pytest.approx(error, abs=0.51)
        errors.append(abs(error))
    run = json.loads((quick_results / "run.json").read_text())
    summary = run["max_seq_len_summary"]
    published = [r for r in published_figures() if r["figure"] == "max_seq_len" and r["model"] in QUICK_MODELS]
    assert summary["compared"] == len(published) == len(errors) == 4
    assert summary["median_abs_error_pct"] == pytest.approx(statistics.median(errors), abs=0.6)
    text = (quick_results / "max-seq-len.md").read_text()
    assert text.count("|") > 20 and "Median |error|" in text and "NOT the stated configuration" in text


@pytest.mark.slow
def test_reproduce_throughput_table_shows_tokens_per_gpu_beside_published_seconds(quick_results):
    rows = _rows(quick_results / "throughput.csv")
    assert {(int(r["seq_len"]), r["system"]) for r in rows} == {
        (s, system) for s in (8000, 24000, 90000)
        for system in STRATEGIES.table("paper-scale")}
    assert "simulated_over_published" not in rows[0]  # no ratio of unlike things
    for r in rows:
        assert r["simulated_tokens_per_s_per_gpu"] or r["note"] == "simulated OOM", r
        assert math.isfinite(float(r["simulated_peak_gib"]))
        if r["simulated_tokens_per_s_per_gpu"]:
            per_gpu = int(r["seq_len"]) / (1 if r["system"] == "zero3" else 8)
            assert float(r["simulated_tokens_per_s_per_gpu"]) == pytest.approx(
                per_gpu / float(r["simulated_step_s"]), rel=2e-3)
    published = {(r["seq_len"], r["system"]): r["published_iteration_s"] for r in rows}
    assert published[("8000", "autosp")] == "9" and published[("90000", "zero3")] == "OOM"
    assert "batch size" in (quick_results / "throughput.md").read_text()


@pytest.mark.slow
def test_reproduce_plots_and_traces_exist_and_parse(quick_results):
    from experiments.reproduction.simulated_step import STEP_FILES

    for png in ("max-seq-len.png", STEP_FILES["timeline"], STEP_FILES["memory"]):
        assert (quick_results / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((quick_results / STEP_FILES["trace"]).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert any(e.get("ph") == "X" for e in events)


@pytest.fixture(scope="module")
def paper_cache():
    """One `TraceCache` for this module's paper-scale steps of Llama-3.2-3B at 4,096 tokens: AutoSP's one- and
    two-layer traces serve both the direct traces of the depth extrapolation and AutoSP's extrapolated step."""
    from experiments.paper_scale.simulate import TraceCache

    return TraceCache()


def test_paper_scale_layer_extrapolation_matches_a_direct_trace(paper_cache, monkeypatch):
    # See Note [Depth extrapolation] in simulator/max_length.py: x(L) = x(1) + (L-1)(x(2) - x(1)), checked against L = 4 traced directly,
    # each with the whole step (gradient reduction and optimizer step of its own parameters).
    from dataclasses import replace

    from experiments.models import PAPER_MODELS
    from experiments.paper_scale.simulate import step_workload
    from simulator import Cluster, simulate

    model = PAPER_MODELS["llama-3.2-3b"]
    seq_len, cluster = 4096, Cluster.from_preset("a100-80gb-sxm")

    def direct(layers):
        r = simulate(step_workload("autosp", model, seq_len, layers, cache=paper_cache), cluster)
        return r.step_time_s, r.ranks[0].peak_memory_bytes - r.ranks[0].static_memory_bytes

    (t1, m1), (t2, m2), (t4, m4) = direct(1), direct(2), direct(4)
    assert t1 + 3 * (t2 - t1) == pytest.approx(t4, rel=0.02)
    assert m1 + 3 * (m2 - m1) == pytest.approx(m4, rel=0.05)
    # simulate_step's default depth ("full") traces the whole model, here Llama-3.2-3B cut to 4 layers: its step is
    # the direct 4-layer trace's (from the cache; a trace of all 28 layers would take half a minute)
    monkeypatch.setitem(PAPER_MODELS, "llama-3.2-3b@4", replace(model, num_layers=4))
    step = simulate_step("autosp", "llama-3.2-3b@4", seq_len, cache=paper_cache)
    assert step.extrapolated_from is None and (step.step_time_s, step.dynamic_memory_bytes) == (t4, m4)
    assert step.step_time_s > 0 and step.peak_memory_bytes > step.static_memory_bytes


MEASURED_ORDER = STRATEGIES.table("measured-cpu")
NEEDS_4_RANKS = {"autosp-hybrid-2x2"}
"""Listed, but on the quick run's 2 ranks a row that says why it did not run."""


def _ran(rows: list[dict]) -> list[dict]:
    """The rows of the systems that ran; the others say they need 4 ranks, with every measured cell blank."""
    skipped = [r for r in rows if r["system"] in NEEDS_4_RANKS]
    assert [r["note"] for r in skipped] == ["needs 4 ranks"] * len(NEEDS_4_RANKS), skipped
    assert all(v == "" for r in skipped for k, v in r.items() if k not in ("system", "model", "ranks", "seq_len",
                                                                          "cap_mib", "note")), skipped
    return [r for r in rows if r["system"] not in NEEDS_4_RANKS]


@pytest.mark.slow
def test_reproduce_measured_cpu_table_has_every_system_asked_for_with_finite_numbers(quick_results):
    rows = _rows(quick_results / "measured-cpu.csv")
    assert [r["system"] for r in rows] == [s for s in MEASURED_ORDER if s in QUICK_CPU_SYSTEMS]
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
    for fullgraph in ("autosp", "ulysses", "ulysses+ckpt", "autosp-ring"):  # compiled whole: no graph break
        assert next(r for r in rows if r["system"] == fullgraph)["graph_breaks"] == "0"
    ulysses = next(r for r in rows if r["system"] == "ulysses")
    assert float(ulysses["ratio_to_ulysses"]) == pytest.approx(1.0)
    assert float(next(r for r in rows if r["system"] == "deepspeed-autosp")["grad_max_rel_error"]) > 1e-3


@pytest.mark.slow
def test_reproduce_memory_cap_table_finds_a_length_for_every_system_asked_for(quick_results):
    from experiments.cpu.memory_cap import PLANNER_ROW

    rows = _rows(quick_results / "memory-cap.csv")
    assert PLANNER_ROW == "autosp"  # the default compile, planned for the cap (Note [The default memory plan])
    assert [r["system"] for r in rows] == [s for s in STRATEGIES.table("memory-cap") if s in QUICK_CPU_SYSTEMS]
    planned = next(r for r in rows if r["system"] == PLANNER_ROW)
    assert f"plan at {planned['max_seq_len']}: " in planned["note"] or planned["max_seq_len"] == "0", planned
    for r in rows:
        probes = [p.split(":") for p in r["probes_tokens_mib"].split(", ")]
        cap = float(r["cap_mib"])
        fits = [int(s) for s, mib in probes if float(mib) <= cap]
        assert int(r["max_seq_len"]) == max(fits, default=0), r
    # The planner's promise: every length at which it chose a plan measured within the cap (a length with no plan
    # is a failed probe of infinite peak).  The table gives the peaks in MiB to one decimal: within 0.05 MiB.
    chosen = [float(mib) for _, mib in (p.split(":") for p in planned["probes_tokens_mib"].split(", "))
              if float(mib) != float("inf")]
    assert chosen and max(chosen) <= float(planned["cap_mib"]), planned
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
    assert run["argv"] == [*QUICK_ARGV, "--out", str(quick_results)]
    assert run["command"] == "python -m experiments.reproduce " + " ".join([*QUICK_ARGV, "--out", str(quick_results)])
    assert set(run["tables"]) == {"max-seq-len", "throughput", "measured-cpu", "memory-cap"}
    assert {t["command"] for t in run["tables"].values()} == {run["command"]}
    assert run["simulated_step"]["model"] == run["iteration_model"]


def test_reproduce_help_shows_defaults_and_what_quick_changes_without_markup(capsys):
    from experiments.reproduce import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "(default: results)" in text and "what --quick changes" in text and "1024 -> 8192" in text
    assert "``" not in text and "`" not in text


def test_reproduce_tables_are_one_registry_that_the_command_line_and_the_docs_read():
    import importlib
    import pkgutil
    import re
    from pathlib import Path

    import experiments.reproduction as reproduction
    from experiments.reproduce import DESCRIPTION, TABLE_RECORDS, build_parser
    from experiments.reproduction import BY_NAME, RECORDS, TABLES, selected

    names = [t.name for t in TABLES]
    assert len(set(names)) == len(names) == len(BY_NAME)
    declared = [getattr(importlib.import_module(f"experiments.reproduction.{m.name}"), "TABLE", None)
                for m in pkgutil.iter_modules(reproduction.__path__)]
    assert {t.name for t in declared if t is not None} == set(names)  # every declared table is registered
    only = next(a for a in build_parser()._actions if a.dest == "only")
    assert list(only.choices) == names
    assert [ln.split()[0] for ln in DESCRIPTION.splitlines() if re.match(r"  [a-z]", ln)] == names
    on_request = [t.name for t in TABLES if t.on_request]
    assert {"max-seq-len-configs", "external-fidelity", "strategies"} <= set(on_request)
    assert f"{', '.join(on_request[:-1])} and {on_request[-1]} run only with --only NAME." in DESCRIPTION
    assert selected(None) == tuple(n for n in names if n not in on_request) and selected("strategies") == (
        "strategies",)
    assert RECORDS == tuple(t.record for t in TABLES if t.summary) and set(RECORDS) < set(TABLE_RECORDS)
    from experiments.paper import producer  # the write-up's note for a missing optional table

    assert [producer(n) for n in names if n not in on_request] == ["python -m experiments.reproduce"] * (
        len(names) - len(on_request))
    assert [producer(n) for n in on_request] == [f"python -m experiments.reproduce --only {n} --out results"
                                                 for n in on_request]
    root = Path(__file__).resolve().parents[2]
    for doc in ("README.md", "docs/design.md"):
        text = (root / doc).read_text()
        assert [n for n in names if f"`{n}`" not in text] == [], doc


def test_reproduce_run_config_and_the_run_loop_build_a_table_from_its_object(tmp_path, capsys):
    import dataclasses

    from experiments.reproduce import run_config, run_tables
    from experiments.reproduction import Runner, Table
    from experiments.reproduction.run import PRESETS, SHARED

    run = run_config(["--quick", "--out", str(tmp_path), "--only", "memory-cap", "--memory-cap-mib", "4",
                      "--cpu-ranks", "2", "4", "--jobs", "2"])
    assert (run.preset, run.tables, run.memory_cap_mib, run.cpu_ranks) == ("quick", ("memory-cap",), 4.0, (2, 4))
    assert run.settings() == {**PRESETS["quick"], **SHARED, "memory_cap_mib": 4.0, "cpu_ranks": (2, 4)}
    assert run_config([]).settings() == {**PRESETS["default"], **SHARED} and run_config([]).models is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.granularity = 1

    def build(run, runner):
        return [{"system": s, "ranks": 2, "tokens": run.cap_start * (i + 1)} for i, s in enumerate(("a", "b"))]

    table = Table(name="toy", help="a toy table", build=build, simulated=False, record="toy_summary",
                  summary=lambda rows: {"longest": max(r["tokens"] for r in rows)},
                  footer=lambda rows, s: [f"{len(rows)} rows, longest {s['longest']}"],
                  plot=lambda rows, path: path.write_bytes(b"png"))
    empty = Table(name="empty", help="no rows", build=lambda run, runner: [], simulated=False, record="none",
                  summary=lambda rows: {"rows": len(rows)})
    runner = Runner(cache=None)
    tables, summaries = run_tables(run, runner, [table, empty], "cmd")
    assert summaries == {"toy_summary": {"longest": 1024}, "none": {"rows": 0}}
    assert {n: (t["command"], t["preset"], t["rows"]) for n, t in tables.items()} == {
        "toy": ("cmd", "quick", 2), "empty": ("cmd", "quick", 0)}
    assert (tmp_path / "toy.csv").read_text().splitlines() == ["system,ranks,tokens", "a,2,512", "b,2,1024"]
    assert (tmp_path / "toy.md").read_text().endswith("\n\n2 rows, longest 1024\n")
    assert (tmp_path / "toy.png").read_bytes() == b"png" and not (tmp_path / "empty.csv").exists()
    assert "## toy" in capsys.readouterr().out and runner.pool is None
    with pytest.raises(ValueError, match="record key and its summary"):
        Table(name="x", help="x", build=build, simulated=False, record="x_summary")


def test_run_named_keeps_the_rows_made_so_far_until_the_table_is_made(tmp_path):
    """A long table run one row at a time (`Runner.run_named`): after each row its rows so far are on disk, so an
    interrupted run keeps them; once every row is made the partial files are gone (the caller writes the table)."""
    from experiments.reproduction import Runner

    runner = Runner(cache=None, out=tmp_path)
    partial = tmp_path / "toy.partial.csv"
    seen = []

    def row(i):
        def make():
            seen.append(partial.read_text().splitlines() if partial.exists() else None)
            if i == 2:
                raise KeyboardInterrupt
            return {"row": f"r{i}", "tokens": 512 * (i + 1)}
        return make

    assert runner.run_named([(f"r{i}", row(i)) for i in range(2)], "toy") == [
        {"row": "r0", "tokens": 512}, {"row": "r1", "tokens": 1024}]
    assert seen == [None, ["row,tokens", "r0,512"]] and not partial.exists()
    assert not (tmp_path / "toy.partial.md").exists()
    with pytest.raises(KeyboardInterrupt):
        runner.run_named([(f"r{i}", row(i)) for i in range(3)], "toy")
    assert partial.read_text().splitlines() == ["row,tokens", "r0,512", "r1,1024"]
    assert "| r1 | 1024 |" in (tmp_path / "toy.partial.md").read_text()


def test_measured_cpu_runs_a_system_only_on_the_ranks_it_declares_and_says_why_elsewhere(tmp_path, monkeypatch):
    """The table's rows from fake gloo runs (no processes): a system the registry says cannot run on a rank count
    (Strategy.cannot_run_on) is not launched there and has a row whose note says why; the ratio is to Ulysses."""
    import experiments.launch
    from experiments.reproduce import run_config
    from experiments.reproduction import Runner, measured_cpu

    launched = []

    def fake_run_on_ranks(fn, ranks, spec, **kw):
        (name,) = spec["systems"]
        launched.append((ranks, name))
        step_s = 0.1 * (1 + len(name) % 3)
        return [{"systems": {name: {"median_step_s": step_s * (1 + rank / 10), "first_step_s": 1.0, "loss": 1.0,
                                    "loss_error": 0.0, "grad_max_rel_error": 1e-7, "peak_memory_bytes": 2**20}}}
                for rank in range(ranks)]

    monkeypatch.setattr(experiments.launch, "run_on_ranks", fake_run_on_ranks)
    run = run_config(["--quick", "--out", str(tmp_path), "--only", "measured-cpu", "--cpu-ranks", "2", "4"])
    rows = measured_cpu.build(run, Runner(cache=None))
    assert [(r["ranks"], r["system"]) for r in rows] == [(n, s) for n in (2, 4) for s in MEASURED_ORDER]
    assert launched == [(n, s) for n in (2, 4) for s in MEASURED_ORDER if (n, s) != (2, "autosp-hybrid-2x2")]
    hybrid_2, hybrid_4 = (next(r for r in rows if r["system"] == "autosp-hybrid-2x2" and r["ranks"] == n)
                          for n in (2, 4))
    assert hybrid_2["note"] == "needs 4 ranks" and hybrid_2["median_step_ms"] == hybrid_2["ratio_to_ulysses"] == ""
    ulysses_ms = float(next(r for r in rows if r["system"] == "ulysses" and r["ranks"] == 4)["median_step_ms"])
    assert float(hybrid_4["ratio_to_ulysses"]) == pytest.approx(float(hybrid_4["median_step_ms"]) / ulysses_ms,
                                                               abs=0.01)
    assert hybrid_4["note"] == "" and hybrid_4["grad_max_rel_error"] == "1.0e-07"
    closing = measured_cpu.TABLE.footer(rows, None)  # the ratios, one line per rank count
    assert len(closing) == 2 and "`autosp-hybrid-2x2` (needs 4 ranks)" in closing[0]
    assert f"`autosp-hybrid-2x2` {hybrid_4['ratio_to_ulysses']}x" in closing[1] and "`ulysses` 1.00x" in closing[1]


def test_cpu_systems_chooses_the_rows_of_the_measured_tables_with_ulysses_always_among_them(tmp_path, monkeypatch):
    import experiments.launch
    from experiments.reproduce import run_config
    from experiments.reproduction import Runner, measured_cpu

    launched = []

    def fake_run_on_ranks(fn, ranks, spec, **kw):
        launched.extend(spec["systems"])
        return [{"systems": {name: {"median_step_s": 0.1, "first_step_s": 1.0, "loss": 1.0, "loss_error": 0.0,
                                    "grad_max_rel_error": 1e-7, "peak_memory_bytes": 2**20}
                             for name in spec["systems"]}}] * ranks

    monkeypatch.setattr(experiments.launch, "run_on_ranks", fake_run_on_ranks)
    run = run_config(["--quick", "--out", str(tmp_path), "--cpu-systems", "ring", "autosp"])
    assert run.cpu_systems == ("ulysses", "ring", "autosp")
    rows = measured_cpu.build(run, Runner(cache=None))
    assert [r["system"] for r in rows] == launched == [s for s in MEASURED_ORDER if s in ("autosp", "ulysses", "ring")]
    assert run_config(["--quick", "--out", str(tmp_path)]).cpu_systems is None


def test_memory_cap_searches_a_system_only_on_the_ranks_it_declares_and_says_why_elsewhere(tmp_path, monkeypatch):
    import dataclasses

    import experiments.launch
    from experiments.cpu.memory_cap import PLANNER_ROW, REFERENCE_ROW
    from experiments.reproduce import run_config
    from experiments.reproduction import Runner, memory_cap
    from experiments.reproduction.run import PRESETS

    launched, options, timed = [], [], []

    def fake_run_on_ranks(fn, ranks, spec, *args, **kw):
        if fn.__name__ == "step_times_on_rank":  # the reference and the planner row, side by side
            timed.append((spec["systems"], *args))
            return [{name: {"median_step_s": seconds} for name, seconds in
                     zip(spec["systems"], (2.0, 1.5), strict=True)}] * ranks
        (name,) = spec["systems"]
        launched.append(name)
        options.append(spec["model_options"])
        return [{"systems": {name: {"probes": [(512, 2**20)], "max_seq_len": 512, "first_failure": 1024,
                                    "search_s": 1.0}}}] * ranks

    monkeypatch.setattr(experiments.launch, "run_on_ranks", fake_run_on_ranks)
    run = run_config(["--quick", "--out", str(tmp_path)])
    rows = memory_cap.build(run, Runner(cache=None))  # on 2 ranks
    assert launched == [s for s in STRATEGIES.table("memory-cap") if s not in NEEDS_4_RANKS]
    assert [r["system"] for r in rows] == list(STRATEGIES.table("memory-cap")) and _ran(rows)
    assert timed == [([REFERENCE_ROW, PLANNER_ROW], 512, run.cpu_steps)]
    steps = {r["system"]: r["step_s_at_reference"] for r in rows if r["step_s_at_reference"]}
    assert steps == {REFERENCE_ROW: "2.000", PLANNER_ROW: "1.500"}
    planned = next(r for r in rows if r["system"] == PLANNER_ROW)
    assert "1.00x ulysses+ckpt's length; step at its 512 tokens 0.75x its" in planned["note"], planned
    assert {r["model"] for r in rows} == {"mini-llama-3.1-8b"} == set(run.cap_models)
    # The default preset's two models: each searched with its own size options, its rows after the other's.
    models = ("mini-llama-3.1-8b", "hf-llama")
    assert PRESETS["default"]["cap_models"] == models
    launched.clear(), options.clear()
    rows = memory_cap.build(dataclasses.replace(run, cap_models=models), Runner(cache=None))
    assert [r["model"] for r in rows] == [m for m in models for _ in STRATEGIES.table("memory-cap")]
    assert launched == 2 * [s for s in STRATEGIES.table("memory-cap") if s not in NEEDS_4_RANKS]
    assert options == [{}] * (len(launched) // 2) + [memory_cap.MODEL_OPTIONS["hf-llama"]] * (len(launched) // 2)


def test_reproduce_run_json_keeps_the_commands_of_tables_an_only_run_did_not_redo(tmp_path):
    from experiments.reproduce import _write_run_json

    path = tmp_path / "run.json"
    _write_run_json(path, {"command": "full", "max_seq_len_summary": {"compared": 12}},
                    {"a": {"command": "full", "seconds": 1.0}, "b": {"command": "full", "seconds": 2.0}})
    _write_run_json(path, {"command": "only b"}, {"b": {"command": "only b", "seconds": 3.0}})
    run = json.loads(path.read_text())
    assert run["max_seq_len_summary"] == {"compared": 12}  # written by the run of table a, kept
    assert run["command"] == "only b" and run["commands"] == ["full", "only b"]
    assert run["table_s"] == {"a": 1.0, "b": 3.0}


def _fake_step(per_token_bytes: int, calls: list):
    """A stand-in for simulate_step: activations of ``per_token_bytes`` per token, memory from the real ledger."""
    from experiments.models import PAPER_MODELS
    from experiments.paper_scale.config import peak_memory_bytes
    from experiments.paper_scale.simulate import SimulatedStep

    def step(system, model_name, seq_len, **_):
        calls.append(seq_len)
        model, dynamic = PAPER_MODELS[model_name], per_token_bytes * seq_len
        bands = ("low", "nominal", "high")
        return SimulatedStep(model=model_name, system=system, seq_len=seq_len, sp_size=8, step_time_s=1.0,
                             dynamic_memory_bytes=dynamic,
                             static=tuple(peak_memory_bytes(model, system, 0, w) for w in bands),
                             peak=tuple(peak_memory_bytes(model, system, dynamic, w) for w in bands),
                             capacity_bytes=80 * 2**30)

    return step


def test_max_length_reports_its_ceiling_and_the_ledger_band(monkeypatch):
    from experiments.models import PAPER_MODELS
    from experiments.paper_scale import simulate
    from experiments.paper_scale.config import ALTERNATIVE_CONFIG, peak_memory_bytes
    from simulator import Cluster

    capacity = Cluster.from_preset("a100-80gb-sxm").device.memory_bytes
    calls = []
    monkeypatch.setattr(simulate, "simulate_step", _fake_step(1000, calls))
    at_ceiling = simulate.max_length("autosp", "llama-3.1-8b", granularity=1024, high=16384)
    assert (at_ceiling.nominal.max_seq_len, at_ceiling.nominal.stopped) == (16384, "ceiling")
    assert at_ceiling.nominal.display() == "≥ 16,384"

    calls.clear()
    monkeypatch.setattr(simulate, "simulate_step", _fake_step(1_000_000, calls))
    found = simulate.max_length("autosp", "llama-3.1-8b", granularity=1024, high=262144,
                                alternative=ALTERNATIVE_CONFIG)
    model = PAPER_MODELS["llama-3.1-8b"]

    def brute(which, config=None):  # the longest grid length whose ledger peak fits, by enumeration
        extra = {} if config is None else {"config": config}
        fitting = [k * 1024 for k in range(1, 257)
                   if peak_memory_bytes(model, "autosp", 1_000_000 * k * 1024, which, **extra) <= capacity]
        return max(fitting, default=None)

    assert found.nominal.max_seq_len == brute("nominal") and found.nominal.stopped == "converged"
    assert found.band == (brute("high"), brute("low"))
    assert found.band[0] < found.nominal.max_seq_len < found.band[1]
    assert found.alternative.max_seq_len == brute("nominal", ALTERNATIVE_CONFIG) < found.nominal.max_seq_len
    assert len(calls) == len(set(calls))  # each length simulated once for all four searches
    assert len(calls) < 20


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


def test_paper_scale_simulates_every_system_and_ring_reuses_the_ulysses_traces(paper_cache):
    from experiments.models import PAPER_MODELS
    from simulator.ledger import TrainingConfig, memory_ledger, summarize

    model = PAPER_MODELS["llama-3.2-3b"]

    def ledger_static(stage):  # the ledger of the paper's configuration, built here from the model card
        cfg = TrainingConfig.for_llama(hidden=3072, ffn_hidden=8192, layers=28, heads=24, kv_heads=8, vocab=128256,
                                       tied_embeddings=True, zero_stage=stage, dp_world_size=8)
        summary = summarize(memory_ledger(cfg, at="backward"))
        return summary.low, summary.nominal, summary.high

    assert model.hidden_size == 3072 and model.num_layers == 28
    cache = paper_cache  # shared with the depth extrapolation's test: AutoSP's traces at 4,096 tokens, no other
    before = (cache.misses, cache.hits)
    ulysses = simulate_step("ulysses", "llama-3.2-3b", 4096, cache=cache, layers="extrapolated")
    assert ulysses.sp_size == 8 and ulysses.fits
    assert ulysses.step_time_s > 0 and ulysses.peak_memory_bytes > ulysses.static_memory_bytes
    assert ulysses.static == ledger_static(1)  # ZeRO 1: DeepSpeedZeroOptimizer's buffers
    ring = simulate_step("ring", "llama-3.2-3b", 4096, cache=cache, layers="extrapolated")
    # ring attention is a rewrite of the same two traces
    assert (cache.misses - before[0], cache.hits - before[1]) == (2, 2)
    assert ring.static == ulysses.static and ring.step_time_s > 0  # the same engine settings, the same ledger
    assert ring.peak_memory_bytes >= ulysses.peak_memory_bytes  # plus its receive buffers
    zero3 = simulate_step("zero3", "llama-3.2-3b", 4096, cache=cache, layers="extrapolated")
    assert zero3.sp_size == 1 and zero3.static == ledger_static(3)
    assert zero3.static_memory_bytes < ulysses.static_memory_bytes  # every state sharded
    assert zero3.step_time_s > ulysses.step_time_s  # each rank computes the whole sequence
    ckpt = simulate_step("ulysses+ckpt", "llama-3.2-3b", 4096, cache=cache, layers="extrapolated")
    assert ckpt.static == ulysses.static
    # Per-layer checkpointing ("layer") leaves what runs outside the layers (output projection, loss) alone: at 4,096
    # tokens that sets the peak, so it keeps no less (beyond the RNG state it saves per layer for the recomputation:
    # the traced CPU generator's); at 16,384 the layers' activations dominate and it keeps less.
    import torch

    assert ckpt.peak_memory_bytes <= ulysses.peak_memory_bytes + model.num_layers * torch.get_rng_state().nbytes
    assert ckpt.step_time_s > ulysses.step_time_s  # ... and recomputes the forward in backward
    longer = {name: simulate_step(name, "llama-3.2-3b", 16384, cache=cache, layers="extrapolated")
              for name in ("ulysses", "ulysses+ckpt")}
    assert longer["ulysses+ckpt"].peak_memory_bytes < longer["ulysses"].peak_memory_bytes
    autosp = simulate_step("autosp", "llama-3.2-3b", 4096, cache=cache, layers="extrapolated")
    assert autosp.static == ulysses.static
    assert set(STRATEGIES.table("paper-scale")) == {"autosp", "zero3", "ring", "ulysses", "ulysses+ckpt"}
    with pytest.raises(ValueError, match="ulysses"):
        simulate_step("megatron", "llama-3.2-3b", 4096)
    with pytest.raises(ValueError, match="not simulated"):  # DeepSpeed's own AutoSP has no workload recipe
        simulate_step("deepspeed-autosp", "llama-3.2-3b", 4096)


def test_whole_step_adds_gradient_reduction_and_an_optimizer_step_to_every_system():
    from dataclasses import replace

    from experiments.models import PAPER_MODELS
    from experiments.paper_scale.simulate import TraceCache, step_workload

    model = PAPER_MODELS["llama-3.2-3b"]
    one_layer = replace(model, num_layers=1).parameter_count()  # tied embeddings: one vocab x hidden matrix
    assert one_layer == 128256 * 3072 + (2 * 3072 * 3072 + 2 * 3072 * 1024 + 3 * 3072 * 8192 + 2 * 3072) + 3072
    cache = TraceCache()
    for system in STRATEGIES.table("paper-scale"):
        workload = step_workload(system, model, 2048, 1, cache=cache)
        for program in workload.ranks.values():
            names = [op.name for op in program.ops]
            assert names.count("optimizer_step") == 1, system
            step = next(op for op in program.ops if op.name == "optimizer_step")
            # Adam over the rank's fp32 shard: read parameter, gradient, two moments (4 bytes each)
            shard = step.bytes_read // 16
            assert shard == pytest.approx(one_layer / 8, rel=1e-3), system
            ours = [op for op in program.ops if op.name.startswith("grad_reduce_")]
            rewrite = [op for op in program.ops if op.collective and op.collective.kind == "reduce_scatter"
                       and op not in ours]
            reduced = sum(op.collective.message_bytes for op in ours + rewrite if op.kind != "collective_wait")
            # every bf16 gradient reduced exactly once: by the added step, or by the ZeRO-3 rewrite
            assert reduced == pytest.approx(2 * one_layer, rel=1e-3), system
            assert bool(ours) == (system != "zero3") and bool(rewrite) == (system == "zero3"), system
            gathers = [op for op in program.ops if op.name.startswith("param_all_gather_")]
            assert bool(gathers) == (system != "zero3"), system  # ZeRO 1 all-gathers the updated partitions
        assert workload.metadata["training_step"]["zero_stage"] == (3 if system == "zero3" else 1)


@pytest.mark.parametrize("peak, start, answer", [
    (lambda s: 500_000 + 2_400 * s, 512, 3840),                            # linear: the cap is at 3958 tokens
    (lambda s: 6_000_000 + 100 * s if s < 2000 else 2_400 * s, 512, 4096),  # flat, then steeper (cap at 4166)
    (lambda s: 1_000_000 + 2_400 * s, 65536, 3584),                         # the first probe already fails
    # the planner finds no plan past 3,000 tokens (NO_PLAN_PEAK): the search bisects where it cannot interpolate
    (lambda s: 500_000 + 2_400 * s if s <= 3000 else float("inf"), 512, 2816),
    (lambda s: float("inf") if s > 700 else 500_000 + 2_400 * s, 4096, 512),
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


@pytest.mark.parametrize("limit", [2_000, 7_900, 30_000])
def test_memory_cap_search_of_a_row_that_fills_the_cap_steps_by_length(limit):
    """The planner's row measures just under the cap wherever it finds a plan, and finds none past its limit: a
    line through two fitting probes would creep up by a granularity per probe; the search doubles, then bisects,
    and finds the limit (to the granularity) in a few probes (Note [Memory-cap search])."""
    from experiments.cpu.memory_cap import NO_PLAN_PEAK, next_probe, search_result

    cap = 10_000_000

    def peak(s):  # a fast plan while the sequence is short, then plans that fill the cap, then none
        return NO_PLAN_PEAK if s > limit else min(3_000 * s, cap - 50_000 + s)

    probes, length = [], 512
    while length is not None:
        probes.append((length, peak(length)))
        length = next_probe(probes, cap, granularity=256, max_len=65536, fills_cap=True)
    assert len(probes) <= 12, probes  # log2 of (limit / first line) doublings, log2 of the bracket bisections
    assert search_result(probes, cap)["max_seq_len"] == limit // 256 * 256


def test_memory_cap_search_goes_on_above_a_failure_below_the_longest_fit_and_calls_it_a_lower_bound():
    """A system whose options change with the length (the planner's row) may fail below a length that fits: that
    failure bounds nothing, the search brackets above the longest fit, and the result names it (Note [Memory-cap
    search])."""
    from experiments.cpu.memory_cap import next_probe, search_result

    cap = 10_000_000

    def peak(s):  # a leaner plan from 3,200 tokens on: 3,072 fails, 3,328 fits, the cap is at 3,913
        return 4_000_000 + 2_400 * s if s < 3200 else 1_000_000 + 2_300 * s

    probes = [(2048, peak(2048)), (3072, peak(3072)), (3328, peak(3328))]
    assert [s for s, p in probes if p > cap] == [3072]
    length = next_probe(probes, cap, granularity=256, max_len=65536)
    assert length is not None and length > 3328  # the failure at 3,072 bounds nothing
    while length is not None:
        probes.append((length, peak(length)))
        length = next_probe(probes, cap, granularity=256, max_len=65536)
        assert len(probes) <= 8, probes
    found = search_result(probes, cap)
    assert found == {"max_seq_len": 3840, "first_failure": 4096, "below_fit": [3072]}
    assert search_result([(512, 1), (1024, cap + 1)], cap) == {"max_seq_len": 512, "first_failure": 1024,
                                                                "below_fit": []}


def test_headroom_at_the_published_length_and_the_summary_of_the_table():
    from experiments.reproduction.max_seq_len import headroom_at, max_seq_len_summary, ordering_agrees
    from simulator.search import SearchResult, Trial

    gib, mib = 2**30, 2**20
    trials = tuple(Trial(seq_len=s, fits=True, peak_memory_bytes=10 * gib + mib * s, step_time_s=1.0)
                   for s in (8192, 65536, 61440))
    result = SearchResult(max_seq_len=65536, stopped="converged", trials=trials)
    assert headroom_at(result, 45000, 80 * gib) == pytest.approx(70 * gib - 45000 * mib)
    assert headroom_at(result, 100_000, 80 * gib) < 0

    assert ordering_agrees({"a": 3, "b": 2, "c": 1}, {"a": 30, "b": 20, "c": 10}) == []
    assert ordering_agrees({"a": 3, "b": 4, "c": 1}, {"a": 30, "b": 20, "c": 20}) == [("a", "b")]
    assert ordering_agrees({"a": 3, "b": 3}, {"a": 30, "b": 30}) == []  # tied in the figure: not compared

    def row(model, system, published, simulated, error, alternative=""):
        return {"model": model, "system": system, "published_tokens": published, "simulated_nominal": simulated,
                "error_pct": error, "alternative_error_pct": alternative, "headroom_at_published_gib": "",
                "implied_activation_multiple": ""}

    rows = [row("m", "zero3", "10", "9", "-10", "-50"), row("m", "ulysses", "20", "40", "+100", "+10"),
            row("m", "autosp", "30", "36", "+20", "-20"), row("m", "ulysses+ckpt", "", "50", "")]
    summary = max_seq_len_summary(rows)
    assert summary["compared"] == 3 and summary["median_abs_error_pct"] == 20
    assert summary["within_disagreement"] == 2 and summary["alternative_median_abs_error_pct"] == 20
    assert summary["ordering"] == {"m": "autosp vs ulysses"} and not summary["ordering_same_for_every_model"]
    assert summary["gap_shape"] == {}  # no headroom computed: nothing to read


def _gap_rows(missing_gib):
    """Max-seq-len rows of one system on the three paper models whose published lengths miss ``missing_gib(model,
    published)`` GiB per rank."""
    published = {"llama-3.2-3b": 35000, "llama-3.1-8b": 15000, "llama-2-13b": 8000}
    return [{"model": m, "system": "ulysses", "published_tokens": str(n), "error_pct": "+200",
             "headroom_at_published_gib": f"{missing_gib(m, n):.4f}", "implied_activation_multiple": "3.00"}
            for m, n in published.items()]


def test_gap_shape_tells_a_per_token_gap_from_a_fixed_one():
    from experiments.models import PAPER_MODELS
    from experiments.reproduction.max_seq_len import gap_shape

    def per_token(model, tokens):  # 12 bytes per token, hidden unit and layer
        m = PAPER_MODELS[model]
        return 12 * tokens * m.hidden_size * m.num_layers / 2**30

    shape = gap_shape(_gap_rows(per_token))["ulysses"]
    assert shape["per_token_cv"] < 0.01 < shape["fixed_cv"]
    assert shape["per_token_hidden_layer_bytes"] == [12.0, 12.0, 12.0]
    fixed = gap_shape(_gap_rows(lambda model, tokens: 30.0))["ulysses"]
    assert fixed["fixed_cv"] < 0.01 < fixed["per_token_cv"]
    # Rows within the disagreement band are not gaps to explain; one model gives no spread.
    within = [dict(r, error_pct="+5") for r in _gap_rows(per_token)]
    assert gap_shape(within) == {}
    assert gap_shape(_gap_rows(per_token)[:1])["ulysses"]["per_token_cv"] is None


def test_activation_multiple_reads_the_gap_as_activations():
    from experiments.reproduction.max_seq_len import activation_multiple_at, headroom_at
    from simulator.search import SearchResult, Trial

    static, per_token, capacity = 30 * 2**30, 2**20, 80 * 2**30
    trials = tuple(Trial(seq_len=n, fits=True, peak_memory_bytes=static + per_token * n, step_time_s=1.0)
                   for n in (8192, 16384, 32768))
    found = SearchResult(max_seq_len=32768, stopped="converged", trials=trials)
    # At 10,240 tokens the simulated activations are 10 GiB of the 50 GiB above static memory: 5x.
    assert activation_multiple_at(found, 10240, capacity, static) == pytest.approx(5.0)
    assert headroom_at(found, 10240, capacity) == pytest.approx(40 * 2**30)
