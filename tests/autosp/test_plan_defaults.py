"""The defaults of ``python -m autosp.plan`` are the library's (Note [The planner CLI's defaults] in
autosp/plan/__main__.py): the memory planned and the training setup a compiled model's own plan assumes, every rank
of the cluster with SP inside a node, one spelling per option value, and every answer starting with what it assumed.

All but two tests resolve the flags without predicting anything; the end-to-end runs are tiny-llama's prediction on
the example two-node cluster file and the ring's longest-length search.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autosp.errors import AutoSPError
from autosp.plan.__main__ import (
    ClusterShape,
    build_parser,
    cluster_shape,
    library_setup,
    main,
    resolve,
    resolve_ranks,
)
from autosp.plan.setup import TrainingSetup

ROOT = Path(__file__).resolve().parents[2]
TWO_NODES = str(ROOT / "docs" / "examples" / "two_node_cluster.json")  # 2 nodes of 4 GPUs


def _args(*argv: str, cluster: str = "h100-sxm", seq_len: str = "1024"):
    return build_parser().parse_args(["--model", "tiny-llama", "--cluster", cluster, "--seq-len", seq_len, *argv])


def test_defaults_are_the_setup_a_compiled_models_own_plan_prices():
    """Left unset, ZeRO, optimizer, offload, compiler and dtype are what `autosp.plan.auto` puts in the plan request
    of a job nothing describes (a bf16 model, so its dtype is the CLI's default too), and the memory is planned."""
    import torch

    from autosp.config import AutoSPConfig
    from autosp.plan.auto import _setup

    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    compiled = TrainingSetup(**_setup(model, AutoSPConfig(sp_size=8), seq_len=1024, micro_batch=1, world_size=8))
    resolved = resolve(_args())
    assert resolved.memory_plan == "auto" and not resolved.zero_auto
    assert resolved.setup == compiled
    assert (compiled.zero_stage, compiled.optimizer, compiled.offload) == (0, "adamw", "none")
    lib = library_setup()
    assert {k: lib[k] for k in ("zero_stage", "optimizer", "offload", "dtype", "compiler")} == {
        "zero_stage": 0, "optimizer": "adamw", "offload": "none", "dtype": "bf16", "compiler": "inductor"}
    assumed = {a.key: a for a in resolved.assumed}
    assert list(assumed) == ["world_size", "nodes", "sp_size", "dp_size", "zero_stage", "optimizer", "offload",
                             "strategy", "memory_plan", "dtype"]
    assert not any(a.given for a in assumed.values())
    # given flags are marked given, and win
    given = resolve(_args("--zero-stage", "2", "--optimizer", "sgd", "--memory-plan", "off", "--dtype", "fp32"))
    assert (given.setup.zero_stage, given.setup.optimizer, given.setup.dtype, given.memory_plan) == (
        2, "sgd", "fp32", "off")
    marked = {a.key: a.given for a in given.assumed}
    assert marked["zero_stage"] and marked["optimizer"] and marked["memory_plan"] and marked["dtype"]
    assert not marked["offload"]


def test_memory_plan_has_the_librarys_spelling_and_none_maps_to_off_with_a_warning(caplog):
    from autosp.config import MEMORY_PLAN

    action = next(a for a in build_parser()._actions if a.dest == "memory_plan")
    assert tuple(action.choices) == MEMORY_PLAN == ("off", "auto")
    with caplog.at_level("WARNING", logger="autosp.plan"):
        args = _args("--memory-plan", "none")
    assert args.memory_plan == "off" and resolve(args).memory_plan == "off"
    assert "--memory-plan none is deprecated" in caplog.text and "off" in caplog.text
    with pytest.raises(SystemExit) as exc:
        _args("--memory-plan", "nothing")
    assert exc.value.code == 2


@pytest.mark.parametrize("argv, why", [
    (("--strategy", "auto"), "leaves the memory options as given"),
    (("--max-length",), "--max-length searches the options as given"),
])
def test_memory_plan_defaults_to_off_where_the_compile_or_this_command_does_not_plan(argv, why):
    resolved = resolve(_args(*argv))
    plan = next(a for a in resolved.assumed if a.key == "memory_plan")
    assert resolved.memory_plan == "off" and not plan.given and why in plan.why


def test_memory_plan_defaults_to_auto_under_every_strategy_the_planner_plans():
    from simulator.workload import MEMORY_PLANNED_STRATEGIES

    assert {"ring", "hybrid"} <= set(MEMORY_PLANNED_STRATEGIES)
    for strategy in MEMORY_PLANNED_STRATEGIES:
        resolved = resolve(_args("--strategy", strategy, *(("--ulysses-size", "2") if strategy == "hybrid" else ())))
        plan = next(a for a in resolved.assumed if a.key == "memory_plan")
        assert resolved.memory_plan == "auto" and not plan.given and "as autosp.compile plans" in plan.why


def test_zero_stage_auto_lets_the_planner_choose_and_needs_the_memory_plan():
    resolved = resolve(_args("--zero-stage", "auto"))
    assert resolved.zero_auto and next(a for a in resolved.assumed if a.key == "zero_stage").value == "auto"
    with pytest.raises(AutoSPError, match="--zero-stage auto chooses the DeepSpeed setup with the memory plan"):
        resolve(_args("--zero-stage", "auto", "--memory-plan", "off"))


def test_engine_says_what_steps_zero_3s_shards_and_is_priced_so():
    """--engine with --zero-stage 3: the setup priced is the engine's (DeepSpeed's fp32 master copies of the bf16
    shards hold more than a plain optimizer over them), the answer says which engine it assumed, and --engine
    anywhere else is refused naming the fix."""
    from autosp.plan import ModelSource, load_cluster
    from autosp.plan.prediction import held_before_activations

    held = {}
    for engine in ("torch", "deepspeed"):
        resolved = resolve(_args("--zero-stage", "3", "--engine", engine, "--sp-size", "2"))
        assumed = next(a for a in resolved.assumed if a.key == "engine")
        assert resolved.setup.engine == engine and assumed.value == engine and assumed.given
        held[engine] = sum(held_before_activations("tiny-llama", resolved.setup, load_cluster("h100-sxm", world_size=2),
                                                   source=ModelSource("tiny-llama")).values())
    assert held["deepspeed"] > held["torch"], held
    default = next(a for a in resolve(_args("--zero-stage", "3")).assumed if a.key == "engine")
    assert (default.value, default.given) == ("torch", False) and "else torch" in default.why
    offloaded = resolve(_args("--zero-stage", "3", "--offload", "optimizer"))
    assert next(a for a in offloaded.assumed if a.key == "engine").value == "deepspeed"
    assert not any(a.key == "engine" for a in resolve(_args("--zero-stage", "2")).assumed)
    for stage in ("2", "auto"):
        with pytest.raises(AutoSPError, match="drop --engine, or give --zero-stage 3"):
            resolve(_args("--zero-stage", stage, "--engine", "deepspeed"))


def test_sp_defaults_to_one_nodes_ranks_and_the_rest_are_dp_replicas_on_a_two_node_cluster_file():
    shape = cluster_shape(TWO_NODES)
    assert (shape.devices_per_node, shape.ranks) == (4, 8)
    resolved = resolve(_args(cluster=TWO_NODES))
    assert (resolved.setup.sp_size, resolved.setup.dp_size, resolved.setup.world_size) == (4, 2, 8)
    assumed = {a.key: a for a in resolved.assumed}
    assert assumed["world_size"].why == "every rank of the cluster" and assumed["nodes"].value == 2
    assert assumed["nodes"].given and not assumed["sp_size"].given and not assumed["dp_size"].given
    # a hardware preset is one node unless the ranks given need more; a cluster preset is all of itself
    assert (resolve_ranks(ClusterShape("h100-sxm", 8)).sp_size, resolve_ranks(ClusterShape("h100-sxm", 8)).dp_size) \
        == (8, 1)
    big = resolve_ranks(cluster_shape("h100-sxm-4x8"))
    assert (big.sp_size, big.dp_size, big.nodes) == (8, 4, 4)
    # --sp-size alone: as many groups as the cluster's ranks hold inside nodes
    assert (resolve_ranks(shape, sp_size=2).dp_size, resolve_ranks(ClusterShape("h100-sxm", 8), sp_size=4).dp_size) \
        == (4, 2)
    # told otherwise: the ranks given
    told = resolve_ranks(shape, world_size=4)
    assert (told.sp_size, told.dp_size, told.nodes) == (4, 1, 1) and told.assumed[0].given


@pytest.mark.parametrize("cluster, argv", [
    (TWO_NODES, ("--sp-size", "8")),
    ("h100-sxm", ("--sp-size", "16")),
])
def test_an_sp_group_across_nodes_is_refused_unless_allowed(cluster, argv):
    with pytest.raises(AutoSPError, match="--allow-cross-node-sp") as exc:
        resolve(_args(*argv, cluster=cluster))
    assert "\n" not in str(exc.value) and "more than a node's" in str(exc.value)
    allowed = resolve(_args(*argv, "--allow-cross-node-sp", "--strategy", "ring", cluster=cluster))  # 8 heads
    assert (allowed.setup.sp_size, allowed.setup.dp_size) == (int(argv[1]), 1)
    assert "across nodes" in next(a for a in allowed.assumed if a.key == "sp_size").why
    # a group straddling a node boundary is refused too (3 + 3 ranks on nodes of 4)
    with pytest.raises(AutoSPError, match="across two nodes"):
        resolve_ranks(cluster_shape(TWO_NODES), sp_size=3, dp_size=2)


def test_more_ranks_than_the_cluster_has_are_refused():
    with pytest.raises(AutoSPError, match="has 8"):
        resolve(_args("--sp-size", "4", "--dp-size", "4", cluster=TWO_NODES))


def test_every_answer_starts_with_its_assumptions_in_text_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["--model", "tiny-llama", "--cluster", TWO_NODES, "--seq-len", "256", "--memory-plan", "off",
            "--compiler", "aot_eager", "--json", str(out), "-q"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    block = text.split("\n")[:11]
    assert block[0] == "assumed:"
    for label, line in zip(("world size", "nodes", "sp size", "dp size", "zero stage", "optimizer", "offload",
                            "strategy", "memory plan", "dtype"), block[1:], strict=True):
        assert line.startswith(f"  {label}"), line
    assert "  sp size      4 (default" in text and "  memory plan  off (given)" in text
    document = json.loads(out.read_text())
    assert next(iter(document)) == "assumed"
    assumed = document["assumed"]
    assert assumed["sp_size"] == {"value": 4, "given": False, "why": "a node's GPUs: SP inside one node"}
    assert assumed["memory_plan"] == {"value": "off", "given": True, "why": ""}
    assert assumed["zero_stage"]["value"] == 0 and not assumed["zero_stage"]["given"]
    assert document["setup"]["sp_size"] == 4 and document["world_size"] == 8 and document["setup"]["zero_stage"] == 0


def test_ring_is_planned_with_its_strategy_in_every_candidate_and_searched_for_its_longest_length(
        monkeypatch, capsys):
    """``--strategy ring`` composes with the memory plan (every candidate traced as a ring program, as
    ``autosp.compile(strategy="ring")`` plans) and with ``--max-length`` (the ring program's longest length)."""
    from autosp.plan import planner

    asked = {}

    def planned(*args, plans, **kwargs):  # the candidates the CLI asks for, then stop before predicting any
        asked["plans"] = plans
        raise AutoSPError("stopped by the test")

    monkeypatch.setattr(planner, "plan_memory", planned)
    assert main(["--model", "tiny-llama", "--cluster", "h100-sxm", "--seq-len", "256", "--sp-size", "2",
                 "--strategy", "ring", "-q"]) == 2
    assert len(asked["plans"]) > 1 and all(p.options["strategy"] == "ring" for p in asked["plans"])
    monkeypatch.undo()
    assert main(["--model", "tiny-llama", "--cluster", "a100-80gb-sxm", "--seq-len", "256", "--sp-size", "2",
                 "--world-size", "2", "--dtype", "fp32", "--compiler", "aot_eager", "--strategy", "ring",
                 "--max-length", "--max-length-high", "512", "--granularity", "256", "-q"]) == 0
    out = capsys.readouterr().out
    assert "strategy     ring (given)" in out and "memory plan  off" in out
    assert "max length  ≥ 512 tokens (ceiling)" in out  # a tiny model fits an A100 at any length here


def test_hybrid_is_planned_at_its_ulysses_degree_in_every_candidate(monkeypatch):
    """``--strategy hybrid --ulysses-size U`` is what ``autosp.compile(strategy="hybrid", ulysses_size=U)`` plans:
    every candidate the CLI asks the planner for is that program (the planner stubbed: no prediction)."""
    from autosp.plan import planner

    resolved = resolve(_args("--strategy", "hybrid", "--ulysses-size", "2", "--sp-size", "4"))
    assert resolved.memory_plan == "auto" and resolved.strategy_options == {"strategy": "hybrid", "ulysses_size": 2}
    strategy = next(a for a in resolved.assumed if a.key == "strategy")
    assert (strategy.value, strategy.given) == ("hybrid (Ulysses 2 x ring 2)", True)
    asked = {}

    def planned(*args, plans, **kwargs):
        asked["plans"] = plans
        raise AutoSPError("stopped by the test")

    monkeypatch.setattr(planner, "plan_memory", planned)
    assert main(["--model", "tiny-llama", "--cluster", "h100-sxm", "--seq-len", "256", "--sp-size", "4",
                 "--strategy", "hybrid", "--ulysses-size", "2", "-q"]) == 2
    assert len(asked["plans"]) > 1
    assert all((p.options["strategy"], p.options["ulysses_size"]) == ("hybrid", 2) for p in asked["plans"])


@pytest.mark.parametrize("argv, message", [
    (("--strategy", "hybrid"), "--strategy hybrid needs its Ulysses degree: give --ulysses-size, a divisor of "
                               "--sp-size 8"),
    (("--strategy", "ring", "--ulysses-size", "2"), "--ulysses-size is the hybrid's Ulysses degree, and the "
                                                    "strategy is ring"),
    (("--strategy", "auto", "--ulysses-size", "2"), "and the strategy is auto"),
    (("--strategy", "hybrid", "--ulysses-size", "3"), "ulysses_size=3 does not divide sp_size=8"),
    (("--strategy", "hybrid", "--ulysses-size", "2", "--zero-stage", "3"), "priced under --strategy ulysses only, "
                                                                          "not hybrid"),
    (("--strategy", "ring", "--zero-stage", "3"), "priced under --strategy ulysses only, not ring"),
])
def test_strategy_degrees_are_refused_before_any_work_naming_the_fix(argv, message):
    with pytest.raises(AutoSPError) as refused:
        resolve(_args(*argv))
    assert message in str(refused.value), str(refused.value)


def _heads_config(tmp_path, heads: int) -> str:
    """tiny-llama's config with ``heads`` query heads (2 kv heads, 16 dims a head)."""
    from autosp.presets import hf_config

    config = hf_config("tiny-llama", seq_len=1024).to_dict()
    config.update(num_attention_heads=heads, num_key_value_heads=2, hidden_size=16 * heads, head_dim=16)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("heads, strategy, fix", [
    (28, (), "give --strategy hybrid --ulysses-size 4 (Ulysses over 4 ranks, a ring over 2), --strategy ring"),
    (28, ("--strategy", "hybrid", "--ulysses-size", "8"), "give --strategy hybrid --ulysses-size 4"),
    (14, (), "give --strategy hybrid --ulysses-size 2 (Ulysses over 2 ranks, a ring over 4), --strategy ring"),
    (14, ("--strategy", "hybrid", "--ulysses-size", "4"), "give --strategy hybrid --ulysses-size 2"),
    (7, (), "give --strategy ring (any number of heads)"),  # no Ulysses degree above 1 divides 7
])
def test_heads_the_ulysses_groups_cannot_split_are_the_answer_before_any_work(tmp_path, heads, strategy, fix):
    """The binding limit of a model whose heads the SP degree does not divide is named at once, with the strategies
    that run it (as ``autosp.compile`` refuses the same compile), instead of a refusal per candidate."""
    model = _heads_config(tmp_path, heads)
    argv = ["--model", model, "--cluster", "h100-sxm", "--seq-len", "1024", *strategy]
    with pytest.raises(AutoSPError) as refused:
        resolve(build_parser().parse_args(argv))
    assert f"has {heads} attention heads" in str(refused.value) and fix in str(refused.value), str(refused.value)
    for runs in [("--strategy", "ring")] + [("--strategy", "hybrid", "--ulysses-size", "2")] * (heads % 2 == 0):
        assert resolve(build_parser().parse_args([*argv[:6], *runs])).memory_plan == "auto"


def test_model_states_over_the_memory_are_the_answer_without_a_trace(tmp_path):
    """Under ZeRO 0 (the library's plain loop) an 8B model's states alone exceed an H100: no candidate is traced,
    and the answer names what binds and what to change."""
    out = tmp_path / "plan.json"
    assert main(["--model", "llama-3.1-8b", "--cluster", "h100-sxm", "--seq-len", "65536", "--json", str(out),
                 "-q"]) == 0
    report = json.loads(out.read_text())
    assert report["traces"] == 0 and report["chosen"] is None and len(report["candidates"]) > 1
    assert {c["refused"] for c in report["candidates"]} == {report["reason"].split("one reason: ", 1)[1]}
    assert "under ZeRO 0" in report["reason"] and "--zero-stage auto" in report["reason"], report["reason"]


@pytest.mark.parametrize("zero, offload, change", [
    (1, "none", "--zero-stage auto chooses among ZeRO 1-3"),
    (2, "optimizer", "shard the parameters too (--zero-stage 3"),  # where --zero-stage auto ends (a 70B on 32 H100s)
    (3, "none", "use more ranks (every rank holds 1/N of the states)"),
])
def test_states_over_the_target_name_the_change_the_setup_leaves(zero, offload, change):
    """What to change follows the setup whose states fill the target: beyond the last DeepSpeed setup that
    ``--zero-stage auto`` tries, only ZeRO 3 or more ranks help, and it says so instead of ``--zero-stage auto``."""
    from autosp.plan.planner import states_over_target

    setup = TrainingSetup(seq_len=65536, sp_size=8, zero_stage=zero, offload=offload)
    why = states_over_target({"parameters": 131 * 2**30, "gradients": 2 * 2**30}, 80 * 2**30, setup)
    assert change in why and f"under ZeRO {zero}" in why, why
    assert ("--zero-stage auto" in why) == (zero == 1), why


def test_decision_progress_logs_each_candidate_with_the_time_left_off_a_terminal(caplog, monkeypatch):
    """Off a terminal (tqdm's bar disabled) each decided candidate is a log line with the time left at the mean
    rate; a decision that starts again (the next DeepSpeed setup) starts its count again."""
    from autosp.plan import progress

    clock = iter([0.0, 2.0, 4.0, 10.0, 11.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    shown = progress.DecisionProgress()
    with caplog.at_level("INFO", logger="autosp.plan"):
        shown(0, 4, "")
        shown(1, 4, "none")
        shown(2, 4, "sac")
        shown(0, 3, "")  # the next setup's decision
        shown(1, 3, "layer")
    shown.close()
    lines = [r.getMessage() for r in caplog.records if "candidates decided" in r.getMessage()]
    assert lines == ["memory plan: 1 of 4 candidates decided (none), 2 s, about 6 s left",
                     "memory plan: 2 of 4 candidates decided (sac), 4 s, about 4 s left",
                     "memory plan: 1 of 3 candidates decided (layer), 1 s, about 2 s left"]


def test_strategy_auto_with_the_memory_plan_is_one_decision_over_every_strategys_candidates(tmp_path, monkeypatch):
    """``--strategy auto --memory-plan auto`` asks the planner once, for every runnable strategy's memory candidates
    (Note [The strategy and the memory in one decision]): for 28 heads over 8 ranks the hybrids 4x2 and 2x4 and the
    ring, each with the candidates ``--strategy <it>`` plans, named by the strategy (the planner stubbed)."""
    from autosp.plan import planner

    model = _heads_config(tmp_path, 28)
    asked = []

    def planned(*args, plans, objective, **kwargs):
        asked.append((objective, plans))
        raise AutoSPError("stopped by the test")

    monkeypatch.setattr(planner, "plan_memory", planned)
    argv = ["--model", model, "--cluster", "h100-sxm", "--seq-len", "1024", "-q"]
    assert main([*argv, "--strategy", "auto", "--memory-plan", "auto", "--objective", "longest"]) == 2
    objective, plans = asked[0]
    by_system = {}
    for p in plans:
        system, name = p.name.split(": ", 1)
        by_system.setdefault(system, []).append((name, p.options))
    assert objective == "longest" and list(by_system) == ["autosp-hybrid-2x4", "autosp-hybrid-4x2", "autosp-ring"]
    for system, runs in [("autosp-hybrid-4x2", ("--strategy", "hybrid", "--ulysses-size", "4")),
                         ("autosp-hybrid-2x4", ("--strategy", "hybrid", "--ulysses-size", "2")),
                         ("autosp-ring", ("--strategy", "ring"))]:
        assert main([*argv, *runs]) == 2
        alone = asked[-1][1]
        assert [n for n, _ in by_system[system]] == [p.name for p in alone]
        for (_, options), own in zip(by_system[system], alone, strict=True):
            assert {k: v for k, v in options.items() if k != "ring_size"} == {**own.options,
                                                                              "strategy": options["strategy"]}


def test_strategy_auto_searches_the_longest_length_of_each_strategy():
    """``--strategy auto --max-length``: each strategy's longest length with the options as given, the one that
    trains longest chosen (a real search: tiny-llama on 2 ranks, up to 1,024 tokens)."""
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["--model", "tiny-llama", "--cluster", "h100-sxm", "--seq-len", "256", "--sp-size", "2",
                     "--strategy", "auto", "--max-length", "--max-length-high", "1024", "-q"]) == 0
    text = out.getvalue()
    assert "autosp: " in text and "autosp-ring: " in text and "objective longest" in text, text
    assert "chosen: autosp" in text, text


@pytest.mark.parametrize("argv, line", [
    (("--strategy", "ulysses"), "  strategy     ulysses (given)"),
    ((), "  strategy     ulysses (default: autosp.compile's)"),
])
def test_strategy_is_marked_given_when_named_even_as_the_librarys_default(argv, line, monkeypatch, capsys):
    """``--strategy`` defaults to None like every other flag: ``--strategy ulysses`` (autosp.compile's own) is given,
    an omitted one is the library's, assumed; the printed ``assumed:`` block says which (the planner stubbed: no
    prediction)."""
    from autosp.plan import planner
    from autosp.plan.__main__ import LIBRARY_STRATEGY

    assert LIBRARY_STRATEGY == "ulysses" and _args().strategy is None
    resolved = resolve(_args(*argv))
    strategy = next(a for a in resolved.assumed if a.key == "strategy")
    assert (resolved.strategy, strategy.value, strategy.given) == ("ulysses", "ulysses", bool(argv))
    assert resolved.memory_plan == "auto"  # the strategy resolved before the memory plan's default

    class Answer:
        def format(self) -> str:
            return "stub answer"

    asked = {}

    def planned(*args, plans, **kwargs):
        asked["plans"] = plans
        return Answer()

    monkeypatch.setattr(planner, "plan_memory", planned)
    assert main(["--model", "tiny-llama", "--cluster", "h100-sxm", "--seq-len", "256", "--sp-size", "2", *argv,
                 "-q"]) == 0
    block = capsys.readouterr().out.split("\n")
    assert block[0] == "assumed:" and line in block[1:11], block[:11]
    assert "stub answer" in block
    # the same candidates either way: the library's strategy is not fixed in them
    assert asked["plans"] and all("strategy" not in p.options for p in asked["plans"])


def test_workers_default_spreads_only_the_longest_length_search_over_the_usable_cores():
    """``--workers auto`` (the default): the longest-length search over the cores the process may run on, at most
    `AUTO_WORKERS_MAX`; a decision at one length in this process; a number given is kept."""
    from autosp.plan.shares import AUTO_WORKERS_MAX, WORKERS_AUTO, auto_workers, workers_for

    assert build_parser().parse_args(["--model", "tiny-llama", "--cluster", "h100-sxm", "--seq-len", "64"]).workers == WORKERS_AUTO
    assert [auto_workers("longest", cores) for cores in (1, 2, 3, 64)] == [1, 2, 3, AUTO_WORKERS_MAX]
    assert auto_workers("fastest", 64) == 1 and workers_for(WORKERS_AUTO, "fastest") == 1
    assert 1 <= workers_for(WORKERS_AUTO, "longest") <= AUTO_WORKERS_MAX
    assert workers_for(3, "fastest") == 3 and workers_for(1, "longest") == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "tiny-llama", "--cluster", "h100-sxm", "--seq-len", "64", "--workers", "0"])
