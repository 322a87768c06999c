"""``autosp.compile(..., memory_plan="auto")``: the compiled model plans its own memory options; and
``autosp.compile(..., strategy="auto")``: the model asks the planner which strategy to compile.

On its first call (`autosp.model.SequenceParallelModel`) the model learns what the plan needs: the sequence length
(``plan_seq_len``, else the longest first batch of the process group) and the rows per batch.  Rank 0 of the process
group then builds the request, and each rank runs the planner (`autosp.plan.plan_memory`, objective "fastest") on
its share of the candidates (Note [Candidates spread over the ranks]) for the Hugging Face config of the model in a
fresh Python process (``python -m autosp.plan.worker REQUEST OUT``): the planner traces on a fake process group of
its own, which cannot exist beside the job's, and resets Dynamo between traces, which must not touch the job's
compiled code.  That process was started when the model was compiled, so its imports are made by the first call
(Note [Planner process started ahead] in autosp/plan/process.py).  Every rank applies the one rule
(`autosp.plan.planner.choose_plan`) to all the rows, so all compile the same program (docs/design.md, "Memory
planner").

``strategy="auto"`` goes the same way (`decide_strategy`), once, inside ``autosp.compile`` (the strategy decides
the process groups it builds, so there is no first batch to wait for: ``plan_seq_len`` is required): each rank's
planner process predicts its share
(`autosp.plan.strategy_choice.predict_strategies`) for the model's config, ``plan_seq_len`` tokens and the cluster, and every
rank applies the one rule (`autosp.plan.strategy_choice.strategy_choice`) to all the rows and compiles the candidate it
chooses (Note [Candidates spread over the ranks]; docs/design.md, "Choosing a strategy").  A script that starts
its planner process before it loads its model (``autosp.start_planner()``, passed as ``planner=``) takes the
process's imports off the decision.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from autosp.config import PLANNING_OPTIONS, AutoSPConfig
from autosp.errors import AutoSPError
from autosp.plan.process import PlannerProcess
from autosp.plan.setup import PLAIN_TRAINING_LOOP
from simulator.workload import CHOSEN_STRATEGIES, MEMORY_PLANNED_STRATEGIES

log = logging.getLogger(__name__)

# Matching is by substring, first entry wins, so a name that contains another comes first: "GH200" before "H200";
# "GB200" before "B200", mapped to no preset: a GB200 superchip's B200 runs at another power limit, reaches its Grace
# host over NVLink-C2C and sits 4 to a tray in an NVLink domain of up to 72, so pricing it as the 8-GPU, PCIe-hosted
# b200 would be silently wrong; it is refused like any GPU without a preset. "MI300X" is matched as such ("AMD
# Instinct MI300X", also with a " VF" suffix in VMs); an MI300A or MI325X has no preset.
GPU_PRESETS = (("GH200", "gh200"), ("GB200", None), ("B200", "b200"), ("H200", "h200-sxm"), ("H100", "h100-sxm"),
               ("A100", "a100-80gb-sxm"), ("MI300X", "mi300x"), ("MI250", "mi250"))
"""A GPU's name (a substring of ``torch.cuda.get_device_name``) -> the hardware preset the plan is predicted on
(``None``: a GPU recognised as having no preset)."""
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
def hf_config_of(module: torch.nn.Module, planning: str = "memory_plan='auto'") -> dict:
    """The Hugging Face config of ``module`` as config.json fields; refused for a module the planner would not
    rebuild as it is (no config, or a class other than the causal LM of its config).  ``planning``: the option that
    asked, named in the refusal."""
    instead = ("choose the options with autosp.plan.choose_options(config_json, sp_size, seq_len, target_memory) "
               "and pass them to autosp.compile with memory_plan='off'" if planning.startswith("memory") else
               "choose the strategy with python -m autosp.plan --strategy auto (or autosp.plan."
               "choose_strategy) and pass it to autosp.compile")
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_json_string") or not getattr(config, "model_type", None):
        raise AutoSPError(
            f"{planning} plans for a Hugging Face model (it rebuilds the model from its config), and "
            f"{type(module).__name__} has no Hugging Face config: {instead}")
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        expected = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        expected = None
    if expected is not type(module):
        raise AutoSPError(
            f"{planning} rebuilds the model as the causal LM of its config "
            f"({getattr(expected, '__name__', None)}), which is not {type(module).__name__}: {instead}")
    return json.loads(config.to_json_string(use_diff=False))


def _device_of(module: torch.nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def check_plannable(module: torch.nn.Module, config: AutoSPConfig) -> None:
    """What `autosp.compile` refuses before any work when ``memory_plan="auto"`` or ``strategy="auto"``."""
    planning = "strategy='auto'" if config.strategy == "auto" else "memory_plan='auto'"
    hf_config_of(module, planning)
    if config.strategy not in (*MEMORY_PLANNED_STRATEGIES, *CHOSEN_STRATEGIES):
        raise AutoSPError(f"memory_plan='auto' does not plan a strategy={config.strategy!r} program yet; pass the "
                          "memory options yourself with memory_plan='off', or plan under strategy="
                          f"{' or '.join(map(repr, MEMORY_PLANNED_STRATEGIES))}")
    stage = (config.plan_setup or {}).get("zero_stage")
    if config.shard_parameters and stage not in (None, 3):
        raise AutoSPError(f"shard_parameters=True is priced as ZeRO 3, and plan_setup says zero_stage={stage}: drop "
                          "one (AutoSP's sharded parameters are ZeRO 3, under DeepSpeed or alone)")
    if stage == 3 and not config.shard_parameters:
        raise AutoSPError("plan_setup zero_stage=3 prices ZeRO 3 as AutoSP's own sharded parameters: pass "
                          "shard_parameters=True too (autosp.deepspeed_initialize does for a config with \"stage\": 3)")
    if config.shard_parameters and config.strategy != "ulysses":
        raise AutoSPError(f"{planning} prices shard_parameters=True (ZeRO 3) for strategy='ulysses' only: pass the "
                          "strategy and memory options yourself (memory_plan='off')")
    device = _device_of(module)
    if config.memory_plan == "auto" and config.target_memory is None and device.type != "cuda":
        raise AutoSPError(
            f"memory_plan='auto' on a {device.type} model needs the memory a rank may use: pass "
            "autosp.compile(model, ..., memory_plan='auto', target_memory=BYTES), e.g. target_memory=16 * 2**20 "
            "(the planner's peak per rank: the memory ledger plus the simulated activations)")
    dtype = next((p.dtype for p in module.parameters()), torch.float32)
    if dtype not in DTYPES:
        raise AutoSPError(f"{planning} plans for fp32 or bf16 parameters, not {dtype}; cast the model or "
                          "pass the options yourself")
    if config.plan_setup is not None:
        from autosp.plan.setup import TrainingSetup

        TrainingSetup(seq_len=config.sp_size, sp_size=config.sp_size, **config.plan_setup).check()


# Note [The default memory plan]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``memory_plan`` left at its default (None) plans wherever a plan can be made, so that the default compile is
# the planner's choice (it recomputes less than per-layer checkpointing where memory allows, and tiles and offloads
# where it does not; docs/design.md, "Memory planner").  A plan needs a Hugging Face causal LM in fp32 or bf16
# (the planner rebuilds it from its config), a memory size (a GPU's, or ``target_memory``), a strategy the planner
# plans under (every compiled one: Ulysses, the ring, the hybrid at its Ulysses degree) and, on a GPU, a hardware
# preset for it: what `check_plannable` asks of ``memory_plan="auto"``.  Where one is missing the model compiles with the options as given ("off", SAC by
# default, as before) and the log says which was missing.  Asking for a plan (``target_memory``, ``plan_seq_len``,
# ``plan_cluster`` or ``activation_offload="auto"``) on a compile that cannot be planned is refused, as with
# ``memory_plan="auto"``; ``strategy="auto"`` decides the strategy and leaves the memory options as given.

ASKS_FOR_A_PLAN = ("target_memory", "plan_seq_len", "plan_cluster")
"""Options that only make sense if the memory is planned: given with the default ``memory_plan``, a compile that
cannot be planned is refused instead of compiled unplanned (Note [The default memory plan])."""


def resolve_memory_plan(module: torch.nn.Module, config: AutoSPConfig) -> AutoSPConfig:
    """``config`` with the default ``memory_plan=None`` made "auto" where the compile can be planned, else "off"
    (Note [The default memory plan]); an explicit value is returned as it is."""
    if config.memory_plan is not None:
        return config
    if config.strategy == "auto":
        return dataclasses.replace(config, memory_plan="off")
    reason = _why_not_plannable(module, config)
    if reason is None:
        log.info("memory_plan: planned (the default wherever a plan can be made; memory_plan='off' keeps the "
                 "options as given)")
        return dataclasses.replace(config, memory_plan="auto")
    asked = [f"{name}=" for name in ASKS_FOR_A_PLAN if getattr(config, name) is not None]
    asked += ["activation_offload='auto'"] if config.activation_offload == "auto" else []
    if asked:
        raise AutoSPError(f"{', '.join(asked)} ask(s) for a memory plan, and this compile cannot be planned: {reason}")
    log.info("memory_plan: not planned, compiled with the options as given: %s", reason)
    unplanned = {f.name: f.default for f in dataclasses.fields(config) if f.name in PLANNING_OPTIONS}
    return dataclasses.replace(config, memory_plan="off", **unplanned)


def _why_not_plannable(module: torch.nn.Module, config: AutoSPConfig) -> str | None:
    """Why ``memory_plan="auto"`` would be refused for this compile (None: it would plan)."""
    device = _device_of(module)
    if config.target_memory is None and device.type != "cuda":
        return (f"a {device.type} model has no memory size to plan for (pass target_memory=BYTES per rank to plan "
                "for one)")
    try:
        check_plannable(module, dataclasses.replace(config, memory_plan="auto"))
        if device.type == "cuda" and config.plan_cluster is None:
            default_cluster(device)
    except AutoSPError as err:
        return str(err)
    return None


def default_cluster(device: torch.device) -> str:
    """The hardware preset of ``device``: cpu-gloo on CPU, else by the GPU's name (`GPU_PRESETS`)."""
    if device.type != "cuda":
        return "cpu-gloo"
    name = torch.cuda.get_device_name(device)
    preset = next((preset for part, preset in GPU_PRESETS if part in name), None)
    if preset is not None:
        return preset
    raise AutoSPError(f"memory_plan='auto': no hardware preset for the GPU {name!r}; pass plan_cluster= a preset "
                      "or a cluster file (python -m autosp.plan --help lists them)")


def _setup(module: torch.nn.Module, config: AutoSPConfig, *, seq_len: int, micro_batch: int,
           world_size: int) -> dict:
    """The `autosp.plan.TrainingSetup` fields of this job: what the job itself says (length, ranks, rows,
    parameters' dtype, compiler), over `PLAIN_TRAINING_LOOP`, under ``plan_setup`` (which wins)."""
    dtype = next((p.dtype for p in module.parameters()), torch.float32)
    return {"seq_len": seq_len, "sp_size": config.sp_size, "dp_size": world_size // config.sp_size,
            "micro_batch": micro_batch, "dtype": DTYPES[dtype], "compiler": config.compiler, **PLAIN_TRAINING_LOOP,
            **({"zero_stage": 3} if config.shard_parameters else {}), **(config.plan_setup or {})}


def compiled_strategy(config: AutoSPConfig) -> dict:
    """The strategy options every candidate of a planned compile keeps: none for Ulysses (the candidates' own), the
    strategy otherwise, with the hybrid's Ulysses degree (the degree decides the program as the strategy does)."""
    if config.strategy == "ulysses":
        return {}
    return {"strategy": config.strategy, **({"ulysses_size": config.ulysses_size} if config.layout.kind.grouped else {})}


def plan_request(module: torch.nn.Module, config: AutoSPConfig, *, seq_len: int, micro_batch: int, world_size: int,
                 explicit: Mapping) -> dict:
    """What the planner process needs: the model's config, the training setup, the cluster, the target and the
    candidates (`autosp.plan.candidate_plans`, with the explicitly passed options and the model's strategy
    fixed; under ``strategy="auto"`` every strategy's, `autosp.plan.strategy_choice.every_strategy_plans`)."""
    from autosp.plan.candidates import sized_candidate_plans

    device = _device_of(module)
    dtype = next((p.dtype for p in module.parameters()), torch.float32)
    target = config.target_memory
    if target is None:
        target = torch.cuda.get_device_properties(device).total_memory
    setup = _setup(module, config, seq_len=seq_len, micro_batch=micro_batch, world_size=world_size)
    hf = hf_config_of(module)
    itemsize = torch.empty((), dtype=dtype).element_size()

    def candidates(strategy: Mapping) -> tuple:
        return sized_candidate_plans(hf, itemsize=itemsize, target_memory=target, fixed={**explicit, **strategy})

    if config.strategy == "auto":  # Note [The strategy and the memory in one decision]
        from autosp.plan.setup import TrainingSetup
        from autosp.plan.strategy_choice import every_strategy_plans

        plans = every_strategy_plans(hf, TrainingSetup(**setup), candidates)
    else:
        plans = candidates(compiled_strategy(config))
    return {"decide": "memory", "model": f"{type(module).__name__}", "model_config": hf, "setup": setup,
            "cluster": config.plan_cluster or default_cluster(device), "target_memory": int(target),
            "plans": [[p.name, dict(p.options)] for p in plans]}


def strategy_request(module: torch.nn.Module, config: AutoSPConfig, *, world_size: int, explicit: Mapping) -> dict:
    """What the planner process needs to choose the strategy (`autosp.plan.strategy_choice.choose_strategy`): the model's
    config, the setup at ``plan_seq_len``, the cluster, the capacity (``target_memory``, else a GPU's memory, else
    the cluster preset's) and the options passed explicitly (traced with every candidate)."""
    device = _device_of(module)
    target = config.target_memory
    if target is None and device.type == "cuda":
        target = torch.cuda.get_device_properties(device).total_memory
    micro_batch = (config.plan_setup or {}).get("micro_batch", 1)
    return {"decide": "strategy", "model": type(module).__name__, "model_config": hf_config_of(module, "strategy='auto'"),
            "setup": _setup(module, config, seq_len=config.plan_seq_len, micro_batch=micro_batch,
                            world_size=world_size),
            "cluster": config.plan_cluster or default_cluster(device),
            "target_memory": None if target is None else int(target), "options": dict(explicit)}


def run_planner(request: dict, process: PlannerProcess | None = None, *, timeout_s: float | None = None) -> dict:
    """The planner's answer to ``request`` (``python -m autosp.plan.worker``): {"report": PlanReport.to_dict(), "text":
    its table}, {"candidates": ...} or {"error": why}; from ``process`` when one was started ahead, else from a
    process started now (Note [Planner process started ahead] in autosp/plan/process.py).  ``started_before_s``:
    how long before the request ``process`` was started (None: started at the request).  ``timeout_s``: the
    longest wait for the answer (`PlannerProcess.answer`; the config's ``plan_timeout_s``)."""
    ahead = None if process is None else time.perf_counter() - process.started
    try:
        return {**(process or PlannerProcess()).answer(request, timeout_s), "started_before_s": ahead}
    except AutoSPError as err:
        raise AutoSPError(f"{OPTION[request['decide']]}: {err}") from None


OPTION = {"memory": "memory_plan='auto'", "strategy": "strategy='auto'"}
"""A request's ``decide`` -> the `autosp.compile` option that asked, for messages."""


def _answered(what: str, where: str, answer) -> dict:
    """``answer()``, or ``{"error": why}`` when it raises (an `AutoSPError`'s message as it is, anything else named
    with ``where``): every rank must reach the collective after it, and raise the same error there."""
    try:
        return answer()
    except AutoSPError as err:
        return {"error": str(err)}
    except Exception as err:
        log.exception("%s: planning failed", what)
        return {"error": f"{what}: planning failed on {where}: {type(err).__name__}: {err}"}


# Note [Candidates spread over the ranks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``memory_plan="auto"`` and ``strategy="auto"`` are collectives over the process group, whose P ranks wait for the
# decision anyway, and their candidates fall into independent units.  So rank 0 builds the request and broadcasts
# it, every rank lists the units from it, and rank r predicts units r, r + P, ... (`autosp.plan.traces.rank_share`)
# in its own planner process (`run_planner`; a rank without a share starts none).  The units:
# - ``memory_plan="auto"`` (`memory_plan_on_ranks`): the candidates' trace groups (`autosp.plan.shares.plan_groups`:
#   tiled loss x tiled MLP, the plans one trace serves).  A group's checkpointing variants share its traces and
#   partitions, and its offload candidates are skipped by their twins' predictions (Note [Offload only where it is
#   needed] in autosp/plan/planner.py), both inside the group, so a rank predicts each candidate as one process
#   does.  With more ranks than groups, groups are halved by checkpointing variant, each half with its offload
#   twins, for the otherwise idle ranks (`autosp.plan.shares.plan_units`, Note [Trace groups halved for spare
#   processes] there).  The mask rules a decision learns once (Note [Mask rules shared between a decision's traces] in
#   autosp/passes/dynamo/mask_learner.py) are learnt once per rank.
# - ``strategy="auto"`` (`strategy_on_ranks`): the runnable candidates, each its own prediction; each rank's process
#   shares one Dynamo capture among the strategies it predicts (Note [One Dynamo capture for every strategy] in
#   autosp/plan/prediction.py), which equals the one-process capture but for the process groups' names.
# So each candidate's step time and peak are the same floats as in one process (tests/autosp/test_strategy_auto.py,
# tests/autosp/test_memory_plan.py; experiments/bench_planner.py --ranks compares them at 8B).  The rows are
# all-gathered and every rank applies the one rule (`autosp.plan.planner.choose_plan`,
# `autosp.plan.strategy_choice.strategy_choice`) to the same rows in candidate order: the same decision everywhere, ties to
# the earlier candidate.  An error on any rank (building, planning, a failed planner process) is every rank's
# `AutoSPError`, the first rank's by rank order.  With one rank it is the one-process decision in one planner
# process.


def _request_on_ranks(group: dist.ProcessGroup, device: torch.device | None, what: str, request) -> dict:
    """Rank 0 of ``group`` builds the request (``request()``) and broadcasts it (a collective); an error there is
    every rank's `AutoSPError`.  ``what``: the option asking, for messages."""
    made = [_answered(what, "rank 0", lambda: {"request": request()}) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(made, src=dist.get_global_rank(group, 0), group=group, device=device)
    if "error" in made[0]:
        raise AutoSPError(made[0]["error"])
    return made[0]["request"]


def _gathered(group: dist.ProcessGroup, answer: dict) -> list[dict]:
    """Every rank's ``answer`` (a collective), in rank order; an error on any rank is every rank's `AutoSPError`,
    the first rank's by rank order."""
    answers = [None] * dist.get_world_size(group)
    dist.all_gather_object(answers, answer, group=group)
    failed = next((a["error"] for a in answers if "error" in a), None)
    if failed is not None:
        raise AutoSPError(failed)
    return answers


def memory_plan_on_ranks(group: dist.ProcessGroup, request, device: torch.device,
                         planner: PlannerProcess | None = None, timeout_s: float | None = None) -> tuple[dict, dict]:
    """The collective of `decide` (Note [Candidates spread over the ranks]): rank 0's ``request()`` (a
    `plan_request`) broadcast, each rank's share of the candidates' trace groups (`autosp.plan.shares.plan_groups`)
    predicted in its planner process (``planner`` where it was started ahead; the caller closes it, a no-op once it
    answered), the rows all-gathered in candidate order and `autosp.plan.planner.choose_plan` applied; (the report,
    the request).  The report is a `PlanReport.to_dict` of the whole decision: each candidate's row names the
    ``rank`` that predicted it; ``traces`` and ``partitions`` are summed over the ranks, ``seconds`` is the slowest
    rank's planning; ``planner_seconds_by_rank``: each rank's wait for its planner process, from the request to the
    answer (0 where it had no share; ``planner_seconds`` the longest), ``predict_seconds_by_rank`` the part of it
    spent planning (``predict_cpu_seconds_by_rank`` the process's CPU time in it),
    ``planner_started_before_s_by_rank`` how long before the request its process was started (None: at the
    request, or no share).  ``timeout_s``: each rank's longest wait for its planner process (`run_planner`)."""
    from autosp.plan.candidates import MemoryPlan
    from autosp.plan.planner import choose_plan
    from autosp.plan.shares import in_plan_order, plan_shares, plan_units

    what = OPTION["memory"]
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    request = _request_on_ranks(group, device if device.type == "cuda" else None, what, request)
    plans = request["plans"]
    shares = plan_shares(plan_units([MemoryPlan(*p) for p in plans], ranks), ranks)
    share = shares[rank]

    def predicted() -> dict:
        if not share:  # the caller closes this rank's planner process, unasked
            return {"report": None, "process_seconds": 0.0}
        start = time.perf_counter()
        return {**run_planner({**request, "plans": [plans[i] for i in share]}, planner, timeout_s=timeout_s),
                "process_seconds": time.perf_counter() - start}

    answer = _answered(what, f"rank {rank}", predicted)
    answers = _gathered(group, answer)
    if answer.get("text"):
        log.info("%s", answer["text"])
    rows = in_plan_order(shares, [[{**row, "rank": r} for row in (a["report"]["candidates"] if a["report"] else ())]
                                  for r, a in enumerate(answers)], len(plans))
    reports = [a["report"] for a in answers if a["report"]]
    missing = [plans[i][0] for i, row in enumerate(rows) if row is None]
    if missing or not reports:
        raise AutoSPError(f"{what}: no rank predicted {', '.join(missing) or 'any candidate'}")
    first = reports[0]
    chosen, reason = choose_plan(rows, first["objective"], seq_len=first["seq_len"],
                                 target=first["target_memory_bytes"])
    by_rank = [a["process_seconds"] for a in answers]
    return {**first, "candidates": rows, "chosen": chosen, "reason": reason,
            "options": dict(rows[chosen]["options"]) if chosen is not None else None,
            "traces": sum(r["traces"] for r in reports), "partitions": sum(r["partitions"] for r in reports),
            "seconds": max(r["seconds"] for r in reports), "notes": sorted({n for r in reports for n in r["notes"]}),
            "planner_seconds": max(by_rank), "planner_seconds_by_rank": by_rank,
            "predict_seconds_by_rank": [a["report"]["seconds"] if a["report"] else 0.0 for a in answers],
            "predict_cpu_seconds_by_rank": [a.get("cpu_seconds", 0.0) for a in answers],
            "planner_started_before_s_by_rank": [a.get("started_before_s") for a in answers]}, request


def decide(module: torch.nn.Module, config: AutoSPConfig, group: dist.ProcessGroup, *, seq_len: int,
           micro_batch: int, explicit: Mapping, device: torch.device, planner: PlannerProcess | None = None) -> dict:
    """The memory plan of this process group (a collective: every rank calls it with its first batch): the
    options to compile with and the decision for ``report.memory_plan``.  The candidates are predicted on the
    group's ranks (`memory_plan_on_ranks`).  ``planner``: this rank's planner process, started when the model was
    compiled (Note [Planner process started ahead] in autosp/plan/process.py)."""
    start = time.perf_counter()
    sizes = torch.tensor([config.plan_seq_len or seq_len, micro_batch], device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    seq_len, micro_batch = (int(v) for v in sizes.tolist())
    report, request = memory_plan_on_ranks(group, lambda: plan_request(
        module, config, seq_len=seq_len, micro_batch=micro_batch, world_size=dist.get_world_size(group),
        explicit=explicit), device, planner, config.plan_timeout_s)
    from autosp.plan.planner import NOT_PREDICTED

    refused = [c["refused"] for c in report["candidates"]
               if c["refused"] is not None and not c["refused"].startswith(NOT_PREDICTED)]
    if report["chosen"] is None and len(refused) == len(report["candidates"]):
        raise AutoSPError(f"memory_plan='auto': the planner could not trace {request['model']} rebuilt from its "
                          f"config under any candidate (first: {refused[0]}); choose the options yourself and pass "
                          "them with memory_plan='off'")
    if report["chosen"] is None:
        setup = request["setup"]
        raise AutoSPError(
            f"memory_plan='auto' found no plan: {report['reason']}; raise target_memory (now "
            f"{request['target_memory']:,} bytes), use more SP ranks or a shorter plan_seq_len, or free device memory "
            f"in the job's DeepSpeed setup (now ZeRO {setup.get('zero_stage')}, optimizer offload "
            f"{setup.get('offload', 'none')}): python -m autosp.plan --model CONFIG_JSON --cluster "
            f"{request['cluster']} --seq-len {setup['seq_len']} --sp-size {setup['sp_size']}{_strategy_flags(config)} "
            "--memory-plan auto --zero-stage auto chooses the plan and the setup it needs (autosp.plan.plan_job)")
    options = dict(report["options"])
    decision = {**report, "model": request["model"], "cluster": request["cluster"], "setup": request["setup"],
                "explicit": dict(explicit), "options": options, "seconds": time.perf_counter() - start}
    log.info("memory plan at %d tokens x %d rows: %s (%s)%s", seq_len, micro_batch,
             report["candidates"][report["chosen"]]["plan"], report["reason"],
             f"; explicit options win over the plan: {dict(explicit)}" if explicit else "")
    return decision


def _strategy_flags(config: AutoSPConfig) -> str:
    """``python -m autosp.plan``'s flags for ``config``'s strategy ("" for Ulysses, its default)."""
    if config.strategy == "ulysses":
        return ""
    hybrid = config.strategy == "hybrid"
    return f" --strategy {config.strategy}" + (f" --ulysses-size {config.layout.ulysses_size}" if hybrid else "")


class PlanAtFirstBatch:
    """The compile front door's `autosp.model.FirstBatchPlan`: `decide` over ``group`` with this rank's planner
    process (the script's, else one started now, while the model loads, when a process group exists: Note [Planner
    process started ahead] in autosp/plan/process.py)."""

    def __init__(self, group: dist.ProcessGroup | None, explicit: Mapping, planner: PlannerProcess | None = None):
        self.group = group
        self.explicit = dict(explicit)
        if planner is None and dist.is_initialized() and group is not None:
            planner = PlannerProcess()
        self.planner = planner

    def decide(self, module: torch.nn.Module, config: AutoSPConfig, *, seq_len: int, micro_batch: int,
               device: torch.device) -> dict:
        return decide(module, config, self.group, seq_len=seq_len, micro_batch=micro_batch,
                      explicit=self.explicit, device=device, planner=self.planner)

    def close(self) -> None:
        planner, self.planner = self.planner, None
        if planner is not None:
            planner.close()  # a no-op once it answered; ends one that did not (another rank's, a failure)


def strategy_with_memory(module: torch.nn.Module, config: AutoSPConfig, group: dist.ProcessGroup | None, *,
                         explicit: Mapping, planner: PlannerProcess | None = None) -> tuple[dict, DecidedAtCompile]:
    """``strategy="auto"`` with ``memory_plan="auto"``: one decision over every strategy and its memory candidates
    (Note [The strategy and the memory in one decision] in autosp/plan/strategy_choice.py), taken in
    ``autosp.compile`` (a collective; the strategy decides the process groups) at ``plan_seq_len`` tokens and
    ``plan_setup``'s micro-batch (default 1): (the strategy's options, what ``report.strategy_plan`` shows, the
    memory decision's first-batch plan, which gives the compiled model the rest of the options and
    ``report.memory_plan``)."""
    group = group or dist.group.WORLD
    if group is None:
        raise AutoSPError("strategy='auto' decides with the process group: call torch.distributed."
                          "init_process_group before autosp.compile")
    micro_batch = int((config.plan_setup or {}).get("micro_batch", 1))
    decision = decide(module, config, group, seq_len=config.plan_seq_len, micro_batch=micro_batch,
                      explicit=explicit, device=_device_of(module), planner=planner)
    from autosp.plan.traces import strategy_options

    chosen = decision["candidates"][decision["chosen"]]
    strategy_plan = {"strategy": "auto", "chosen": chosen["plan"].split(": ", 1)[0],
                     "options": strategy_options(decision["options"]), "reason": decision["reason"],
                     "setup": decision["setup"], "cluster": decision["cluster"], "seconds": decision["seconds"],
                     "with_memory_plan": True}
    return strategy_plan, DecidedAtCompile(decision, seq_len=config.plan_seq_len, micro_batch=micro_batch,
                                           group=group)


class DecidedAtCompile:
    """The `autosp.model.FirstBatchPlan` of a memory plan decided before compiling (`strategy_with_memory`): its
    decision, once the first batch is checked to be within what was planned (a longer or wider one would void the
    strategy chosen for it)."""

    def __init__(self, decision: dict, *, seq_len: int, micro_batch: int, group: dist.ProcessGroup):
        self.decision, self.seq_len, self.micro_batch, self.group = decision, seq_len, micro_batch, group

    def decide(self, module: torch.nn.Module, config: AutoSPConfig, *, seq_len: int, micro_batch: int,
               device: torch.device) -> dict:
        sizes = torch.tensor([seq_len, micro_batch], device=device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self.group)  # every rank refuses together
        seq_len, micro_batch = (int(v) for v in sizes.tolist())
        if seq_len > self.seq_len or micro_batch > self.micro_batch:
            raise AutoSPError(
                f"strategy='auto' with memory_plan='auto' planned {self.micro_batch} x {self.seq_len} tokens "
                f"(plan_setup's micro_batch x plan_seq_len) and the first batch is {micro_batch} x {seq_len}: pass "
                f"plan_seq_len={max(seq_len, self.seq_len)} and plan_setup={{'micro_batch': "
                f"{max(micro_batch, self.micro_batch)}}} (the longest and widest batch the job trains on)")
        return self.decision

    def close(self) -> None:
        """Nothing held: the planner process answered at compile."""


def strategy_on_ranks(group: dist.ProcessGroup, request, model_config, device: torch.device,
                      planner: PlannerProcess | None = None, timeout_s: float | None = None) -> tuple[dict, dict]:
    """The collective of `decide_strategy` (Note [Candidates spread over the ranks]): rank 0's ``request()`` (a
    `strategy_request`) broadcast, each rank's share of the candidates of ``model_config`` (the model's Hugging Face
    config) predicted in its planner process (``planner`` where it was started ahead; the caller closes it, a
    no-op once it answered), the rows all-gathered and `autosp.plan.strategy_choice.strategy_choice` applied; (the report, the request).
    Each candidate's row names the ``rank`` that predicted it (None: refused without predicting);
    ``planner_seconds_by_rank``: each rank's wait for its planner process, from the request to the answer (its
    imports included unless it was started ahead; 0 where it ran none; ``planner_seconds`` the longest),
    ``predict_seconds_by_rank`` the part of it spent predicting (after its imports; ``predict_cpu_seconds_by_rank``
    the process's CPU time in that part, which on a rank with its own cores is about the same),
    ``planner_started_before_s_by_rank`` how long before the request its process was started (None: at the
    request, or no process).  ``timeout_s``: each rank's longest wait for its planner process (`run_planner`).  An
    error on any rank is every rank's `AutoSPError`."""
    from autosp.plan.setup import TrainingSetup
    from autosp.plan.strategy_choice import StrategyCandidate, strategy_candidates, strategy_choice
    from autosp.plan.traces import rank_share, strategy_options

    what = OPTION["strategy"]
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    request = _request_on_ranks(group, device if device.type == "cuda" else None, what, request)
    listed = []

    def predicted() -> dict:
        listed[:] = strategy_candidates(model_config, TrainingSetup(**request["setup"]))
        share = rank_share([s.name for s, why in listed if why is None], rank, ranks)
        if not share:  # the caller closes this rank's planner process, unasked
            return {"candidates": [], "seconds": 0.0, "cpu_seconds": 0.0, "process_seconds": 0.0}
        start = time.perf_counter()
        return {**run_planner({**request, "predict": share}, planner, timeout_s=timeout_s),
                "process_seconds": time.perf_counter() - start}

    answer = _answered(what, f"rank {rank}", predicted)
    answers = _gathered(group, answer)
    if answer.get("text"):
        log.info("%s", answer["text"])
    rows = {c["system"]: {**c, "rank": r} for r, a in enumerate(answers) for c in a["candidates"]}
    for strategy, why in listed:
        if why is not None:
            rows[strategy.name] = {**StrategyCandidate(strategy=strategy.sequence_parallel, system=strategy.name,
                                                       options=strategy_options(strategy.compile_options),
                                                       prediction=None,
                                                       refused=why).to_dict(), "rank": None}
    missing = [s.name for s, _ in listed if s.name not in rows]
    if missing:
        raise AutoSPError(f"{what}: no rank predicted {', '.join(missing)}")
    capacity = next(a["capacity_bytes"] for a in answers if "capacity_bytes" in a)  # rank 0 always predicts one
    report = strategy_choice([rows[s.name] for s, _ in listed], capacity)
    by_rank = [a["process_seconds"] for a in answers]
    return {**report, "planner_seconds": max(by_rank), "planner_seconds_by_rank": by_rank,
            "predict_seconds_by_rank": [a["seconds"] for a in answers],
            "predict_cpu_seconds_by_rank": [a["cpu_seconds"] for a in answers],
            "planner_started_before_s_by_rank": [a.get("started_before_s") for a in answers]}, request


def decide_strategy(module: torch.nn.Module, config: AutoSPConfig, group: dist.ProcessGroup | None, *,
                    explicit: Mapping, planner: PlannerProcess | None = None) -> dict:
    """``strategy="auto"``: the strategy this process group compiles (a collective inside ``autosp.compile``; the
    candidates are predicted on the group's ranks, `strategy_on_ranks`): ``options`` (``strategy``, and a hybrid's
    ``ulysses_size`` and ``ring_size``) and the decision for ``report.strategy_plan`` (``chosen``: a registry name,
    ``reason``, ``candidates``: each one's system, options, fits, peak_bytes, step_time_s, refused and the rank that
    predicted it; ``setup``, ``cluster``, ``capacity_bytes``, ``seconds``, ``planner_seconds``: the slowest rank's
    planner process, and each rank's, `strategy_on_ranks`).  ``planner``: this rank's planner process, when the
    script started it ahead (Note [Planner process started ahead] in autosp/plan/process.py)."""
    start = time.perf_counter()
    group = group or dist.group.WORLD
    if group is None:
        raise AutoSPError("strategy='auto' decides with the process group: call torch.distributed."
                          "init_process_group before autosp.compile")
    report, request = strategy_on_ranks(group, lambda: strategy_request(
        module, config, world_size=dist.get_world_size(group), explicit=explicit),
        getattr(module, "config", None), _device_of(module), planner, config.plan_timeout_s)
    if report["chosen"] is None:
        first = next((c["refused"] for c in report["candidates"] if c["refused"]), None)
        raise AutoSPError(f"strategy='auto' found no strategy for {request['model']} at {config.plan_seq_len} "
                          f"tokens: {report['reason']}" + (f" (first refusal: {first})" if first else "")
                          + "; raise target_memory, use more SP ranks or a shorter plan_seq_len, or pass a strategy")
    decision = {**report, "model": request["model"], "cluster": request["cluster"], "setup": request["setup"],
                "explicit": dict(explicit), "seconds": time.perf_counter() - start}
    log.info("strategy auto at %d tokens on %s: %s %s (%s)", config.plan_seq_len, request["cluster"],
             report["chosen"], report["options"], report["reason"])
    return decision
