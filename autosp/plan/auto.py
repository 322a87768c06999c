"""``autosp.compile(..., memory_plan="auto")``: the compiled model plans its own memory options; and
``autosp.compile(..., strategy="auto")``: the model asks the planner which strategy to compile.

On its first call (`autosp.api.SequenceParallelModel`) the model learns what the plan needs: the sequence length
(``plan_seq_len``, else the longest first batch of the process group) and the rows per batch.  Rank 0 of the process
group then runs the planner (`autosp.plan.plan_memory`, objective "fastest") for the Hugging Face config of the
model in a fresh Python process (``python -m autosp.plan.auto REQUEST OUT``): the planner traces on a fake process
group of its own, which cannot exist beside the job's, and resets Dynamo between traces, which must not touch the
job's compiled code.  The decision is broadcast to every rank, so all compile the same program
(docs/design.md, "Memory planner").

``strategy="auto"`` goes the same way (`decide_strategy`), once, inside ``autosp.compile`` (the strategy decides
the process groups it builds, so there is no first batch to wait for: ``plan_seq_len`` is required): the planner
process runs `autosp.plan.predict.choose_strategy` for the model's config, ``plan_seq_len`` tokens and the cluster,
and every rank compiles the candidate it chose (docs/design.md, "Choosing a strategy").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from autosp.config import AutoSPConfig
from autosp.errors import AutoSPError

log = logging.getLogger(__name__)

GPU_PRESETS = (("GH200", "gh200"), ("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-80gb-sxm"),
               ("MI250", "mi250"))
"""A GPU's name (a substring of ``torch.cuda.get_device_name``) -> the hardware preset the plan is predicted on."""
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
    if config.strategy == "hybrid":
        raise AutoSPError("memory_plan='auto' does not plan a strategy='hybrid' program yet; pass the memory options "
                          "yourself with memory_plan='off', or plan under strategy='ulysses' or 'ring'")
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
        from autosp.plan.predict import TrainingSetup

        TrainingSetup(seq_len=config.sp_size, sp_size=config.sp_size, **config.plan_setup).check()


def default_cluster(device: torch.device) -> str:
    """The hardware preset of ``device``: cpu-gloo on CPU, else by the GPU's name (`GPU_PRESETS`)."""
    if device.type != "cuda":
        return "cpu-gloo"
    name = torch.cuda.get_device_name(device)
    for part, preset in GPU_PRESETS:
        if part in name:
            return preset
    raise AutoSPError(f"memory_plan='auto': no hardware preset for the GPU {name!r}; pass plan_cluster= a preset "
                      "or a cluster file (python -m autosp.plan --help lists them)")


def _setup(module: torch.nn.Module, config: AutoSPConfig, *, seq_len: int, micro_batch: int,
           world_size: int) -> dict:
    """The `autosp.plan.TrainingSetup` fields of this job (``plan_setup`` wins)."""
    dtype = next((p.dtype for p in module.parameters()), torch.float32)
    return {"seq_len": seq_len, "sp_size": config.sp_size, "dp_size": world_size // config.sp_size,
            "micro_batch": micro_batch, "dtype": DTYPES[dtype], "compiler": config.compiler,
            **(config.plan_setup or {})}


def plan_request(module: torch.nn.Module, config: AutoSPConfig, *, seq_len: int, micro_batch: int, world_size: int,
                 explicit: Mapping) -> dict:
    """What the planner process needs: the model's config, the training setup, the cluster, the target and the
    candidates (`autosp.plan.candidate_plans`, with the explicitly passed options and the model's strategy
    fixed)."""
    from autosp.plan.planner import sized_candidate_plans

    device = _device_of(module)
    dtype = next((p.dtype for p in module.parameters()), torch.float32)
    target = config.target_memory
    if target is None:
        target = torch.cuda.get_device_properties(device).total_memory
    setup = _setup(module, config, seq_len=seq_len, micro_batch=micro_batch, world_size=world_size)
    hf = hf_config_of(module)
    plans = sized_candidate_plans(
        hf, itemsize=torch.empty((), dtype=dtype).element_size(), target_memory=target,
        fixed={**explicit, **({"strategy": config.strategy} if config.strategy != "ulysses" else {})})
    return {"decide": "memory", "model": f"{type(module).__name__}", "model_config": hf, "setup": setup,
            "cluster": config.plan_cluster or default_cluster(device), "target_memory": int(target),
            "plans": [[p.name, dict(p.options)] for p in plans]}


def strategy_request(module: torch.nn.Module, config: AutoSPConfig, *, world_size: int, explicit: Mapping) -> dict:
    """What the planner process needs to choose the strategy (`autosp.plan.predict.choose_strategy`): the model's
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


def run_planner(request: dict) -> dict:
    """Run ``python -m autosp.plan.auto`` on ``request``: {"report": PlanReport.to_dict(), "text": its table} or
    {"error": why}."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the autosp and simulator packages
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
           "CUDA_VISIBLE_DEVICES": ""}  # the planner traces on fake tensors only
    with tempfile.TemporaryDirectory(prefix="autosp-plan-") as folder:
        request_path, out_path = Path(folder, "request.json"), Path(folder, "plan.json")
        request_path.write_text(json.dumps(request))
        done = subprocess.run([sys.executable, "-m", "autosp.plan.auto", str(request_path), str(out_path)],
                              env=env, capture_output=True, text=True)
        log.debug("planner output:\n%s", done.stderr)
        if done.returncode != 0 or not out_path.is_file():
            raise AutoSPError(f"{_OPTION[request['decide']]}: the planner process failed (exit {done.returncode}):\n"
                              f"{done.stderr[-4000:]}")
        return json.loads(out_path.read_text())


_OPTION = {"memory": "memory_plan='auto'", "strategy": "strategy='auto'"}
"""A request's ``decide`` -> the `autosp.compile` option that asked, for messages."""


def _planned_on_rank0(group: dist.ProcessGroup, device: torch.device, what: str, request) -> dict:
    """Rank 0 of ``group`` builds the request (``request()``) and runs the planner on it (`run_planner`); every rank
    gets its answer with the request under ``"request"`` (a collective).  An error anywhere is every rank's
    `AutoSPError`.  ``what``: the option asking, for messages."""
    answer = [None]
    if dist.get_rank(group) == 0:
        try:
            made = request()
            answer[0] = {**run_planner(made), "request": made}
        except AutoSPError as err:
            answer[0] = {"error": str(err)}
        except Exception as err:  # every rank must leave the broadcast below, and with the same error
            log.exception("%s: planning failed", what)
            answer[0] = {"error": f"{what}: planning failed on rank 0: {type(err).__name__}: {err}"}
    dist.broadcast_object_list(answer, src=dist.get_global_rank(group, 0), group=group,
                               device=device if device.type == "cuda" else None)
    found = answer[0]
    if "error" in found:
        raise AutoSPError(found["error"])
    if dist.get_rank(group) == 0:
        log.info("%s", found["text"])
    return found


def decide(module: torch.nn.Module, config: AutoSPConfig, group: dist.ProcessGroup, *, seq_len: int,
           micro_batch: int, explicit: Mapping, device: torch.device) -> dict:
    """The memory plan of this process group (a collective: every rank calls it with its first batch): the
    options to compile with and the decision for ``report.memory_plan``."""
    start = time.perf_counter()
    sizes = torch.tensor([config.plan_seq_len or seq_len, micro_batch], device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    seq_len, micro_batch = (int(v) for v in sizes.tolist())
    found = _planned_on_rank0(group, device, _OPTION["memory"], lambda: plan_request(
        module, config, seq_len=seq_len, micro_batch=micro_batch, world_size=dist.get_world_size(group),
        explicit=explicit))
    report, request = found["report"], found["request"]
    refused = [c["refused"] for c in report["candidates"] if c["refused"] is not None]
    if report["chosen"] is None and len(refused) == len(report["candidates"]):
        raise AutoSPError(f"memory_plan='auto': the planner could not trace {request['model']} rebuilt from its "
                          f"config under any candidate (first: {refused[0]}); choose the options yourself and pass "
                          "them with memory_plan='off'")
    if report["chosen"] is None:
        raise AutoSPError(f"memory_plan='auto' found no plan: {report['reason']}; raise target_memory (now "
                          f"{request['target_memory']:,} bytes), use more SP ranks or a shorter plan_seq_len")
    options = dict(report["options"])
    decision = {**report, "model": request["model"], "cluster": request["cluster"], "setup": request["setup"],
                "explicit": dict(explicit), "options": options, "seconds": time.perf_counter() - start,
                "planner_seconds": report["seconds"]}
    log.info("memory plan at %d tokens x %d rows: %s (%s)%s", seq_len, micro_batch,
             report["candidates"][report["chosen"]]["plan"], report["reason"],
             f"; explicit options win over the plan: {dict(explicit)}" if explicit else "")
    return decision


def decide_strategy(module: torch.nn.Module, config: AutoSPConfig, group: dist.ProcessGroup | None, *,
                    explicit: Mapping) -> dict:
    """``strategy="auto"``: the strategy this process group compiles (a collective inside ``autosp.compile``):
    ``options`` (``strategy``, and a hybrid's ``ulysses_size`` and ``ring_size``) and the decision for
    ``report.strategy_plan`` (``chosen``: a registry name, ``reason``, ``candidates``: each one's system, options,
    fits, peak_bytes, step_time_s, refused; ``setup``, ``cluster``, ``capacity_bytes``, ``seconds``)."""
    start = time.perf_counter()
    group = group or dist.group.WORLD
    if group is None:
        raise AutoSPError("strategy='auto' decides with the process group: call torch.distributed."
                          "init_process_group before autosp.compile")
    found = _planned_on_rank0(group, _device_of(module), _OPTION["strategy"], lambda: strategy_request(
        module, config, world_size=dist.get_world_size(group), explicit=explicit))
    report, request = found["report"], found["request"]
    if report["chosen"] is None:
        first = next((c["refused"] for c in report["candidates"] if c["refused"]), None)
        raise AutoSPError(f"strategy='auto' found no strategy for {request['model']} at {config.plan_seq_len} "
                          f"tokens: {report['reason']}" + (f" (first refusal: {first})" if first else "")
                          + "; raise target_memory, use more SP ranks or a shorter plan_seq_len, or pass a strategy")
    report.pop("prediction", None)  # the chosen candidate's full prediction stays in the planner's log
    decision = {**report, "model": request["model"], "cluster": request["cluster"], "setup": request["setup"],
                "explicit": dict(explicit), "seconds": time.perf_counter() - start,
                "planner_seconds": report["seconds"]}
    log.info("strategy auto at %d tokens on %s: %s %s (%s)", config.plan_seq_len, request["cluster"],
             report["chosen"], report["options"], report["reason"])
    return decision


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m autosp.plan.auto",
        description="The planner of autosp.compile(..., memory_plan='auto') and (..., strategy='auto'), which "
                    "runs this in a fresh\nprocess on rank 0 (no process group, no compiled code of the job): plan "
                    "the request's candidates and write\nthe decision. For planning by hand use python -m "
                    "autosp.plan --memory-plan auto or --strategy auto.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("request", type=Path, help="the request (JSON: model config, setup, cluster, target, candidates)")
    p.add_argument("out", type=Path, help="where to write the decision (JSON: the plan report and its table)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m autosp.plan.auto REQUEST.json OUT.json`` (run by `run_planner`)."""
    from autosp.plan.cluster_file import load_cluster
    from autosp.plan.planner import MemoryPlan, plan_memory
    from autosp.plan.predict import TrainingSetup, choose_strategy

    args = build_parser().parse_args(argv)
    request_path, out_path = args.request, args.out
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    request = json.loads(Path(request_path).read_text())
    deciding = request.get("decide", "memory")
    try:
        with tempfile.TemporaryDirectory(prefix="autosp-plan-model-") as folder:
            model = Path(folder, "config.json")
            model.write_text(json.dumps(request["model_config"]))
            setup = TrainingSetup(**request["setup"])
            cluster = load_cluster(request["cluster"], world_size=setup.world_size)
            if deciding == "strategy":
                report = choose_strategy(str(model), setup, cluster, options=request["options"],
                                         capacity_bytes=request["target_memory"])
            else:
                report = plan_memory(str(model), setup, cluster, target_memory=request["target_memory"],
                                     plans=[MemoryPlan(name, options) for name, options in request["plans"]])
        answer = {"report": {**report.to_dict(), "model": request["model"]},
                  "text": report.format().replace(str(model), request["model"])}
    except AutoSPError as err:
        answer = {"error": f"{_OPTION[deciding]}: {err}"}
    Path(out_path).write_text(json.dumps(answer, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
