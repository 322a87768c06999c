"""The report of a run: one summary row per check (`summary_rows`), and the files written under ``--out``
(`write_outputs`: ``gpu_validate.json``, ``summary.csv`` and ``summary.md``).
"""

from __future__ import annotations

import json
from pathlib import Path


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def summary_rows(results: dict) -> list[dict]:
    """One row per check: section, case, passed, what was seen."""
    rows = []
    for e in results["exactness"]:
        rows.append({"section": "a exactness", "case": e["case"], "passed": e["passed"],
                     "detail": f"loss {e['loss']:.6g} vs {e['ref_loss']:.6g}; worst {e['worst']}"
                               + "".join(f"; {p}" for p in e["problems"][:3])})
    for k in results["kernels"]:
        seen = "; ".join(f"{label}: {', '.join(k[key]) or '-'}" for label, key in (
            ("attention", "attention"), ("ring blocks", "ring_blocks"), ("flex", "flex_attention"),
            ("offload copies", "offload_copies")))
        rows.append({"section": "b kernels", "case": k["case"], "passed": k["passed"],
                     "detail": seen + "".join(f"; {p}" for p in k["problems"] + k["notes"])})
    for p in results["prediction"]:
        judged = " (not judged on CPU)" if results["device"]["type"] == "cpu" else " (errors printed, not judged)"
        plan = p["plan"]
        plan_text = "" if not plan else (f"; plan {plan['plan']} (predicted peak {_mib(plan['predicted_peak_bytes'] or 0)}"
                                         f" MiB, target {_mib(plan['target_bytes'] or 0)} MiB, fits: {plan['fits']})")
        rows.append({"section": "c prediction", "case": p["case"], "passed": p["passed"],
                     "detail": f"{p['preset']}: step {p['measured_step_s'] * 1e3:.2f} ms measured, "
                               f"{p['simulated_step_s'] * 1e3:.2f} ms simulated ({p['step_error_pct']:+.1f} %); "
                               f"peak {_mib(p['measured_peak_bytes'])} MiB measured, "
                               f"{_mib(p['simulated_peak_bytes'])} MiB simulated ({p['peak_error_pct']:+.1f} %)"
                               f"{judged}{plan_text}" + "".join(f"; {x}" for x in p["problems"])})
    c = results.get("calibration")
    if c:
        rows.append({"section": "d calibration", "case": c["preset"], "passed": c["passed"],
                     "detail": f"{c['path']} (device {c['device']}, compute factor {c['step_factor']:.3g})"
                               + "".join(f"; {p}" for p in c["problems"])})
    for name, error in results["errors"].items():
        lines = [line.strip() for line in error.splitlines() if line.strip()]
        headline = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"  # the exception: the last line
        rows.append({"section": "run", "case": name, "passed": False, "detail": headline[:400]})
    return rows


def write_outputs(results: dict, out: Path) -> None:
    """``gpu_validate.json`` and ``summary.csv``/``summary.md`` in ``out``."""
    from experiments.tables import write_table

    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_validate.json").write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    write_table("summary", results["summary"], out,
                footer=[f"{'PASSED' if results['passed'] else 'FAILED'}: {results['mode']} on {results['device']['name']}"
                        f", preset {results['preset']}, {results['elapsed_s']:.0f} s"])
