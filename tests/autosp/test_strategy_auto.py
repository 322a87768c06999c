"""strategy="auto" in the planner: each strategy and hybrid degree the pass compiles traced, exported and simulated
on its own, the fastest that fits chosen (`autosp.plan.strategy_choice.choose_strategy`, ``python -m autosp.plan --strategy
auto``).

A one-layer Llama config (4 heads, 2 key/value heads) on one simulated H100 node: SP 4, where Ulysses, the hybrid
2 x 2 and the ring run, and SP 3, where Ulysses cannot (4 heads over 3 ranks), no hybrid exists and the ring is
chosen.  The candidates of other head counts and SP degrees are checked without tracing.  Two gloo ranks take the
SP-4 decision with the candidates spread over them, as ``autosp.compile(strategy="auto")`` does
(`autosp.plan.auto.strategy_on_ranks`), and get the one-process decision's rows.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re

import pytest

from autosp.errors import AutoSPError
from autosp.plan import TrainingSetup, load_cluster
from autosp.plan.__main__ import build_parser, main
from autosp.plan.model_source import ModelSource
from autosp.plan.strategy_choice import (
    AUTO_STRATEGIES,
    STRATEGY_CHOICES,
    choose_strategy,
    strategy_candidates,
)
from autosp.plan.traces import CaptureKeeper, TraceReuse, trace_step
from simulator.strategies import SEQUENCE_PARALLEL
from simulator.workload import COMPILED_STRATEGIES
from tests.autosp.cases import config_json

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 4096, "attention_dropout": 0.0, "tie_word_embeddings": False,
}
SEQ, CLUSTER = 96, "h100-sxm"


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory):
    return config_json(tmp_path_factory.mktemp("llama"), LLAMA)


@pytest.fixture(scope="module")
def decided(llama_config):
    setup = TrainingSetup(seq_len=SEQ, sp_size=4, zero_stage=2)
    cluster, reuse = load_cluster(CLUSTER, world_size=setup.world_size), TraceReuse([])
    return setup, cluster, reuse, choose_strategy(llama_config, setup, cluster, reuse=reuse)


def test_strategy_auto_choices_are_the_registrys():
    assert AUTO_STRATEGIES is COMPILED_STRATEGIES and STRATEGY_CHOICES == ("ulysses", "ring", "hybrid", "auto")
    assert set(STRATEGY_CHOICES) <= set(SEQUENCE_PARALLEL)
    assert build_parser().parse_args(["--model", "tiny-llama", "--cluster", CLUSTER, "--seq-len", "64",
                                      "--strategy", "ring"]).strategy == "ring"


@pytest.mark.parametrize(("heads", "kv_heads", "sp", "expected"), [
    (4, 2, 4, ["autosp", "autosp-hybrid-2x2", "autosp-ring"]),
    (4, 2, 8, ["-autosp", "autosp-hybrid-2x4", "autosp-hybrid-4x2", "autosp-ring"]),  # kv heads replicated in 4x2
    (32, 8, 8, ["autosp", "autosp-hybrid-2x4", "autosp-hybrid-4x2", "autosp-ring"]),
    (6, 6, 4, ["-autosp", "autosp-hybrid-2x2", "autosp-ring"]),
    (4, 1, 3, ["-autosp", "autosp-ring"]),
    (4, 4, 2, ["autosp", "autosp-ring"]),
])
def test_strategy_auto_candidates_are_every_degree_the_pass_compiles(tmp_path, heads, kv_heads, sp, expected):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "hidden_size": 16 * heads, "num_attention_heads": heads,
                                "num_key_value_heads": kv_heads}))
    found = strategy_candidates(str(path), TrainingSetup(seq_len=SEQ * sp, sp_size=sp))
    assert [("-" if why else "") + s.name for s, why in found] == expected
    for strategy, why in found:
        u, r = strategy.degrees(sp)
        assert u * r == sp and (why is None) == (heads % u == 0), strategy.name
        options = strategy.compile_options
        assert options["strategy"] == strategy.sequence_parallel
        if strategy.sequence_parallel == "hybrid":
            assert (options["ulysses_size"], options["ring_size"]) == (u, r)


def test_strategy_auto_simulates_each_strategy_on_its_own_trace_and_picks_the_argmin(decided):
    setup, _, _, decision = decided
    by_name = {c.system: c for c in decision.candidates}
    assert list(by_name) == ["autosp", "autosp-hybrid-2x2", "autosp-ring"]
    assert all(c.prediction is not None for c in by_name.values())
    assert [c.strategy for c in decision.candidates] == ["ulysses", "hybrid", "ring"]
    ulysses, hybrid, ring = (by_name[s].prediction.step.simulated for s in by_name)
    # Ulysses' symmetric program collapses to one simulated rank; the ring's and the hybrid's name their
    # neighbours: every rank.
    assert ulysses.collapsed and not ring.collapsed and len(ring.simulated_ranks) == setup.world_size
    assert not hybrid.collapsed and len(hybrid.simulated_ranks) == setup.world_size
    assert len({ulysses.step_time_s, hybrid.step_time_s, ring.step_time_s}) == 3
    times = {c.system: c.prediction.step.step_time_s for c in decision.candidates if c.fits}
    assert times and decision.chosen == min(times, key=times.get)
    assert decision.prediction is by_name[decision.chosen].prediction
    assert decision.options == by_name[decision.chosen].options
    assert by_name["autosp-hybrid-2x2"].options == {"strategy": "hybrid", "ulysses_size": 2, "ring_size": 2}
    text = decision.format()
    assert all(f"{c.prediction.step.step_time_s * 1e3:10.3f}" in text for c in decision.candidates)
    assert decision.to_dict()["chosen"] == decision.chosen
    assert decision.to_dict()["options"] == decision.options


def test_strategy_auto_chooses_only_among_strategies_that_fit(decided, llama_config):
    setup, cluster, reuse, decision = decided
    peaks = {c.system: c.prediction.peak_bytes for c in decision.candidates}
    times = {c.system: c.prediction.step.step_time_s for c in decision.candidates}
    assert len(set(peaks.values())) >= 2  # the capacities below separate some candidates
    for capacity in sorted({p + delta for p in peaks.values() for delta in (-1, 0)}):
        again = choose_strategy(llama_config, setup, cluster, reuse=reuse, capacity_bytes=capacity)
        fitting = [s for s in times if peaks[s] <= capacity]
        assert again.chosen == (min(fitting, key=times.get) if fitting else None)
        assert [c.fits for c in again.candidates] == [peaks[c.system] <= capacity for c in again.candidates]
        if not fitting:
            with pytest.raises(AutoSPError, match="no strategy fits"):
                _ = again.options
    with pytest.raises(AutoSPError, match="do not pass ring_size, ulysses_size too"):
        choose_strategy(llama_config, setup, cluster, reuse=reuse, options={"ulysses_size": 2, "ring_size": 2})


def test_strategy_auto_chooses_ring_when_heads_do_not_divide_over_the_ranks(llama_config, tmp_path):
    out = tmp_path / "auto.json"
    argv = ["--model", llama_config, "--cluster", CLUSTER, "--seq-len", str(SEQ), "--sp-size", "3",
            "--strategy", "auto", "--json", str(out), "-q"]
    assert main(argv) == 0
    answer = json.loads(out.read_text())
    by_name = {c["system"]: c for c in answer["candidates"]}
    assert list(by_name) == ["autosp", "autosp-ring"]
    assert "4 attention heads are not divisible by sp_size 3" in by_name["autosp"]["refused"]
    assert by_name["autosp-ring"]["step_time_s"] > 0 and by_name["autosp-ring"]["fits"]
    assert answer["chosen"] == "autosp-ring" and answer["options"] == {"strategy": "ring"}
    assert answer["prediction"]["setup"]["sp_size"] == 3


def test_strategy_auto_shares_one_dynamo_capture_with_each_strategys_own_joint_graph(tmp_path):
    """Note [One Dynamo capture for every strategy] in autosp/plan/prediction.py: a four-layer Llama (shallow traces of
    1 and 2 layers, SAC deciding for the full depth) on SP 4 takes one Dynamo capture per depth for its three
    candidates, and each candidate's joint graph (two layers) and trace facts are those of its own trace but for
    the process groups' names: the rest of the decision is the same code on the same graphs (experiments/bench_planner.py
    --separate-traces compares the decisions at 8B)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "num_hidden_layers": 4}))
    setup = TrainingSetup(seq_len=4 * SEQ, sp_size=4, zero_stage=2)
    cluster, shared = load_cluster(CLUSTER, world_size=setup.world_size), TraceReuse([])
    decision = choose_strategy(str(path), setup, cluster, reuse=shared)
    assert shared.traces == 2 and len(shared._captures) == 2 * 3  # 1 and 2 layers, three strategies each
    assert all(c.prediction.step.extrapolated_from == (1, 2) for c in decision.candidates)

    def code(capture):  # a process group's name is a hash of the order the groups were made in
        return re.sub(r"'[0-9a-f]{40}'", "'group'", capture.graph.code)

    source = ModelSource(str(path))
    config = setup.training_config(source.parameter_numels(source.config(seq_len=setup.seq_len)))
    for (_, _, _, seq_len, layers, group), (capture, facts, _) in shared._captures.items():
        if layers == 1:  # the two-layer graphs: the one-layer ones are captured the same way
            continue
        own = CaptureKeeper()
        trace_step(source, dataclasses.replace(setup, depth="extrapolated"), seq_len=seq_len, layers=layers,
                   config=config, options=dict((k, ast.literal_eval(v)) for k, v in group), capture_into=own)
        assert code(capture) == code(own.capture) and capture.inputs == own.capture.inputs
        assert (facts.parameter_bytes, facts.num_fwd_outputs, facts.compiled_with) == \
            (own.facts.parameter_bytes, own.facts.num_fwd_outputs, own.facts.compiled_with)


def _spread_on_ranks(rank, world, failing):
    """`autosp.plan.auto.strategy_on_ranks` for the SP-4 decision of `decided` (a meta-device Llama of ``LLAMA``,
    bf16) on ``world`` gloo ranks; then, for each of ``failing`` ((rank, exception class name)), the same call with
    that rank's planner raising and every other rank's answering at once: what each call raised."""
    import torch
    import torch.distributed as dist
    import transformers

    from autosp.config import AutoSPConfig
    from autosp.plan import auto, start_planner

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16)
    config = AutoSPConfig(sp_size=2, strategy="auto", plan_seq_len=SEQ, plan_cluster=CLUSTER,
                          plan_setup={"zero_stage": 2})

    def request():  # the SP-4 job's request, decided by this smaller group (more candidates than ranks)
        made = auto.strategy_request(model, config, world_size=4, explicit={})
        return {**made, "setup": {**made["setup"], "sp_size": 4, "dp_size": 1}}

    # Rank 0's planner process started ahead and ready before the request (autosp.plan.start_planner), rank 1's
    # started at the request: the same rows either way.
    ahead = start_planner() if rank == 0 else None
    ready_s = ahead.wait_ready() if ahead is not None else None
    report, _ = auto.strategy_on_ranks(dist.group.WORLD, request, model.config, torch.device("meta"), ahead)
    raised = []
    for bad_rank, kind in failing:
        def planner(asked, process=None, *, timeout_s=None, bad_rank=bad_rank, kind=kind):
            if rank == bad_rank:
                raise {"AutoSPError": AutoSPError, "RuntimeError": RuntimeError}[kind](f"planner broke on {rank}")
            return {"candidates": [], "capacity_bytes": 1, "seconds": 0.0, "cpu_seconds": 0.0}

        auto.run_planner, real = planner, auto.run_planner
        try:
            auto.strategy_on_ranks(dist.group.WORLD, request, model.config, torch.device("meta"))
            raised.append(None)
        except AutoSPError as err:
            raised.append(str(err))
        finally:
            auto.run_planner = real
    return report, raised, ready_s


def test_strategy_auto_spread_over_ranks_decides_as_one_process(decided):
    """Note [Candidates spread over the ranks] in autosp/plan/auto.py: two gloo ranks decide the SP-4 candidates of
    `decided` (rank 0 predicts Ulysses and the ring, rank 1 the hybrid, each in its own planner process with its own
    Dynamo capture; rank 0's started ahead, Note [Planner process started ahead] in autosp/plan/process.py): every rank holds the one-process decision, each candidate's step time and peak the same floats;
    an error on either rank (an `AutoSPError` or any other exception) is every rank's `AutoSPError`."""
    from tests.harness import run_on_ranks

    _, _, _, one = decided
    failing = [(1, "RuntimeError"), (0, "AutoSPError")]
    results = run_on_ranks(_spread_on_ranks, 2, failing, timeout_s=600, collective_timeout_s=300)
    expected = one.to_dict()
    ready_s = results[0][2]  # rank 0's process made its imports before it was asked; rank 1's started at the request
    for report, raised, _ in results:
        ahead, cold = report["planner_started_before_s_by_rank"]
        assert ahead >= ready_s > 0 and cold is None
        rows = report["candidates"]
        assert [r.pop("rank") for r in rows] == [0, 1, 0]  # autosp, autosp-hybrid-2x2, autosp-ring
        assert rows == expected["candidates"]  # the same floats: step_time_s, peak_bytes, fits
        assert {k: report[k] for k in ("chosen", "reason", "options", "capacity_bytes")} == \
            {k: expected[k] for k in ("chosen", "reason", "options", "capacity_bytes")}
        by_rank = report["planner_seconds_by_rank"]  # each rank's planner process, its prediction inside it
        assert len(by_rank) == 2 and report["planner_seconds"] == max(by_rank)
        assert all(0 < p < w for p, w in zip(report["predict_seconds_by_rank"], by_rank, strict=True))
        assert all(0 < c for c in report["predict_cpu_seconds_by_rank"])
        assert raised == ["strategy='auto': planning failed on rank 1: RuntimeError: planner broke on 1",
                          "planner broke on 0"]
