"""``autosp.compile(..., memory_plan="auto", target_memory=BYTES)``: the compiled model plans its own memory options
(autosp/plan/auto.py) and trains exactly with them; ``autosp.compile(..., strategy="auto", plan_seq_len=N)``: it
asks the same planner process which strategy to compile, and trains exactly with it.

One gloo launch (2 ranks, SP 2) trains Hugging Face Llama and Qwen2 (1 layer, hidden 32, a 2,048-token vocabulary,
64 tokens x 2 rows) under a target one byte below the predicted peak of the candidate using no technique (no
checkpointing, no tiling; predicted here independently), so the plan must use one; the loss and every gradient
equal a single-device full-sequence run, and the choice is the fastest candidate that fits by the candidates' own
predictions (no option set is hard-coded).  Qwen2 passes ``tiled_mlp="on"`` explicitly: it wins over the plan,
which chooses the rest (its 24 candidates have the tiled MLP on at its default chunk and at the planner's chunk for
the target; Llama's 24 have it off and on; each also with activation offload, priced on the cpu-gloo preset's
measured host-memory link).  In the same
launch Llama compiles with ``strategy="auto"`` (candidates: Ulysses and the ring over 2 ranks, on the cpu-gloo
preset): both ranks compile the candidate the planner names, the fastest that fits by the candidates' own
predictions, and train exactly.  Last, a memory plan whose planner process cannot answer within its
``plan_timeout_s`` (half a second: it is still importing torch) is every rank's error, with the process's stacks.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

from autosp.config import MEMORY_PLAN_OPTIONS
from autosp.errors import AutoSPError
from autosp.plan.planner import NEEDLESS_OFFLOAD, planning_capacity
from tests.autosp.cases import loss_of, make_sample, named_grads
from tests.autosp.test_equivalence import FP32_TOL, _check
from tests.harness import run_on_ranks

SEQ_LEN, SP, ROWS = 64, 2, 2
SIZES = {"layers": 1, "hidden": 32, "vocab": 2048}
PLAIN = {"checkpointing": "none", "tiled_loss": "off", "tiled_mlp": "off"}
CASES = [  # Qwen2's tiled MLP passed explicitly: it wins over the plan, which chooses the rest
    {"model": "hf-llama", "explicit": {}, "baseline": PLAIN, "candidates": 6 * 2 * 2},
    # Qwen2: the tiled MLP at its default chunk (the fixed "on") and at the planner's chunk for the target; planned
    # by the default memory_plan, given only the target (Note [The default memory plan] in autosp/plan/auto.py)
    {"model": "hf-qwen2", "explicit": {"tiled_mlp": "on"}, "baseline": {**PLAIN, "tiled_mlp": "on"},
     "candidates": 6 * 2 * 2, "default_memory_plan": True},
]
"""``baseline``: the candidate with no technique the plan may choose, whose peak the target is one byte under."""
STRATEGY_CASE = {"model": "hf-llama", "compile": {"strategy": "auto", "plan_seq_len": SEQ_LEN}}
STUCK_CASE = {"model": "hf-llama", "stuck": True,
              "compile": {"memory_plan": "auto", "target_memory": 2**40, "plan_timeout_s": 0.5}}
"""A planner process asked for its answer within half a second of its start, while it imports torch."""
TILED_OPS = {"tiled_loss": "linear_cross_entropy", "tiled_mlp": "tiled_mlp"}


def _baseline_peak(model: str, options: dict, folder) -> int:
    """The predicted peak of ``options``, predicted in this process (no process group) without the planner."""
    from autosp.plan import TrainingSetup, load_cluster, predict
    from experiments.models import build_model

    path = folder / f"{model}.json"
    path.write_text(build_model(model, **SIZES).config.to_json_string(use_diff=False))
    setup = TrainingSetup(seq_len=SEQ_LEN, sp_size=SP, micro_batch=ROWS, dtype="fp32", compiler="aot_eager",
                          zero_stage=0)  # what autosp.compile prices a plain job at
    return predict(str(path), setup, load_cluster("cpu-gloo", world_size=SP), options=options).peak_bytes


def _auto_cases(rank, world, cases):
    import autosp
    from experiments.models import build_model, vocab_size

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("autosp.plan.auto").addHandler(handler)
    logging.getLogger("autosp.plan.auto").setLevel(logging.INFO)
    results = []
    for case in cases:
        torch._dynamo.reset()
        torch.manual_seed(0)
        reference = build_model(case["model"], **SIZES)
        candidate = copy.deepcopy(reference)
        ids, labels = make_sample(SEQ_LEN, vocab_size(reference), seed=400, batch=ROWS)
        ref_loss = loss_of(reference(input_ids=ids, labels=labels))
        ref_loss.backward()
        del messages[:]
        compiled = autosp.compile(candidate, sp_size=SP, compiler="aot_eager", **case["compile"])
        if case.get("stuck"):
            try:
                compiled(**autosp.prepare_inputs(ids, labels=labels))
                results.append({"error": None})
            except AutoSPError as err:
                results.append({"error": str(err)})
            continue
        out = compiled(**autosp.prepare_inputs(ids, labels=labels))
        loss_of(out).backward()
        graphs = dict(compiled.report.aot_graphs)
        ops = {str(n.target) for g in graphs.values() for n in g.graph.nodes if n.op == "call_function"}
        results.append({"loss": loss_of(out).detach(), "ref_loss": ref_loss.detach(), "grads": named_grads(candidate),
                        "ref_grads": named_grads(reference), "plan": compiled.report.memory_plan,
                        "strategy_plan": compiled.report.strategy_plan,
                        "config": {k: getattr(compiled.config, k)
                                   for k in (*MEMORY_PLAN_OPTIONS, "memory_plan", "strategy", "ulysses_size",
                                             "ring_size")},
                        "ops": ops, "log": list(messages)})
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory_plan")
    cases = []
    for case in CASES:
        peak = _baseline_peak(case["model"], case["baseline"], folder)
        cases.append({**case, "target": peak - 1, "baseline_peak": peak,
                      "compile": {**({} if case.get("default_memory_plan") else {"memory_plan": "auto"}),
                                  "target_memory": peak - 1, **case["explicit"]}})
    # The planner process runs while the other rank waits in a collective: the collective's timeout is above the
    # planner's default plan_timeout_s, so a stuck planner is every rank's error with its stacks.
    # strategy="auto" with the memory planned: under the Llama case's target, so the plan must use a technique
    both = {"model": "hf-llama", "compile": {**STRATEGY_CASE["compile"], "memory_plan": "auto",
                                             "target_memory": cases[0]["target"], "plan_setup": {"micro_batch": ROWS}}}
    results = run_on_ranks(_auto_cases, 2, [*cases, STRATEGY_CASE, both, STUCK_CASE], timeout_s=900,
                           collective_timeout_s=600)
    return (cases, [per_rank[:-3] for per_rank in results], [per_rank[-3] for per_rank in results],
            [per_rank[-1] for per_rank in results], [per_rank[-2] for per_rank in results])


def test_auto_strategy_trains_exactly_with_the_planners_choice(trained):
    _check([[r] for r in trained[2]], FP32_TOL)
    first, other = trained[2]
    plan = first["strategy_plan"]
    assert plan["planner_started_before_s_by_rank"] == [None, None]  # each rank's process started at its request
    same = ("chosen", "options", "candidates", "setup", "cluster")  # not "seconds": each rank's own wait
    assert {k: plan[k] for k in same} == {k: other["strategy_plan"][k] for k in same}, "the ranks differ"
    assert other["config"]["strategy"] == first["config"]["strategy"]
    candidates = {c["system"]: c for c in plan["candidates"]}
    assert list(candidates) == ["autosp", "autosp-ring"] and all(c["refused"] is None for c in candidates.values())
    fastest = min((c for c in candidates.values() if c["fits"]), key=lambda c: c["step_time_s"])
    assert plan["chosen"] == fastest["system"] and plan["options"] == fastest["options"]
    assert first["config"]["strategy"] == plan["options"]["strategy"] == fastest["strategy"]
    assert plan["setup"]["seq_len"] == SEQ_LEN and plan["setup"]["sp_size"] == SP and plan["cluster"] == "cpu-gloo"
    assert any(m.startswith(f"strategy auto at {SEQ_LEN} tokens on cpu-gloo: {plan['chosen']}")
               for m in first["log"]), first["log"]
    assert first["plan"] is None  # no memory plan: the memory options as given


def test_auto_strategy_with_the_memory_planned_trains_exactly_with_one_decision_over_both(trained):
    """``strategy="auto", memory_plan="auto"``: one planner decision over every strategy's memory candidates (Note
    [The strategy and the memory in one decision] in autosp/plan/strategy_choice.py), taken at compile; both ranks
    compile the candidate it names, the fastest that fits by the candidates' own predictions, and train exactly."""
    _check([[r] for r in trained[4]], FP32_TOL)
    first, other = trained[4]
    plan, strategy = first["plan"], first["strategy_plan"]
    assert {k: plan[k] for k in ("chosen", "options", "candidates")} == \
        {k: other["plan"][k] for k in ("chosen", "options", "candidates")}, "the ranks differ"
    systems = {c["plan"].split(": ", 1)[0] for c in plan["candidates"]}
    assert systems == {"autosp", "autosp-ring"}, systems  # Ulysses and the ring over 2 ranks, each planned
    ulysses_alone = trained[1][0][0]["plan"]["candidates"]  # the Llama case: Ulysses under the same target
    assert [c["plan"] for c in plan["candidates"]] == [f"{s}: {c['plan']}" for s in ("autosp", "autosp-ring")
                                                       for c in ulysses_alone]
    fitting = [c for c in plan["candidates"] if c["fits"]]
    fastest = min(fitting, key=lambda c: (c["step_time_s"], c["peak_bytes"]))
    chosen = plan["candidates"][plan["chosen"]]
    assert chosen["step_time_s"] == fastest["step_time_s"] and chosen["fits"]
    assert any(c["refused"] is None and not c["fits"] for c in plan["candidates"])  # the target binds
    assert strategy["with_memory_plan"] and strategy["chosen"] == chosen["plan"].split(": ", 1)[0]
    assert first["config"]["strategy"] == strategy["options"]["strategy"] == chosen["options"]["strategy"]
    assert first["config"]["memory_plan"] == "auto" and plan["setup"]["micro_batch"] == ROWS
    for name, value in chosen["options"].items():
        if name in first["config"]:
            assert first["config"][name] == value, (name, first["config"][name], value)


def test_auto_plan_trains_exactly(trained):
    _check(trained[1], FP32_TOL)
    for per_rank in trained[1]:  # every rank's planner process was started when the model was compiled
        assert all(s > 0 for r in per_rank for s in r["plan"]["planner_started_before_s_by_rank"])
        assert all(r["config"]["memory_plan"] == "auto" for r in per_rank)  # the default case planned too
    assert trained[2][0]["config"]["memory_plan"] == "off"  # strategy="auto" leaves the memory options as given


def test_default_memory_plan_plans_where_a_plan_can_be_made(caplog, monkeypatch):
    """memory_plan=None (the default) is "auto" where memory_plan="auto" would plan, else "off" with the reason
    logged and the planner's options dropped (Note [The default memory plan] in autosp/plan/auto.py).  The GPU
    cases see a GPU of the given name (this machine has none): what the resolution reads of one."""
    import autosp.plan.auto as auto
    from autosp.config import AutoSPConfig
    from autosp.plan.auto import resolve_memory_plan
    from experiments.models import build_model

    default = AutoSPConfig(sp_size=2)
    assert default.memory_plan is None
    hf = build_model("hf-llama", **SIZES)
    caplog.set_level(logging.INFO, logger="autosp.plan.auto")
    assert resolve_memory_plan(hf, dataclasses.replace(default, target_memory=2**20)).memory_plan == "auto"

    def unplanned(model, config, named):
        caplog.clear()
        resolved = resolve_memory_plan(model, config)
        assert resolved.memory_plan == "off", config
        assert resolved.plan_setup is None and resolved.plan_timeout_s == AutoSPConfig.plan_timeout_s, resolved
        assert any("memory_plan: not planned" in m and named in m for m in caplog.messages), caplog.messages

    unplanned(hf, dataclasses.replace(default, plan_timeout_s=9.0), "a cpu model has no memory size to plan for")
    gpu = {"name": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(auto, "_device_of", lambda module: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu["name"])
    assert resolve_memory_plan(hf, default).memory_plan == "auto"  # a GPU's memory is the target
    unplanned(build_model("plain-llama", layers=1), dataclasses.replace(default, plan_setup={"zero_stage": 2}),
              "no Hugging Face config")
    unplanned(hf, dataclasses.replace(default, plan_setup={"zero_stage": 3}), "ZeRO 3")  # DeepSpeed's ZeRO 3
    unplanned(build_model("hf-qwen2", **SIZES).half(), default, "fp32 or bf16 parameters")
    hybrid = dataclasses.replace(default, sp_size=4, strategy="hybrid", ulysses_size=2)
    assert resolve_memory_plan(hf, hybrid).memory_plan == "auto"  # every compiled strategy is planned
    gpu["name"] = "Tesla T4"
    unplanned(hf, default, "no hardware preset for the GPU 'Tesla T4'")
    monkeypatch.undo()
    # ZeRO 3 asked for on a planned compile: the planner's refusal, not a silent "off"
    with pytest.raises(AutoSPError, match="ZeRO 3"):
        resolve_memory_plan(hf, dataclasses.replace(default, target_memory=2**20, plan_setup={"zero_stage": 3}))
    # strategy="auto" decides the strategy and keeps its planning options; explicit values stay as given
    auto = dataclasses.replace(default, strategy="auto", plan_seq_len=64)
    assert resolve_memory_plan(hf, auto) == dataclasses.replace(auto, memory_plan="off")
    for explicit in ("off", "auto"):
        config = dataclasses.replace(default, memory_plan=explicit)
        assert resolve_memory_plan(hf, config) is config


@pytest.mark.parametrize("strategy, degrees, fixed", [
    ("ulysses", {}, {}),  # the candidates' own strategy: no option fixed
    ("ring", {}, {"strategy": "ring"}),
    ("hybrid", {"ulysses_size": 2}, {"strategy": "hybrid", "ulysses_size": 2}),
    ("hybrid", {"ring_size": 4}, {"strategy": "hybrid", "ulysses_size": 2}),
])
def test_every_candidate_of_a_planned_compile_keeps_its_strategy_and_degrees(strategy, degrees, fixed):
    """The planner process predicts the program the ranks will compile: the strategy, and the hybrid's Ulysses degree
    however it was given, fixed in every candidate (`autosp.plan.auto.plan_request`)."""
    from autosp.config import AutoSPConfig
    from autosp.plan.auto import plan_request
    from experiments.models import build_model

    config = AutoSPConfig(sp_size=8, strategy=strategy, target_memory=2**30, **degrees)
    request = plan_request(build_model("hf-llama", **SIZES), config, seq_len=SEQ_LEN, micro_batch=1, world_size=8,
                           explicit={})
    assert len(request["plans"]) == 6 * 2 * 2 * 2  # checkpointing x tiled loss x tiled MLP x offload
    for _, options in request["plans"]:
        assert {k: options[k] for k in ("strategy", "ulysses_size", "ring_size") if k in options} == fixed, options


def test_auto_plan_is_the_fastest_candidate_that_fits(trained):
    cases, results = trained[:2]
    for case, r, other in zip(cases, results[0], results[1], strict=True):
        plan, where = r["plan"], case["model"]
        assert plan["options"] == other["plan"]["options"], f"{where}: the ranks compiled different plans"
        # Each plan also with activation offload, priced on the CPU preset's measured host-memory link, and
        # predicted only where the same plan does not fit without it (Note [Offload only where it is needed] in
        # autosp/plan/planner.py; 1 layer: the last layer's activations stay on the device, so nothing moves).
        offload = [c for c in plan["candidates"] if c["options"].get("activation_offload") == "on"]
        assert len(offload) == case["candidates"] and len(plan["candidates"]) == 2 * len(offload)
        fitting = [{"activation_offload": "off", **c["options"]} for c in plan["candidates"] if c["fits"]]
        for c in offload:
            needless = {**c["options"], "activation_offload": "off"} in fitting
            assert (c["refused"] == NEEDLESS_OFFLOAD) == needless, (where, c["plan"], c["refused"])
        assert any(c["refused"] == NEEDLESS_OFFLOAD for c in offload), where
        candidates = [c for c in plan["candidates"] if c["refused"] is None]
        for c in candidates:  # fits means: the predicted peak within the target less the planner's margin
            assert c["fits"] == (c["peak_bytes"] <= planning_capacity(case["target"])), (where, c["plan"])
        best = min((c for c in candidates if c["fits"]), key=lambda c: (c["step_time_s"], c["peak_bytes"]))
        chosen = plan["candidates"][plan["chosen"]]
        assert chosen["plan"] == best["plan"], f"{where}: chose {chosen['plan']}, the fastest that fits is {best['plan']}"
        assert plan["options"] == chosen["options"]
        # The model compiled with the chosen options (those it does not set keep their defaults).
        for name, value in chosen["options"].items():
            assert r["config"][name] == value, (where, name)
        for option, op in TILED_OPS.items():
            assert (f"autosp_testbed.{op}.default" in r["ops"]) == (chosen["options"].get(option) == "on"), \
                (where, option)
        # Every checkpointing setting x tiled loss x tiled MLP (unless passed) is a candidate.
        settings = {(c["options"]["checkpointing"], c["options"].get("sac_memory_budget"), c["options"]["tiled_loss"],
                     c["options"]["tiled_mlp"], c["options"].get("mlp_chunk_tokens"),
                     c["options"].get("activation_offload")) for c in candidates}
        assert len(settings) == len(candidates), settings
        assert all(c["options"].items() >= case["explicit"].items() for c in candidates), where
        baseline = next(c for c in candidates if c["options"] == case["baseline"])
        assert baseline["peak_bytes"] == case["baseline_peak"] and not baseline["fits"], where
        assert chosen["options"] != case["baseline"]  # so the plan chose a memory technique
        assert plan["setup"]["seq_len"] == SEQ_LEN and plan["setup"]["micro_batch"] == ROWS
        assert plan["setup"]["zero_stage"] == 0  # a plain job: no ZeRO unless plan_setup says so
        assert plan["explicit"] == case["explicit"]
        assert any(m.startswith("memory plan at 64 tokens x 2 rows") for m in r["log"]), r["log"]
        assert any("explicit options win over the plan" in m for m in r["log"]) == bool(case["explicit"]), r["log"]


def test_the_candidates_spread_over_the_ranks_are_predicted_as_one_process_predicts_them(trained, tmp_path):
    """Each rank predicts its share of the candidates' trace groups (Note [Candidates spread over the ranks] in
    autosp/plan/auto.py): both ranks predicted some, every rank holds the same rows, and the rows, the choice and
    the counts equal those of one process planning every candidate (`plan_memory`) for the same request."""
    from autosp.plan import TrainingSetup, load_cluster
    from autosp.plan.candidates import MemoryPlan
    from autosp.plan.planner import plan_memory
    from autosp.plan.shares import plan_groups
    from experiments.models import build_model

    cases, results = trained[:2]
    case, plan, other = cases[0], results[0][0]["plan"], results[1][0]["plan"]  # Llama: 4 trace groups, 2 a rank
    same = ("candidates", "chosen", "reason", "traces", "partitions")
    assert {k: plan[k] for k in same} == {k: other[k] for k in same}, "the ranks differ"
    plans = [MemoryPlan(c["plan"], c["options"]) for c in plan["candidates"]]
    groups = plan_groups(plans)
    assert len(groups) == 4 and sorted(i for g in groups for i in g) == list(range(len(plans)))
    for rank in (0, 1):  # whole groups, alternately
        assert {plan["candidates"][i]["rank"] for g in groups[rank::2] for i in g} == {rank}
    assert all(s > 0 for s in plan["planner_seconds_by_rank"])
    path = tmp_path / "config.json"
    path.write_text(build_model(case["model"], **SIZES).config.to_json_string(use_diff=False))
    setup = TrainingSetup(**plan["setup"])
    alone = plan_memory(str(path), setup, load_cluster(plan["cluster"], world_size=setup.world_size),
                        target_memory=plan["target_memory_bytes"], plans=plans).to_dict()
    assert [{k: v for k, v in c.items() if k != "rank"} for c in plan["candidates"]] == alone["candidates"]
    assert {k: plan[k] for k in same[1:]} == {k: alone[k] for k in same[1:]}


def test_a_planner_without_an_answer_in_plan_timeout_s_is_every_ranks_error_with_its_stacks(trained):
    first, other = trained[3]
    assert first["error"] is not None and first["error"] == other["error"], trained[3]
    assert first["error"].startswith("memory_plan='auto': the planner process gave no answer within 0.5 s "
                                     "(plan_timeout_s)"), first["error"]
    assert "Fatal Python error: Aborted" in first["error"] and 'File "' in first["error"], first["error"]


def test_memory_plan_refusals_name_what_to_change():
    import autosp
    from experiments.models import build_model

    model = build_model("hf-llama", **SIZES)
    with pytest.raises(AutoSPError, match=r"target_memory=BYTES"):
        autosp.compile(model, sp_size=2, memory_plan="auto")
    with pytest.raises(AutoSPError, match="memory_plan='auto' or strategy='auto' too"):
        autosp.compile(model, sp_size=2, memory_plan="off", target_memory=2**20)
    # The default plans wherever it can (Note [The default memory plan]): asking for a plan where none can be made
    # is refused, saying why; without such an option the compile goes on unplanned.
    plain = build_model("plain-llama", layers=1)
    with pytest.raises(AutoSPError, match=r"target_memory= ask\(s\) for a memory plan.*no Hugging Face config"):
        autosp.compile(plain, sp_size=2, target_memory=2**20)
    with pytest.raises(AutoSPError, match=r"activation_offload='auto' ask\(s\) for a memory plan.*target_memory="):
        autosp.compile(model, sp_size=2, activation_offload="auto")
    with pytest.raises(AutoSPError, match=r"plan_cluster= ask\(s\) for a memory plan.*cpu model has no memory size"):
        autosp.compile(model, sp_size=4, strategy="hybrid", ulysses_size=2, plan_cluster="cpu-gloo")
    with pytest.raises(AutoSPError, match="memory_plan must be one of"):
        autosp.compile(model, sp_size=2, memory_plan="on")
    with pytest.raises(AutoSPError, match="plan_seq_len=63 is not a multiple of sp_size=2"):
        autosp.compile(model, sp_size=2, memory_plan="auto", target_memory=2**20, plan_seq_len=63)
    with pytest.raises(AutoSPError, match="plan_timeout_s must be a positive number of seconds"):
        autosp.compile(model, sp_size=2, memory_plan="auto", target_memory=2**20, plan_timeout_s=0)
    with pytest.raises(AutoSPError, match="plan_setup must be a dict of"):
        autosp.compile(model, sp_size=2, memory_plan="auto", target_memory=2**20, plan_setup={"zero": 2})
    with pytest.raises(AutoSPError, match="ZeRO 3"):
        autosp.compile(model, sp_size=2, memory_plan="auto", target_memory=2**20, plan_setup={"zero_stage": 3})
    with pytest.raises(AutoSPError, match="no Hugging Face config"):
        autosp.compile(build_model("plain-llama", layers=1), sp_size=2, memory_plan="auto", target_memory=2**20)
    # strategy="auto": what it needs, and what it is not combined with (refused before any planning).
    with pytest.raises(AutoSPError, match="pass plan_seq_len="):
        autosp.compile(model, sp_size=2, strategy="auto")
    with pytest.raises(AutoSPError, match="give sp_size >= 2"):
        autosp.compile(model, sp_size=1, strategy="auto", plan_seq_len=64)
    with pytest.raises(AutoSPError, match=r"take\(s\) effect only with strategy='hybrid'"):
        autosp.compile(model, sp_size=2, strategy="auto", plan_seq_len=64, ulysses_size=2)
    with pytest.raises(AutoSPError, match="strategy='auto' plans for a Hugging Face model"):
        autosp.compile(build_model("plain-llama", layers=1), sp_size=2, strategy="auto", plan_seq_len=64)


def _first_batches(rank, world):
    import torch.distributed as dist

    from autosp.plan.auto import DecidedAtCompile

    plan = DecidedAtCompile({"options": {"checkpointing": "sac"}}, seq_len=64, micro_batch=2, group=dist.group.WORLD)
    answers = []
    # rank 1's batch is longer than planned in the second call: every rank refuses, none waits in the collective
    for seq_len, rows in ((64, 2), (64 if rank == 0 else 128, 1), (32, 3)):
        try:
            answers.append(plan.decide(None, None, seq_len=seq_len, micro_batch=rows, device=torch.device("cpu")))
        except AutoSPError as err:
            answers.append(str(err))
    return answers


def test_a_strategy_decided_with_the_memory_refuses_a_first_batch_beyond_what_was_planned():
    """`DecidedAtCompile`: the decision taken at compile for ``plan_seq_len`` tokens x ``plan_setup``'s rows is the
    first batch's when the batch is within it on every rank, and every rank's one-line refusal naming what to pass
    when any rank's batch is longer or wider."""
    for answers in run_on_ranks(_first_batches, 2, timeout_s=120):
        assert answers[0] == {"options": {"checkpointing": "sac"}}
        assert "planned 2 x 64 tokens" in answers[1] and "first batch is 1 x 128" in answers[1]
        assert "pass plan_seq_len=128 and plan_setup={'micro_batch': 2}" in answers[1]
        assert "first batch is 3 x 32" in answers[2] and "plan_seq_len=64 and plan_setup={'micro_batch': 3}" in answers[2]
