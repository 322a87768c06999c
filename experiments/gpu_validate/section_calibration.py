"""Section (d), calibration: the preset's record with its compute times scaled so that the median case's simulated
step equals its measured one (`fit_step_factor`), written to ``calibration/PRESET.json`` with every case's numbers
and read back as the presets and cluster files read it (`calibration`).
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from experiments.gpu_validate.case_set import Case, Judged
from experiments.gpu_validate.presets import cluster_of, simulate_on
from experiments.gpu_validate.section_prediction import Prediction


@dataclass
class Calibration(Judged):
    """Section (d): the record written and read back."""

    path: str
    preset: str
    device: str
    step_factor: float
    problems: list[str]


def fit_step_factor(document: dict, runs: list[tuple[Case, dict, float]]) -> float:
    """The factor on the preset's compute times (`apply_step_factor`) that makes the median of the cases'
    simulated / measured step times 1 (bisection: a case's simulated time grows with the factor). ``runs``:
    (case, exported workload, measured seconds)."""
    from experiments.calibration.calibrate_cpu import apply_step_factor
    from simulator import Workload, simulate

    workloads = [(case, Workload.from_dict(w), measured) for case, w, measured in runs]

    def median_ratio(factor: float) -> float:
        scaled = apply_step_factor(document, factor)
        return statistics.median(simulate(w, cluster_of(scaled, case.world), validate=False).step_time_s / measured
                                 for case, w, measured in workloads)

    low, high = 1 / 64, 64.0
    if median_ratio(low) > 1 or median_ratio(high) < 1:
        return math.nan
    for _ in range(30):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if median_ratio(middle) < 1 else (low, middle)
    return math.sqrt(low * high)


def calibration(preset: str, document: dict, predictions: list[Prediction], runs: list[tuple[Case, dict, float]],
                device: dict, out: Path) -> Calibration:
    """Section (d): write ``out/calibration/PRESET.json`` and read it back as the presets and cluster files do."""
    from autosp.plan.cluster_file import cluster_from_dict
    from experiments.calibration.calibrate_cpu import apply_step_factor
    from simulator.hardware import preset_from_dict

    problems = []
    base = copy.deepcopy(document)
    base.setdefault("calibration", {})
    factor = fit_step_factor(base, runs) if runs else math.nan
    if not math.isfinite(factor):
        problems.append("no compute factor in 1/64..64 brings the simulated steps to the measured ones")
    record = apply_step_factor(base, factor) if math.isfinite(factor) else base
    before = document.get("calibration", {}).get("step_factor", 1.0)
    record["device"]["name"] = device["name"]
    record["calibrated"] = True
    record["sources"] = [*record.get("sources", []), "python -m experiments.gpu_validate"]
    record["calibration"] = {
        **record["calibration"], "date": datetime.date.today().isoformat(), "device": device,
        "preset": preset, "step_factor": before * factor if math.isfinite(factor) else before,
        "step_factor_of_this_run": factor,
        "cases": [{"case": p.case, "world": p.world, "measured_step_s": p.measured_step_s,
                   "simulated_step_s": p.simulated_step_s, "measured_peak_bytes": p.measured_peak_bytes,
                   "simulated_peak_bytes": p.simulated_peak_bytes} for p in predictions],
        "timings_judged": False,  # printed beside the simulation, never judged: this record is what they give
    }
    path = out / "calibration" / f"{preset}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    try:  # read back as the presets and a cluster file's node read it
        read = json.loads(path.read_text(encoding="utf-8"))
        preset_from_dict(read)
        if read.get("intra_node_kind") != "loopback":  # cpu-gloo's host memory is RAM, no cluster-file kind
            cluster_from_dict({"node": read})
        for case, workload, _ in runs:
            simulate_on(workload, read, case.world)
    except Exception as err:  # noqa: BLE001 - a failed check, reported
        problems.append(f"the record cannot be read back: {type(err).__name__}: {err}")
    return Calibration(path=str(path), preset=preset, device=device["name"], step_factor=factor, problems=problems)
