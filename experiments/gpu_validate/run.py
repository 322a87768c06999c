"""The run: every case on its ranks within the time budget (`run_cases`), then each section read from what the ranks
report (`validate`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from experiments.gpu_validate.case_set import PLAIN, Case, cases
from experiments.gpu_validate.presets import base_document
from experiments.gpu_validate.ranks import cases_on_rank
from experiments.gpu_validate.report import summary_rows
from experiments.gpu_validate.section_calibration import calibration
from experiments.gpu_validate.section_exactness import exactness
from experiments.gpu_validate.section_kernels import kernels, math_control
from experiments.gpu_validate.section_prediction import prediction

BUDGET_S = 540.0
"""The whole command's time budget (ranks still running when it is spent are stopped, their cases fail): under ten
minutes with the start-up."""


def plain_peak(case: Case, preset: str, folder: Path) -> int:
    """The predicted peak of ``case`` with no memory technique (`PLAIN`), as ``autosp.compile``'s planner prices the
    job (tests/autosp/test_memory_plan.py's baseline)."""
    from autosp.plan import TrainingSetup, load_cluster, predict
    from autosp.plan.setup import DECIDING_DEPTH
    from experiments.models import build_model

    path = folder / f"{case.name}.json"
    path.write_text(build_model(case.model, **case.sizes).config.to_json_string(use_diff=False), encoding="utf-8")
    setup = TrainingSetup(seq_len=case.seq_len, sp_size=case.world, micro_batch=1,
                          dtype="fp32" if case.dtype == "float32" else "bf16", compiler=case.compiler, zero_stage=0,
                          depth=DECIDING_DEPTH)  # the depth the planner decides at
    return predict(str(path), setup, load_cluster(preset, world_size=case.world), options=PLAIN).peak_bytes


def run_cases(selected: list[Case], device_kind: str, preset: str, deadline: float) -> dict[str, list[dict] | str]:
    """Every case on its ranks (one launch per world size): case name -> per-rank results, or the error."""
    from experiments.launch import RankFailure, run_on_ranks

    out: dict[str, list[dict] | str] = {}
    with tempfile.TemporaryDirectory() as folder:
        prepared = []
        for case in selected:
            if case.plan_below_plain:
                try:
                    target = plain_peak(case, preset, Path(folder)) - 1
                except Exception as err:  # noqa: BLE001 - the case fails, the others run
                    out[case.name] = f"failed: the plain step's peak could not be predicted: {type(err).__name__}: {err}"
                    continue
                case = dataclasses.replace(case, options={**case.options, "memory_plan": "auto",
                                                          "target_memory": target})
            prepared.append(case)
    for world in sorted({c.world for c in prepared}):
        group = [c for c in prepared if c.world == world]
        left = deadline - time.monotonic()
        if left <= 0:
            out.update({c.name: "not run: over the time budget" for c in group})
            continue
        try:
            per_rank = run_on_ranks(cases_on_rank, world, [dataclasses.asdict(c) for c in group],
                                    device_kind, timeout_s=left, collective_timeout_s=min(600.0, left),
                                    backend="nccl" if device_kind == "cuda" else "gloo")
        except RankFailure as err:
            out.update({c.name: f"failed: {err}" for c in group})
            continue
        for i, case in enumerate(group):
            errors = [r[i] for r in per_rank if "error" in r[i]]
            out[case.name] = [r[i] for r in per_rank] if not errors else \
                "failed: " + "".join(f"--- rank {e['rank']} ---\n{e['error']}" for e in errors)
    return out


def device_facts(device_kind: str) -> dict:
    """The record's ``device``: what ran the cases."""
    import torch

    if device_kind == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
                "torch": torch.__version__, "cuda": torch.version.cuda}
    return {"type": "cpu", "name": f"cpu process ({platform.machine()}, 1 thread)", "count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(), "torch": torch.__version__}


def validate(*, cpu_only: bool, out: Path, budget_s: float = BUDGET_S, only: list[str] | None = None) -> dict:
    """Run every section; the results as a JSON-ready dict (``passed``: every check passed)."""
    import torch

    from autosp.plan.auto import default_cluster

    start = time.monotonic()
    device_kind = "cpu" if cpu_only else "cuda"
    preset = default_cluster(torch.device(device_kind, 0) if device_kind == "cuda" else torch.device("cpu"))
    gpus = torch.cuda.device_count() if device_kind == "cuda" else 0
    selected = [c for c in cases(device_kind, gpus) if not only or c.name in only]
    document = base_document(preset)
    ran = run_cases(selected, device_kind, preset, start + budget_s)
    results: dict = {"mode": "cpu-only" if cpu_only else "gpu", "device": device_facts(device_kind), "preset": preset,
                     "cases": [dataclasses.asdict(c) for c in selected], "exactness": [], "kernels": [],
                     "prediction": [], "calibration": None, "errors": {}}
    predictions, runs = [], []
    for case in selected:
        per_rank = ran.get(case.name)
        if not isinstance(per_rank, list):
            results["errors"][case.name] = str(per_rank)
            continue
        for section, record in (("exactness", exactness(case, per_rank)), ("kernels", kernels(case, per_rank))):
            results[section].append({**dataclasses.asdict(record), "passed": record.passed})
        p = prediction(case, per_rank, preset, document, on_gpu=not cpu_only)
        predictions.append(p)
        runs.append((case, per_rank[0]["workload"], p.measured_step_s))
        (out / "workloads").mkdir(parents=True, exist_ok=True)  # python -m simulator runs them on any preset
        (out / "workloads" / f"{case.name}.json").write_text(json.dumps(per_rank[0]["workload"]), encoding="utf-8")
        results["prediction"].append({**dataclasses.asdict(p), "passed": p.passed})
    control = math_control(device_kind)
    results["kernels"].append({**dataclasses.asdict(control), "passed": control.passed})
    if predictions:
        c = calibration(preset, document, predictions, runs, results["device"], out)
        results["calibration"] = {**dataclasses.asdict(c), "passed": c.passed}
    if not cpu_only and time.monotonic() - start > budget_s:
        results["errors"]["budget"] = f"the run took {time.monotonic() - start:.0f} s, over its {budget_s:.0f} s budget"
    results["elapsed_s"] = time.monotonic() - start
    results["summary"] = summary_rows(results)
    results["passed"] = bool(results["summary"]) and all(r["passed"] for r in results["summary"])
    return results
