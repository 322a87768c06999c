"""How long a user waits for "how long can I train?" (issue 50): ``python -m autosp.plan`` run as a user runs it,
in a fresh process (its imports included), for the longest-length decision of each job of `JOBS` — the planner
choosing the DeepSpeed setup (``--zero-stage auto``) and the memory plan (``--objective longest``) — and the wall
and CPU seconds printed beside the answer and the minute the issue sets.  Not a test: it takes minutes on a CPU.

    python -m experiments.bench_answers                  # every job, the CLI's default --workers
    python -m experiments.bench_answers --workers 1 2    # each job once per worker count, side by side
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TARGET_S = 60.0
"""The wait issue 50 sets for a longest-length decision on 2 cores."""


@dataclass(frozen=True)
class Job:
    """One question: a model on a cluster, from a starting length."""

    name: str
    model: str
    cluster: str
    seq_len: int

    def argv(self, workers: int | None, json_out: str) -> list[str]:
        return [sys.executable, "-m", "autosp.plan", "--model", self.model, "--cluster", self.cluster,
                "--seq-len", str(self.seq_len), "--zero-stage", "auto", "--objective", "longest", "-q",
                "--json", json_out, *(["--workers", str(workers)] if workers else [])]


JOBS = (
    Job("Llama-3.1-8B on 8 H100s", "llama-3.1-8b", "h100-sxm", 65536),
    Job("Llama-3.1-70B on 32 H100s", "llama-3.1-70b", "h100-sxm-4x8", 131072),
)


def _answer(found: dict) -> str:
    """The decision's one line: the length reached as the search gave it (``≥ L`` where its ceiling bound it),
    the plan and the DeepSpeed setup."""
    if found.get("chosen") is None:
        return f"no plan: {found.get('reason', '?')}"
    row = found["candidates"][found["chosen"]]
    return f"{row['max_length_display']} tokens, plan {row['plan']!r}, setup {found.get('job')}"


def time_job(job: Job, workers: int | None) -> dict:
    """Run ``job``'s CLI once; its wall and CPU seconds (children's, as the CLI's workers are its children)."""
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "answer.json")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(job.argv(workers, out), capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"{job.name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        found = json.loads(Path(out).read_text())
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": wall, "cpu_s": cpu, "answer": _answer(found)}


def build_parser():
    from experiments import cli

    parser = cli.parser("experiments.bench_answers", __doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[None],
                        help="--workers of each run (default: the CLI's own default)")
    parser.add_argument("--only", nargs="+", choices=[j.model for j in JOBS], default=[j.model for j in JOBS],
                        help="the jobs to time, by model (default: every job)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for job in (j for j in JOBS if j.model in args.only):
        for workers in args.workers:
            found = time_job(job, workers)
            verdict = "within" if found["wall_s"] <= TARGET_S else "OVER"
            sys.stdout.write(f"{job.name:28s} workers {workers or 'default':>7}  {found['wall_s']:6.1f} s wall "
                             f"({verdict} {TARGET_S:.0f} s), {found['cpu_s']:6.1f} s CPU  {found['answer']}\n")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
