"""The memory planner (`autosp.plan.plan_memory`): it picks by its stated objective from a candidate table that the
test computes independently with `autosp.plan.predict`, and the options it chooses train exactly.

Small sizes: a vocabulary-heavy Qwen2-style config of 1 layer (hidden 32, vocabulary 4,096) traced on fake tensors
for 2 SP ranks, three candidate plans (no checkpointing with the tiled loss off and on, full recomputation with
it on; 16-token chunks).  The 8B decision time is measured outside the tests (docs/design.md, "Memory planner").
"""

from __future__ import annotations

import dataclasses
import json
import tempfile

import pytest

from autosp.plan import TrainingSetup, candidate_plans, load_cluster, plan_memory, predict
from autosp.plan.planner import BINDS, _plan_here, planning_capacity, target_for
from autosp.plan.setup import DECIDING_DEPTH
from autosp.plan.shares import LengthBoard
from tests.autosp.cases import config_json
from tests.autosp.test_equivalence import FP32_TOL, _check
from tests.harness import run_on_ranks

VOCAB = 4096
CONFIG = {  # logits dominate: 64 local tokens x 4,096 fp32 logits = 1 MiB against hidden 32
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
    "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
    "hidden_act": "silu", "attention_dropout": 0.0,
}
SETUP = TrainingSetup(seq_len=128, sp_size=2, dtype="fp32", compiler="aot_eager")
PLANS = candidate_plans(loss_chunk_tokens=16, checkpointing=("none",), tiled_mlp=("off",), activation_offload=("off",)) \
    + candidate_plans(loss_chunk_tokens=16, checkpointing=("full",), tiled_loss=("on",), tiled_mlp=("off",),
                      activation_offload=("off",))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return config_json(tmp_path_factory.mktemp("vocab_heavy"), CONFIG)


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("h100-sxm", world_size=SETUP.world_size)


@pytest.fixture(scope="module")
def table(model, cluster):
    """The candidates predicted one by one, without the planner."""
    return {plan.name: predict(model, SETUP, cluster, options=plan.options) for plan in PLANS}


@pytest.fixture(scope="module")
def fastest(model, cluster, table):
    peaks = sorted({p.peak_bytes for p in table.values()})
    assert len(peaks) >= 2, f"the candidates' peaks do not differ: {peaks}"
    # between the two lowest peaks, less the planner's margin (Note [The planner's margin]): the leanest plans fit
    target = target_for((peaks[0] + peaks[1]) // 2)
    return plan_memory(model, SETUP, cluster, objective="fastest", target_memory=target, plans=PLANS)


def test_fastest_plan_is_the_fastest_candidate_that_fits(fastest, table):
    target = planning_capacity(fastest.target_memory_bytes)  # what a plan's predicted peak may reach
    # Trace reuse: one trace per tiled-loss setting (none and full with it on share one), one partition per plan.
    assert fastest.chosen is not None and (fastest.traces, fastest.partitions) == (2, len(PLANS))
    chosen = fastest.candidates[fastest.chosen]
    independent = table[chosen.plan.name]
    assert independent.peak_bytes <= target
    assert chosen.prediction.peak_bytes == independent.peak_bytes
    assert chosen.prediction.step.step_time_s == independent.step.step_time_s
    assert any(p.peak_bytes > target for p in table.values()), "the target excludes no candidate"
    for name, p in table.items():  # every faster candidate is over the target
        if p.step.step_time_s < independent.step.step_time_s:
            assert p.peak_bytes > target, f"{name} is faster than the chosen {chosen.plan.name} and fits"
    text = fastest.format()
    assert f"* {chosen.plan.name}" in text and "activations" in text
    assert fastest.options == dict(chosen.plan.options)
    assert fastest.to_dict()["candidates"][fastest.chosen]["fits"] is True


def test_workers_predict_and_choose_what_one_process_does(model, cluster, fastest):
    """``plan_memory(workers=2)`` (``python -m autosp.plan --memory-plan auto --workers 2``): the two trace groups
    (tiled loss off, on) predicted in two fresh processes give the one-process report: every candidate's row (the
    same floats), the choice, the reason and the counts; only the wall time differs."""
    spread = plan_memory(model, SETUP, cluster, objective="fastest", target_memory=fastest.target_memory_bytes,
                         plans=PLANS, workers=2)
    one, two = fastest.to_dict(), spread.to_dict()
    assert one.pop("seconds") > 0 and two.pop("seconds") > 0
    assert two == one
    assert spread.format().splitlines()[1:] == fastest.format().splitlines()[1:]  # the first line has the time


def test_shares_hold_whole_trace_groups_and_merge_back_in_the_plans_order():
    """`plan_shares` gives each process whole trace groups, every ``ranks``-th from its own, the plans of a share in
    their order; `in_plan_order` puts each share's results back at their plans' indices (None where no share held
    one): the merge of ``workers`` processes and of the ranks of ``memory_plan="auto"``."""
    from autosp.plan.shares import in_plan_order, plan_shares

    groups = [[0, 3], [1], [2, 4, 5], [6]]
    assert plan_shares(groups, 2) == [[0, 3, 2, 4, 5], [1, 6]]
    assert plan_shares(groups, 3) == [[0, 3, 6], [1], [2, 4, 5]]
    assert plan_shares(groups, 5)[4] == []
    for ranks in (1, 2, 3, 5):
        shares = plan_shares(groups, ranks)
        assert sorted(i for share in shares for i in share) == list(range(7))
        assert in_plan_order(shares, [[f"plan {i}" for i in share] for share in shares], 7) == \
            [f"plan {i}" for i in range(7)]
    assert in_plan_order([[1], []], [["b"], []], 3) == [None, "b", None]  # no share held plans 0 and 2
    with pytest.raises(ValueError):  # a share answered for fewer plans than it held
        in_plan_order([[1], [0]], [["b"], []], 3)


def test_trace_groups_halved_for_spare_processes_predict_what_one_process_does(model, cluster, table):
    """Note [Trace groups halved for spare processes] (autosp/plan/shares.py): with more processes than trace groups, a group is halved by
    checkpointing variant, each half with its offload twins; every row, the choice and its reason equal one
    process's, for a target the plain plans fit (their offload twins not predicted) and one they do not."""
    from autosp.plan.candidates import MemoryPlan
    from autosp.plan.planner import NEEDLESS_OFFLOAD
    from autosp.plan.shares import plan_groups, plan_shares, plan_units

    plans = candidate_plans(loss_chunk_tokens=16, checkpointing=("none", "full"), tiled_loss=("on",),
                            tiled_mlp=("off",), activation_offload=("off", "on"))
    assert [(p.options["checkpointing"], p.options.get("activation_offload", "off")) for p in plans] == [
        ("none", "off"), ("full", "off"), ("none", "on"), ("full", "on")]
    assert plan_groups(plans) == [[0, 1, 2, 3]] and plan_units(plans, 1) == [[0, 1, 2, 3]]
    assert plan_units(plans, 2) == [[0, 2], [1, 3]]  # each plan with its offload twin
    many = [MemoryPlan(f"p{i}", {"tiled_loss": t, "checkpointing": c}) for i, (t, c) in
            enumerate([("on", "none"), ("on", "sac"), ("on", "full"), ("off", "none"), ("off", "full")])]
    assert plan_units(many, 3) == [[0, 1], [2], [3, 4]]  # one spare process: the first group halved
    assert plan_shares(plan_units(many, 3), 3) == [[0, 1], [2], [3, 4]]
    # A target "full" fits and "none" does not: one offload candidate settled by its twin, the other predicted.
    target = target_for(table[plans[1].name].peak_bytes)
    assert table[plans[0].name].peak_bytes > planning_capacity(target)
    one, two = (plan_memory(model, SETUP, cluster, objective="fastest", target_memory=target, plans=plans,
                            workers=workers).to_dict() for workers in (1, 2))
    assert two["traces"] > one["traces"]  # both halves trace the group's program
    for report in (one, two):
        for key in ("seconds", "traces", "partitions"):
            report.pop(key)
        for row in report["candidates"]:
            row.pop("traces"), row.pop("same_program_as")
    assert two == one
    assert [row["refused"] == NEEDLESS_OFFLOAD for row in one["candidates"]] == [False, False, False, True]
    assert one["candidates"][2]["peak_bytes"] is not None  # "none" with offload: predicted, in its own half


def test_plan_job_changes_the_deepspeed_setup_only_as_far_as_memory_needs(model, cluster):
    """`plan_job` plans under ZeRO 1, then ZeRO 2, then ZeRO 2 with optimizer offload, then ZeRO 3 (AutoSP's sharded
    parameters) and ZeRO 3 with optimizer offload, and keeps the first setup
    under which a plan fits (Note [The DeepSpeed setup only as far as memory needs] in autosp/plan/deepspeed_setups.py):
    with a target between two setups' predicted peaks (predicted here, one by one) it names the leaner one and the
    setups it passed over; under no target it stops at the last with no plan.  Fixed fields are kept."""
    import dataclasses

    from autosp.plan.candidates import MemoryPlan
    from autosp.plan.deepspeed_setups import JOB_SETUPS, deepspeed_config, job_setups, plans_for_job
    from autosp.plan.planner import plan_job

    plans = candidate_plans(checkpointing=("sac",), tiled_loss=("off",), tiled_mlp=("off",),
                            activation_offload=("off",))
    setup = dataclasses.replace(SETUP, depth="full")
    peaks = [predict(model, dataclasses.replace(setup, **job), cluster, options=plans[0].options).peak_bytes
             for job in JOB_SETUPS]
    # Each setup frees device memory the one before holds (ZeRO 2's gradient partitions only beyond one reduce
    # bucket of gradients: not for this small model, which ZeRO 2 does not help).
    # ZeRO 3 shards the parameters and their gradients too; with offload its optimizer states go to host memory.
    assert peaks[0] >= peaks[1] >= peaks[2] > peaks[3] > peaks[4] and peaks[0] > peaks[2], peaks
    for peak in sorted(set(peaks), reverse=True):
        expected = peaks.index(peak)  # the first setup whose peak is within the target
        report = plan_job(model, setup, cluster, target_memory=target_for(peak), plans=plans)
        assert report.job == JOB_SETUPS[expected] and report.jobs_without_plan == JOB_SETUPS[:expected]
        assert report.candidates[report.chosen].prediction.peak_bytes == peaks[expected]
        assert report.to_dict()["job"] == JOB_SETUPS[expected]
        assert f"DeepSpeed config: {deepspeed_config(JOB_SETUPS[expected])}" in report.format()
        assert report.options.get("shard_parameters", False) == (expected >= 3)  # what autosp.compile is given
    nothing = plan_job(model, setup, cluster, target_memory=target_for(peaks[4]) - 1, plans=plans)
    assert nothing.chosen is None and nothing.job == JOB_SETUPS[4] and nothing.jobs_without_plan == JOB_SETUPS[:4]
    assert "no plan under any" in nothing.notes[-1]
    # Objective longest: a setup whose plans stop short of the length asked is passed over for a leaner one
    grid = dict(max_length_high=2 * setup.seq_len, granularity=setup.seq_len // 4, max_probes=3)
    furthest = plan_job(model, setup, cluster, objective="longest", target_memory=target_for(peaks[3]), plans=plans,
                        **grid)
    assert furthest.job == JOB_SETUPS[3] and furthest.jobs_without_plan == JOB_SETUPS[:3], furthest.notes[-1]
    assert furthest.candidates[furthest.chosen].max_seq_len >= setup.seq_len
    assert "ZeRO 2 with optimizer offload: reaches " in furthest.notes[-1]  # a plan, shorter: passed over
    assert f"short of the {setup.seq_len:,} asked" in furthest.notes[-1]
    # ZeRO 2 holds what ZeRO 1 holds at one micro-step per optimizer step: not planned once ZeRO 1 has no plan
    assert "ZeRO 2: not planned, its ledger holds no less than one without a plan" in nothing.notes[-1]
    assert deepspeed_config(JOB_SETUPS[2]) == {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert deepspeed_config(JOB_SETUPS[4]) == {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert job_setups(setup, {"zero_stage": 1}) == [{"zero_stage": 1, "offload": "none"},
                                                    {"zero_stage": 1, "offload": "optimizer"}]
    assert job_setups(setup, {"offload": "none"}) == [JOB_SETUPS[0], JOB_SETUPS[1], JOB_SETUPS[3]]
    # ZeRO 3 plans Ulysses without activation offload only; no such plan: not tried
    ring = [MemoryPlan(name="ring", options={**plans[0].options, "strategy": "ring"})]
    assert plans_for_job(ring, JOB_SETUPS[3]) == () and plans_for_job(ring, JOB_SETUPS[2]) == tuple(ring)
    assert job_setups(setup, {"zero_stage": 0}) == [{"zero_stage": 0, "offload": "none"}]  # offload needs ZeRO


def test_longest_plan_reaches_every_single_plan_length(model, cluster, table):
    plans = (PLANS[0], PLANS[-1])  # no checkpointing, tiled loss off; full recomputation, tiled loss on
    grid = dict(max_length_high=384, granularity=128, max_probes=2)
    target = target_for(table[plans[0].name].peak_bytes + 1)  # the plain plan fits at 128 tokens; what fits longer
    report = plan_memory(model, SETUP, cluster, objective="longest", target_memory=target, plans=plans, **grid)
    assert report.chosen is not None
    best = report.candidates[report.chosen].max_seq_len
    alone = predict(model, SETUP, cluster, options=plans[0].options, max_length=True,
                    capacity_bytes=planning_capacity(target), **grid)
    assert best >= alone.max_length["max_seq_len"] >= SETUP.seq_len
    assert all(best >= (c.max_seq_len or 0) for c in report.candidates)
    assert report.traces == sum(c.traces for c in report.candidates) >= len(plans)


def test_the_longest_plan_bounds_the_others_searches_and_the_choice_is_a_full_searchs(model, cluster, table):
    """Note [The longest plan bounds the others' searches]: each plan is searched from the longest length a plan
    decided before it fits; the choice and its length are those of every plan searched on its own from the start,
    a plan ruled out shows ``< L`` after fewer probes than its own search, and one that reaches L is searched as
    before.  Spread over two processes, which read each other's lengths: the same choice and reason, every row one
    that process's bound allows; a process given another's length first rules out every plan shorter than it."""
    grid = dict(max_length_high=512, granularity=128, max_probes=4)
    target = target_for(table[PLANS[0].name].peak_bytes + 1)  # the plain plan fits at 128 tokens; the others longer
    report = plan_memory(model, SETUP, cluster, objective="longest", target_memory=target, plans=PLANS, **grid)
    alone = [predict(model, SETUP, cluster, options=p.options, max_length=True,
                     capacity_bytes=planning_capacity(target), **grid) for p in PLANS]
    lengths = [a.max_length["max_seq_len"] or 0 for a in alone]
    assert len(set(lengths)) > 1, lengths  # the plans differ, so a bound can rule one out
    chosen = report.candidates[report.chosen]
    assert chosen.max_seq_len == max(lengths) and lengths[report.chosen] == max(lengths)
    ruled_out = 0
    for candidate, own in zip(report.candidates, alone, strict=True):
        found = candidate.prediction.max_length
        if found["max_seq_len"] is None:  # searched from a longer plan's length and not fitting there
            ruled_out += 1
            floor = int(found["display"].removeprefix("< ").replace(",", ""))
            assert (own.max_length["max_seq_len"] or 0) < floor <= max(lengths)
            assert len(found["probes"]) < len(own.max_length["probes"])
        else:
            assert found["max_seq_len"] == own.max_length["max_seq_len"]
    assert ruled_out >= 1
    shown = report.format()  # each plan's answer as the search gave it: "< L" for a plan ruled out, not 0
    assert all(f" {c.max_length_display:>11s} " in shown for c in report.candidates)
    assert BINDS[chosen.max_length_stopped] in report.reason  # what bounds the answer: memory, or the search

    spread = plan_memory(model, SETUP, cluster, objective="longest", target_memory=target, plans=PLANS, workers=2,
                         **grid)
    assert (spread.chosen, spread.reason) == (report.chosen, report.reason)
    for candidate, own in zip(spread.candidates, alone, strict=True):
        _found_within_its_bound(candidate.prediction.max_length, own.max_length, max(lengths))
    # A process that reads a longer length from the board before its first plan: every shorter plan ruled out.
    with tempfile.TemporaryDirectory() as folder:
        board = LengthBoard(folder)
        board.keep("another process", max(lengths))
        bounded = _plan_here(model, dataclasses.replace(SETUP, depth=DECIDING_DEPTH), cluster, PLANS, start=0.0,
                             target=target, objective="longest", reuse_traces=True, resize_lengths=True,
                             lengths=(board, "this process"), **grid)
        assert board.longest() == max(lengths)
    probes = [[len(c.prediction.max_length["probes"]) for c in r.candidates] for r in (report, bounded)]
    assert all(b <= a for a, b in zip(*probes, strict=True)) and sum(probes[1]) < sum(probes[0]), probes  # the board was read
    assert (bounded.chosen, bounded.reason) == (report.chosen, report.reason)
    for candidate, own in zip(bounded.candidates, alone, strict=True):
        found = candidate.prediction.max_length
        _found_within_its_bound(found, own.max_length, max(lengths))
        assert (found["max_seq_len"] is None) == ((own.max_length["max_seq_len"] or 0) < max(lengths))


def _found_within_its_bound(found: dict, own: dict, longest: int) -> None:
    """A plan's max-length answer in a bounded search: its own search's length, or ``< L`` (fewer probes) for an L
    above that length and at most the longest any plan fits."""
    if found["max_seq_len"] is None:
        floor = int(found["display"].removeprefix("< ").replace(",", ""))
        assert (own["max_seq_len"] or 0) < floor <= longest
        assert len(found["probes"]) < len(own["probes"])
    else:
        assert found["max_seq_len"] == own["max_seq_len"]


def test_trace_reuse_gives_every_checkpointing_plan_its_own_program(tmp_path, cluster):
    """One trace partitioned under every checkpointing variant builds, for each, the very training step (exported
    forward and backward, gradient reduction, optimizer) a separate trace of that plan builds; variants with equal
    recomputation tags share one partition.  Two layers (SAC keeps the residual stream between them), the tiled
    loss on."""
    from autosp.plan.model_source import ModelSource
    from autosp.plan.traces import checkpointing_variant, trace_step

    path = tmp_path / "config.json"
    # Matmuls outweigh attention and logits here, so SAC's recompute limit leaves some of them kept.
    path.write_text(json.dumps({**CONFIG, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 256,
                                "vocab_size": 256}))
    source = ModelSource(str(path))
    config = SETUP.training_config(source.parameter_numels(source.config(seq_len=SETUP.seq_len)))
    plans = [p.options for p in candidate_plans(loss_chunk_tokens=16, tiled_loss=("on",), tiled_mlp=("off",),
                                                activation_offload=("off",))]
    variants = tuple(checkpointing_variant(p) for p in plans[1:])
    shared = trace_step(source, SETUP, seq_len=SETUP.seq_len, layers=None, config=config, options=plans[0],
                        variants=variants)
    programs = {}
    for options in plans:
        alone = trace_step(source, SETUP, seq_len=SETUP.seq_len, layers=None, config=config, options=options)
        reused = shared[checkpointing_variant(options)]
        assert reused.step == alone.step, f"{checkpointing_variant(options)}: the shared trace's step differs"
        programs.setdefault(id(reused), []).append(checkpointing_variant(options))
    # On this model sac@0.5 and sac@0.2 keep what plain SAC keeps (its FLOP limit recomputes the matmuls they add).
    assert {frozenset(v) for v in programs.values()} == {
        frozenset({("none", None)}), frozenset({("sac", None), ("sac", 0.5), ("sac", 0.2)}),
        frozenset({("full", None)}), frozenset({("layer", None)})}, programs


def _train_with(rank, world, options):
    from tests.autosp.test_tiled_loss import _tiled_case

    overrides = {"hidden": 32, "vocab": VOCAB}
    return [_tiled_case(rank, world, model="hf-qwen2", sp_size=2, seq_len=64, options=options, overrides=overrides)]


def test_chosen_options_train_exactly_on_two_ranks(fastest):
    options = fastest.options
    assert options["tiled_loss"] == "on" and options["checkpointing"] == "full"  # the plan the target leaves
    results = run_on_ranks(_train_with, 2, options, timeout_s=600)
    _check(results, FP32_TOL)
    # the planner's return_logits=False: reading the logits raises, naming it (Note [Dropped logits])
    assert all(r["tiled"] and "return_logits=False" in r["logits"] for per_rank in results for r in per_rank)


def test_candidates_cover_every_setting_and_fixed_options_win():
    plans = candidate_plans(mlp_chunk_tokens=(None, 64))
    settings = [(p.options["checkpointing"], p.options.get("sac_memory_budget"), p.options["tiled_loss"],
                 p.options["tiled_mlp"], p.options.get("mlp_chunk_tokens"), p.options.get("activation_offload", "off"))
                for p in plans]
    # tiled MLP off, on (default chunk), on (64 tokens); activation offload off (the default, unnamed) and on
    assert len(set(settings)) == len(plans) == 6 * 2 * 3 * 2
    assert {s[0] for s in settings} == {"none", "sac", "full", "layer"}
    assert {s[3:5] for s in settings} == {("off", None), ("on", None), ("on", 64)}
    assert {s[5] for s in settings} == {"off", "on"}
    assert all(p.name.endswith(", offload") == (p.options.get("activation_offload") == "on") for p in plans)
    assert all(p.options["return_logits"] is False for p in plans if p.options["tiled_loss"] == "on")
    assert len({p.name for p in plans}) == len(plans) and "sac@0.5, tiled loss on, tiled mlp on/64" in \
        {p.name for p in plans}
    fixed = candidate_plans(fixed={"checkpointing": "full", "tiled_mlp": "on", "activation_offload": "off"})
    assert [p.options for p in fixed] == [  # 48 candidates collapse to the two tiled-loss settings
        {"checkpointing": "full", "tiled_loss": "off", "tiled_mlp": "on", "activation_offload": "off"},
        {"checkpointing": "full", "tiled_loss": "on", "return_logits": False, "tiled_mlp": "on",
         "activation_offload": "off"}]
    # "auto" leaves activation offload to the planner: with it and without, named (it replaces the "auto")
    assert [p.options["activation_offload"] for p in candidate_plans(
        checkpointing=("full",), tiled_loss=("off",), tiled_mlp=("off",), fixed={"activation_offload": "auto"})] == [
        "off", "on"]


@pytest.mark.parametrize("preset", ["h100-sxm", "cpu-gloo"])
def test_tight_target_makes_the_planner_offload_activations_on_the_trace_of_the_plan_without(tmp_path, preset):
    """With activation offload among the candidates and the offload plan's peak as the target, the planner picks
    offload: its device peak is lower (three layers: the first layers' saved tensors are in host memory while the
    backward of the last one runs) and its host peak holds what moved (docs/design.md, "Memory planner").  Both
    plans come from one trace (the offload pass rewrites the partition of the plan without it), and the offload
    plan's prediction equals that of its own trace, where the backend ran the pass.  On cpu-gloo the
    host-memory link is the measured offload copy and the peaks are tensor memory (a CPU process: no device reserve,
    no host-process allowance)."""
    cluster = load_cluster(preset, world_size=SETUP.world_size)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "num_hidden_layers": 3, "vocab_size": 256}))
    setup = TrainingSetup(seq_len=64, sp_size=2, dtype="fp32", compiler="aot_eager")
    plans = candidate_plans(checkpointing=("none",), tiled_loss=("off",), tiled_mlp=("off",))
    assert [p.options.get("activation_offload") for p in plans] == [None, "on"]
    alone = predict(str(path), setup, cluster, options=plans[1].options)
    told = []
    report = plan_memory(str(path), setup, cluster, plans=plans, target_memory=target_for(alone.peak_bytes),
                         progress=lambda *state: told.append(state))
    assert told == [(0, 2, ""), (1, 2, plans[0].name), (2, 2, plans[1].name)]  # what a progress bar shows
    plain, offload = (c.prediction for c in report.candidates)
    assert report.traces == 1 and report.partitions == 1
    assert (alone.peak_bytes, alone.host_peak_bytes, alone.step.step_time_s) == (
        offload.peak_bytes, offload.host_peak_bytes, offload.step.step_time_s)
    assert offload.step.dynamic_memory_bytes < plain.step.dynamic_memory_bytes and offload.peak_bytes < plain.peak_bytes
    moved = offload.step.host_dynamic_memory_bytes
    assert moved > 0 and plain.host_peak_bytes == 0 and offload.host_fits
    host_lines = sum(ln.bytes for ln in offload.lines if ln.pool == "host")
    assert offload.host_peak_bytes == host_lines and (host_lines > moved if preset != "cpu-gloo" else host_lines == moved)
    assert report.options == {"checkpointing": "none", "tiled_loss": "off", "tiled_mlp": "off",
                              "activation_offload": "on"}
    assert "host GiB" in report.format() and report.to_dict()["candidates"][1]["host_peak_bytes"] == \
        offload.host_peak_bytes


def test_cli_memory_plan_flags_and_refusals(model, caplog):
    from autosp.errors import AutoSPError
    from autosp.plan.__main__ import build_parser, main

    args = build_parser().parse_args(["--model", model, "--cluster", "h100-sxm", "--seq-len", "128",
                                      "--memory-plan", "auto", "--objective", "longest", "--target-memory", "1.5"])
    assert (args.memory_plan, args.objective, args.target_memory) == ("auto", "longest", 1.5)
    assert main(["--model", model, "--cluster", "h100-sxm", "--seq-len", "128", "--sp-size", "2",
                 "--memory-plan", "auto", "--target-memory", "0", "-q"]) == 2
    assert "--target-memory 0" in caplog.text
    with pytest.raises(AutoSPError, match="objective"):
        plan_memory(model, SETUP, load_cluster("h100-sxm", world_size=2), objective="cheapest", plans=PLANS)


def test_planner_resizes_lengths_inside_its_traced_range_and_predicts_what_traces_predict(tmp_path, cluster):
    """`TraceReuse` traces a group at its first two lengths (keeping their joint graphs), traces the third and
    checks there that the program re-sized from the two (Note [The joint graph at another length] in
    autosp/joint_template.py) equals the trace, then builds a length inside the traced range without a trace.
    Every plan's prediction there (step time, device and host activations) and its whole training step equal
    those of a trace at that length: no checkpointing, SAC and full recomputation (checkpointing variants of one
    trace), each with activation offload off and on (the pair's rewrites on copies of the re-sized partition)."""
    from autosp.plan.model_source import ModelSource
    from autosp.plan.step import simulate_step
    from autosp.plan.traces import TraceReuse

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 256,
                                "vocab_size": 256}))
    source = ModelSource(str(path))
    hf = source.config(seq_len=SETUP.seq_len)
    config = SETUP.training_config(source.parameter_numels(hf))
    plans = [p.options for p in candidate_plans(checkpointing=("none", "sac", "full"), tiled_loss=("off",),
                                                tiled_mlp=("off",))]
    assert len(plans) == 6
    fast, slow = TraceReuse(plans, resize_lengths=True), TraceReuse(plans)

    def predictions(reuse: TraceReuse, seq_len: int) -> list:
        return [simulate_step(source, SETUP, cluster, config, hf.num_hidden_layers, seq_len, p, reuse) for p in plans]

    for n in (32, 96, 64):  # two captures, then the check (one trace partitions every plan of the group)
        fast.trace(source, SETUP, seq_len=n, layers=None, config=config, options=plans[0])
    (lengths,) = fast.length_classes.values()
    assert (lengths.lengths, lengths.checked, fast.traces, fast.resized) == ([32, 96, 64], True, 3, 0)
    resized = predictions(fast, 48)
    assert (fast.traces, fast.resized) == (3, 1)
    assert resized == predictions(slow, 48) and slow.traces == 1
    assert any(p.host_dynamic_memory_bytes for p in resized)  # the offload plans moved activations
    fast_steps, slow_steps = ([r.trace(source, SETUP, seq_len=48, layers=None, config=config, options=p).step
                               for p in plans] for r in (fast, slow))
    assert fast_steps == slow_steps
    # Outside the traced range: traced (the range widens).
    fast.trace(source, SETUP, seq_len=128, layers=None, config=config, options=plans[0])
    assert (fast.traces, fast.resized, lengths.lengths) == (4, 1, [32, 96, 64, 128])


def test_sac_with_offload_unrolled_from_a_resized_joint_graph_predicts_what_traces_predict(tmp_path, cluster):
    """A 7-layer model at depth ``extrapolated`` (the shallowest that `simulate_step` unrolls: deeper than
    `UNROLL_LAYERS`): SAC with activation offload is unrolled from a 6-layer program partitioned with the full
    model's tags, decided on the 2-layer one (`autosp.plan.step._unrolled_step`).  At a length built from re-sized
    joint graphs (no trace at it, so no fake tensors until the planner propagates them) the prediction equals that
    of traces at that length."""
    import dataclasses

    from autosp.plan.model_source import ModelSource
    from autosp.plan.step import simulate_step
    from autosp.plan.traces import TraceReuse
    from simulator.depth_unroll import UNROLL_LAYERS

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "num_hidden_layers": UNROLL_LAYERS + 1, "hidden_size": 64,
                                "intermediate_size": 256, "vocab_size": 256}))
    source = ModelSource(str(path))
    setup = dataclasses.replace(SETUP, depth="extrapolated")
    hf = source.config(seq_len=setup.seq_len)
    config = setup.training_config(source.parameter_numels(hf))
    plan = {"checkpointing": "sac", "activation_offload": "on"}
    fast, slow = TraceReuse([plan], resize_lengths=True), TraceReuse([plan])

    def predicted(reuse: TraceReuse, seq_len: int):
        return simulate_step(source, setup, cluster, config, hf.num_hidden_layers, seq_len, plan, reuse)

    # The traces `_unrolled_step` reads (`TraceReuse.captured`) at each depth: two captures, then the check (where
    # the program re-sized from the two equals the trace); nothing is predicted at these lengths.
    for n in (32, 96, 64):
        for layers in (2, UNROLL_LAYERS):
            fast.trace(source, setup, seq_len=n, layers=layers, config=config, options=plan)
    assert [(c.lengths, c.checked) for c in fast.length_classes.values()] == [([32, 96, 64], True)] * 2
    resized = fast.resized
    got = predicted(fast, 48)
    assert got.unrolled_from == UNROLL_LAYERS
    assert fast.resized > resized and got.host_dynamic_memory_bytes > 0
    assert got == predicted(slow, 48)


@pytest.mark.parametrize("target_mib", [1, 64 * 1024])
def test_the_cli_and_the_compile_plan_the_same_candidates(model, monkeypatch, target_mib):
    """``python -m autosp.plan --memory-plan auto`` and ``autosp.compile(memory_plan="auto")`` (`plan_request`)
    predict the same candidates for one model and target: the tiled ops' chunks sized for the target by
    `chunk_tokens` (1 MiB: a few tokens per chunk; 64 GiB: the passes' default chunks, unnamed)."""
    import transformers

    from autosp.config import AutoSPConfig
    from autosp.errors import AutoSPError
    from autosp.plan import planner
    from autosp.plan.__main__ import main
    from autosp.plan.auto import plan_request
    from autosp.plan.candidates import candidates_for

    target = target_mib * 2**20
    asked = {}

    def planned(*args, plans, **kwargs):  # the CLI's candidates, then stop before predicting any
        asked["plans"] = plans
        raise AutoSPError("stopped by the test")

    monkeypatch.setattr(planner, "plan_memory", planned)
    assert main(["--model", model, "--cluster", "h100-sxm", "--seq-len", "128", "--sp-size", "2", "--dtype", "fp32",
                 "--memory-plan", "auto", "--target-memory", str(target / 2**30), "-q"]) == 2
    module = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**{k: v for k, v in CONFIG.items() if k != "architectures"}))
    config = AutoSPConfig.from_options(sp_size=2, compiler="aot_eager", options={
        "memory_plan": "auto", "target_memory": target, "plan_cluster": "h100-sxm"})
    request = plan_request(module, config, seq_len=128, micro_batch=1, world_size=2, explicit={})
    cli = [[p.name, dict(p.options)] for p in asked["plans"]]
    assert cli == request["plans"]
    assert [p.options for p in candidates_for(model, SETUP, target)] == [o for _, o in cli]
    chunks = {o.get(k) for _, o in cli for k in ("loss_chunk_tokens", "mlp_chunk_tokens")}
    # the rule: one chunk's scratch within 1/16 of the target (64 KiB of 1 MiB): the loss's two fp32 rows of 4,096
    # logits are 32 KiB a token (2 tokens), the MLP's 8 fp32 rows of 64 are 2 KiB (32 tokens); at 64 GiB the passes'
    # default chunks (None: unnamed); None also for the candidates without tiling
    assert chunks == ({None} if target_mib > 1 else {None, 2, 32})


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu"}


@pytest.mark.parametrize(("config", "options"), [
    ({**CONFIG, "use_cache": False}, {}), ({**LLAMA, "use_cache": False}, {"mask_probe_tokens": 16})],
    ids=["qwen2", "llama-short-blocks"])
def test_a_decision_learns_each_mask_once_and_predicts_what_learning_it_every_trace_predicts(
        tmp_path, cluster, caplog, config, options):
    """Note [Mask rules shared between a decision's traces]: the traces of one decision (here two option groups,
    full depth) learn the mask of a ``use_cache=False`` model once, and every candidate's prediction equals the
    prediction of a decision whose traces each learn it."""
    import logging

    from autosp.plan.traces import TraceReuse

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    plans = [{**options, "checkpointing": "sac"},
             {**options, "checkpointing": "full", "tiled_loss": "on", "loss_chunk_tokens": 16, "return_logits": False}]
    shared, alone = TraceReuse(plans), TraceReuse(plans)
    alone.mask_rules = None
    with caplog.at_level(logging.INFO, logger="autosp.passes.dynamo.mask_learner"):
        found = [predict(str(path), SETUP, cluster, options=p, reuse=shared) for p in plans]
    reused = caplog.text.count("the rule an earlier trace learnt")
    expected = [predict(str(path), SETUP, cluster, options=p, reuse=alone) for p in plans]
    assert shared.traces == 2 and len(shared.mask_rules) == 1 and reused == 1, (shared.traces, shared.mask_rules)
    assert [(p.peak_bytes, p.step.step_time_s, p.by_category) for p in found] == [
        (p.peak_bytes, p.step.step_time_s, p.by_category) for p in expected]


def test_a_trace_with_values_learns_its_own_mask(tmp_path):
    """A trace whose batch has values (packed documents: real position ids) checks its own batch and shares no
    rule (Note [Mask rules shared between a decision's traces])."""
    import torch
    import transformers

    from autosp.tracing import trace_fake_step

    shared = {}
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k not in ("architectures", "model_type")},
                                      use_cache=False)
    config._attn_implementation = "sdpa"
    for lengths in (None, [40, 88]):
        compiled, _ = trace_fake_step(lambda: transformers.LlamaForCausalLM(config), seq_len=128, sp_size=2,
                                      vocab_size=256, dtype=torch.float32, document_lengths=lengths,
                                      mask_rules=shared)
        assert compiled.report.mask_probe_blocks, "no mask was learnt"
        assert len(shared) == 1  # the shape-only trace's rule; the packed trace learnt and kept its own


def test_fastest_plan_offloads_only_where_the_same_plan_does_not_fit_without_it():
    """An offload candidate whose twin without offload fits is not predicted (two prediction methods put it a hair
    faster); one whose twin is over the target is (Note [Offload only where it is needed] in
    autosp/plan/planner.py)."""
    from types import SimpleNamespace

    from autosp.plan.candidates import MemoryPlan
    from autosp.plan.planner import (
        NEEDLESS_OFFLOAD,
        Candidate,
        _offload_twin_fits,
        choose_plan,
    )

    def candidate(checkpointing, offload, step_s, peak, fits):
        plan = MemoryPlan(name=f"{checkpointing}/{offload}",
                          options={"checkpointing": checkpointing, "activation_offload": offload})
        return Candidate(plan=plan, prediction=SimpleNamespace(step=SimpleNamespace(step_time_s=step_s),
                                                               peak_bytes=peak, fits=fits))

    sac, over = candidate("sac", "off", 2.243, 50, True), candidate("sac", "off", 2.243, 90, False)
    sac_offload, layer = candidate("sac", "on", 2.241, 35, True), candidate("layer", "off", 2.72, 39, True)
    assert _offload_twin_fits(sac_offload.plan, [sac, layer])
    assert not _offload_twin_fits(sac_offload.plan, [over, layer])  # SAC alone over the target: offload needed
    assert not _offload_twin_fits(sac_offload.plan, [layer])  # no twin (activation_offload="on" passed)
    assert not _offload_twin_fits(sac.plan, [sac])  # not an offload plan
    # MemoryPlan options without the key mean offload off
    assert _offload_twin_fits(sac_offload.plan, [Candidate(plan=MemoryPlan("sac", {"checkpointing": "sac"}),
                                                           prediction=sac.prediction)])
    def row(c: Candidate) -> dict:  # the fields of Candidate.to_dict that choose_plan reads
        p = c.prediction
        return {"plan": c.plan.name, "refused": c.refused, "fits": c.fits, "peak_bytes": p and p.peak_bytes,
                "step_time_s": p and p.step.step_time_s}

    skipped = Candidate(plan=sac_offload.plan, prediction=None, refused=NEEDLESS_OFFLOAD)
    chosen, why = choose_plan([row(sac), row(skipped), row(layer)], "fastest", seq_len=65536, target=80)
    assert chosen == 0 and "1 offload candidate(s) not predicted" in why, why
