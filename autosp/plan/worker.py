"""The planner process's program: ``python -m autosp.plan.worker REQUEST OUT`` (``-`` for REQUEST: started ahead,
it makes its imports, says ready, then reads the request from its standard input; Note [Planner process started
ahead] in autosp/plan/process.py).  It plans the request's candidates (the rank's share) and writes the decision;
`autosp.plan.auto` builds the requests and reads the answers.  A module of its own, which nothing imports, so that
running it as ``__main__`` never executes a module the package has already loaded.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from autosp.errors import AutoSPError
from autosp.plan.auto import OPTION
from autosp.plan.candidates import MemoryPlan
from autosp.plan.cluster_file import load_cluster
from autosp.plan.planner import plan_memory
from autosp.plan.prediction import predict
from autosp.plan.process import COMPILE_IMPORTS, import_ahead
from autosp.plan.setup import TrainingSetup
from autosp.plan.strategy_choice import predict_strategies

log = logging.getLogger(__name__)


WARM_UP_MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                 "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "vocab_size": 256, "max_position_embeddings": 256, "tie_word_embeddings": False}
"""The model a planner process started ahead predicts while it waits for its request (`warm_up`)."""


def warm_up() -> None:
    """Predict a tiny Llama's step in this process (thrown away), so that the request's first trace does not pay
    the first-use costs of Dynamo and AOTAutograd in a fresh process (caches of source lines, trace rules and
    fake-tensor dispatch; about 3 s of a decision at 8B), none of which changes what a later trace computes.
    Only in a process started ahead, whose wait it fills (Note [Planner process started ahead] in
    autosp/plan/process.py); a failure here is logged and left to the request's own trace."""
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="autosp-plan-warm-up-") as folder:
            model = Path(folder, "config.json")
            model.write_text(json.dumps(WARM_UP_MODEL))
            setup = TrainingSetup(seq_len=64, sp_size=2, depth="full")
            predict(str(model), setup, load_cluster("h100-sxm", world_size=setup.world_size))
    except Exception as err:  # noqa: BLE001 - a warm-up only
        log.info("planner warm-up failed (the request's trace pays the first-use costs): %s", err)
    log.info("planner warmed up in %.1f s", time.perf_counter() - start)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m autosp.plan.worker",
        description="The planner of autosp.compile(..., memory_plan='auto') and (..., strategy='auto'), which "
                    "runs this in a fresh\nprocess on each rank (no process group, no compiled code of the job): plan "
                    "the request's candidates (the rank's share)\nand write the decision. For planning by hand use python -m "
                    "autosp.plan --memory-plan auto or --strategy auto.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("request", type=Path, help="the request (JSON: model config, setup, cluster, target, candidates); "
                                              "-: make the imports, print ready, then read it from the standard input")
    p.add_argument("out", type=Path, help="where to write the decision (JSON: the plan report and its table)")
    p.add_argument("--warm-up", action="store_true",
                   help="with -: predict a tiny model before saying ready (the first-use costs of Dynamo)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m autosp.plan.worker REQUEST.json OUT.json`` (run by `autosp.plan.auto.run_planner`)."""
    args = build_parser().parse_args(argv)
    request_path, out_path = args.request, args.out
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if str(request_path) == "-":  # started ahead (Note [Planner process started ahead] in autosp/plan/process.py)
        import_ahead(COMPILE_IMPORTS)
        if args.warm_up:
            warm_up()
        sys.stdout.write("ready\n")  # the protocol of PlannerProcess.wait_ready, not a message
        sys.stdout.flush()
        # One line, not the stream to its end: a process the job forks later (a DataLoader worker) holds a copy of
        # the pipe's writing end, so the end of the stream may never come.
        request = json.loads(sys.stdin.readline())
    else:
        request = json.loads(Path(request_path).read_text())
    deciding = request.get("decide", "memory")
    try:
        with tempfile.TemporaryDirectory(prefix="autosp-plan-model-") as folder:
            model = Path(folder, "config.json")
            model.write_text(json.dumps(request["model_config"]))
            setup = TrainingSetup(**request["setup"])
            cluster = load_cluster(request["cluster"], world_size=setup.world_size)
            if deciding == "strategy":  # the candidates this rank predicts (`strategy_on_ranks`; None: all)
                start, cpu, only = time.perf_counter(), time.process_time(), request.get("predict")
                found, capacity = predict_strategies(str(model), setup, cluster, options=request["options"],
                                                     capacity_bytes=request["target_memory"], only=only)
                found = [c for c in found if only is None or c.system in only]
                answer = {"candidates": [c.to_dict() for c in found], "capacity_bytes": capacity,
                          "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
                          "text": "\n\n".join(f"strategy {c.system}:\n{c.prediction.format()}" if c.prediction
                                              else f"strategy {c.system}: refused ({c.refused})" for c in found
                                              ).replace(str(model), request["model"])}
            else:
                cpu = time.process_time()
                report = plan_memory(str(model), setup, cluster, target_memory=request["target_memory"],
                                     plans=[MemoryPlan(name, options) for name, options in request["plans"]])
                answer = {"report": {**report.to_dict(), "model": request["model"]},
                          "cpu_seconds": time.process_time() - cpu,
                          "text": report.format().replace(str(model), request["model"])}
    except AutoSPError as err:
        answer = {"error": f"{OPTION[deciding]}: {err}"}
    Path(out_path).write_text(json.dumps(answer, default=str))
    return 0


if __name__ == "__main__":
    code = main()
    # The answer is written: end without the interpreter's teardown of torch (1.8 s measured after a warm-up),
    # which the job would wait for (`PlannerProcess.answer` returns once the process has exited).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
