"""How long the planner takes to decide (issues 20 and 21): a memory plan at one length (two candidates, or
``default-plan``: every candidate ``autosp.compile``'s default memory plan predicts), ``strategy="auto"`` and the
longest length, the last with and without re-sizing the joint graph across lengths
(`autosp.plan.traces.TraceReuse`, docs/design.md "Trace reuse"). The decisions predict their candidates at depth
``extrapolated`` (Note [Shallow traces checkpointed for the full depth] in autosp/plan/depth.py); ``--compare``
also takes each decision at full depth and prints both side by side: the choice, and each candidate's step time
and peak with the difference ("=": the same number); ``--separate-traces`` also takes ``strategy="auto"`` with each
candidate traced on its own (Note [One Dynamo capture for every strategy] in autosp/plan/prediction.py), side by side
the same way; ``--ranks N ...`` also takes ``strategy-auto`` and ``default-plan`` the way ``autosp.compile`` does,
on N gloo ranks this script starts (`autosp.plan.auto.strategy_on_ranks`, `memory_plan_on_ranks`: the candidates
spread over the ranks, each rank's share
predicted in its own cold planner process, Note [Candidates spread over the ranks] in autosp/plan/auto.py; N = 1 is
one cold planner process predicting every candidate) and prints each rank's wall and CPU time (its own and its
planner process's), and each candidate's step time and peak beside the one-process decision's. Prints wall and CPU
times (the CPU time is steadier on a shared machine), traces,
re-sized lengths and where the time went (summed from the planner's log: tracing, re-sizing, simulating). Not a
test: it takes minutes on a CPU.

    python -m experiments.bench_planner --model llama-3.1-8b --cluster h100-sxm --sp-size 8 --seq-len 65536
"""

from __future__ import annotations

import dataclasses
import logging
import re
import resource
import sys
import time


class _Seconds(logging.Handler):
    """Sums the seconds the planner's log lines report ("traced in 12.3 s", "re-sized ... in", "simulated ...
    in")."""

    PATTERNS = {"trace": re.compile(r"^traced in ([0-9.]+) s"), "resize": re.compile(r"^re-sized .* in ([0-9.]+) s"),
                "simulate": re.compile(r"^simulated on .* in ([0-9.]+) s")}

    def __init__(self):
        super().__init__(logging.INFO)
        self.seconds = dict.fromkeys(self.PATTERNS, 0.0)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for what, pattern in self.PATTERNS.items():
            found = pattern.match(message)
            if found:
                self.seconds[what] += float(found.group(1))


SCENARIOS = ("longest", "longest-traced", "memory-plan", "default-plan", "strategy-auto")
ON_RANKS = ("strategy-auto", "default-plan")
"""The decisions ``--ranks`` also takes as collectives."""


def build_parser():
    from experiments import cli

    parser = cli.parser("experiments.bench_planner", __doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="a preset of autosp.presets or a config.json")
    parser.add_argument("--cluster", default="h100-sxm", help="a cluster preset or a cluster file")
    parser.add_argument("--sp-size", type=int, default=8, help="SP ranks")
    parser.add_argument("--seq-len", type=int, default=65536, help="the planned length (tokens per sample)")
    parser.add_argument("--max-probes", type=int, default=8, help="lengths the max-length search may simulate")
    parser.add_argument("--only", nargs="+", default=list(SCENARIOS), choices=SCENARIOS,
                        help="decisions to time: longest (lengths re-sized), longest-traced (every length traced), "
                             "memory-plan (one length, two candidates), default-plan (one length, every candidate "
                             "of the default memory plan), strategy-auto (one length)")
    parser.add_argument("--depth", default=None, choices=("full", "extrapolated"),
                        help="the depth the decisions predict at (default: theirs, extrapolated)")
    parser.add_argument("--compare", action="store_true",
                        help="also decide at full depth and print both decisions and predictions side by side")
    parser.add_argument("--separate-traces", action="store_true",
                        help="strategy-auto: also decide with each candidate traced on its own (no shared Dynamo "
                             "capture, as before it) and print both side by side")
    parser.add_argument("--ranks", type=int, nargs="+", default=[],
                        help="strategy-auto, default-plan: also decide on this many gloo ranks, as autosp.compile "
                             "does (each rank's planner process cold), and compare with the one-process decision")
    parser.add_argument("--planner-ahead", action="store_true",
                        help="--ranks: each rank starts its planner process before the decision and waits for its "
                             "imports, as a script that calls autosp.start_planner() before loading its model")
    return parser


def _on_ranks(rank: int, world: int, what: str, model: str, setup, cluster: str, ahead: bool = False) -> dict:
    """One rank of ``--ranks``: ``what`` (``strategy-auto`` or ``default-plan``) for a meta-device model of
    ``model`` (no weights) and the `TrainingSetup` ``setup``, timed from a barrier: the collective
    (`strategy_on_ranks`, `memory_plan_on_ranks`) with the request of the ``setup.sp_size``-rank job, whose setup is
    ``setup``.  ``ahead``: the rank's planner process is started before the barrier and ready (its imports made)
    when the timing starts (Note [Planner process started ahead] in autosp/plan/process.py)."""
    import dataclasses

    import torch
    import torch.distributed as dist
    import transformers

    from autosp.config import AutoSPConfig
    from autosp.plan import auto, start_planner
    from autosp.plan.cluster_file import load_cluster
    from autosp.plan.model_source import ModelSource

    hf = ModelSource(model).config(seq_len=setup.seq_len)
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(hf).to(setup.torch_dtype)
    if what == "strategy-auto":
        config = AutoSPConfig(sp_size=setup.sp_size, strategy="auto", plan_seq_len=setup.seq_len, plan_cluster=cluster)
    else:  # the target the one-process decision plans for: the device's memory
        config = AutoSPConfig(sp_size=setup.sp_size, memory_plan="auto", plan_cluster=cluster,
                              target_memory=load_cluster(cluster, world_size=setup.world_size).device.memory_bytes)
    planner = start_planner() if ahead else None
    ready_s = planner.wait_ready() if ahead else None
    dist.barrier()
    start, cpu, children = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    fields = dataclasses.asdict(setup)
    if what == "strategy-auto":
        def request():
            return {**auto.strategy_request(module, config, world_size=setup.world_size, explicit={}),
                    "setup": fields}

        report, _ = auto.strategy_on_ranks(dist.group.WORLD, request, module.config, torch.device("meta"), planner)
    else:
        def request():
            return {**auto.plan_request(module, config, seq_len=setup.seq_len, micro_batch=setup.micro_batch,
                                        world_size=setup.world_size, explicit={}), "setup": fields}

        report, _ = auto.memory_plan_on_ranks(dist.group.WORLD, request, torch.device("meta"), planner)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    planner_cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    if planner is not None:  # unasked on a rank with no candidate (a no-op once it answered): not timed
        planner.close()
    return {"wall": wall, "cpu": cpu, "planner_cpu": planner_cpu, "report": report, "ready_s": ready_s}


def _ranks_table(what: str, world: int, results: list[dict], one_process) -> str:
    """The ``--ranks`` lines of one group size: per rank its candidates, wall and CPU; the decision and each
    candidate's step time and peak beside the one-process decision's."""
    report = results[0]["report"]
    name = "system" if what == "strategy-auto" else "plan"
    by_rank = {r: [c[name] for c in report["candidates"] if c["rank"] == r] for r in range(world)}
    if what != "strategy-auto":  # a rank's share: its units (autosp.plan.shares.plan_units)
        by_rank = {r: [f"{len(names)} candidates"] if names else [] for r, names in by_rank.items()}
    ahead = results[0]["ready_s"] is not None
    how = ("planner process per rank started ahead, timed once its imports were made (slowest: "
           f"{max(f['ready_s'] for f in results):.1f} s)" if ahead else "cold planner process per rank that predicts")
    out = [f"{what} on {world} gloo rank(s), the collective autosp.compile runs ({how}):",
           f"  {'rank':>4s} {'predicts':36s} {'wall s':>7s} {'CPU s':>7s} {'rank CPU':>8s} {'planner CPU':>11s} "
           f"{'planner wall':>12s} {'predicting':>10s} {'its CPU':>7s}"]
    for r, found in enumerate(results):
        out.append(f"  {r:4d} {', '.join(by_rank[r]) or '-':36s} {found['wall']:7.1f} "
                   f"{found['cpu'] + found['planner_cpu']:7.1f} {found['cpu']:8.1f} {found['planner_cpu']:11.1f} "
                   f"{report['planner_seconds_by_rank'][r]:12.1f} {report['predict_seconds_by_rank'][r]:10.1f} "
                   f"{report['predict_cpu_seconds_by_rank'][r]:7.1f}")
    slowest = max(f["cpu"] + f["planner_cpu"] for f in results)
    out.append("  (wall: the rank's call from a barrier; CPU: the rank's own and its planner process's"
               + (", the planner's imports included although made before the barrier" if ahead else "")
               + "; planner wall: the request to the answer, predicting: the process's time after its imports, "
               "its CPU: the process's CPU time in it)")
    out.append(f"  wall here {max(f['wall'] for f in results):.1f} s ({world} rank(s) sharing this machine's cores); "
               f"slowest rank's CPU {slowest:.1f} s: on a training node, where each rank has its own cores, that "
               "is about the wall time (not measured here)"
               + (f"; slowest rank's predicting {max(report['predict_seconds_by_rank']):.1f} s here, "
                  f"{max(report['predict_cpu_seconds_by_rank']):.1f} s of CPU: what a rank with its own cores waits "
                  "for once its process was started ahead" if ahead else ""))
    out.append(_compare(report, one_process, "one process"))
    same = all(results[0]["report"]["candidates"] == f["report"]["candidates"] for f in results)
    out.append(f"  every rank's decision the same rows: {'yes' if same else 'NO'}")
    return "\n".join(out)


def _rows(decision) -> tuple[str | None, dict[str, tuple[float, float]]]:
    """(chosen, candidate -> (step s, peak GiB)) of a PlanReport, a StrategyDecision or ``report.strategy_plan``."""
    if isinstance(decision, dict):  # a strategy decision's chosen is its name, a memory plan's an index
        rows, chosen = decision["candidates"], decision["chosen"]
        name = "system" if rows and "system" in rows[0] else "plan"
        return (rows[chosen][name] if isinstance(chosen, int) else chosen), {
            c[name]: (c["step_time_s"], c["peak_bytes"] / 2**30) for c in rows if c["step_time_s"] is not None}
    if hasattr(decision, "objective"):
        chosen = decision.candidates[decision.chosen].plan.name if decision.chosen is not None else None
        return chosen, {c.plan.name: (c.prediction.step.step_time_s, c.prediction.peak_bytes / 2**30)
                        for c in decision.candidates if c.prediction}
    return decision.chosen, {c.system: (c.prediction.step.step_time_s, c.prediction.peak_bytes / 2**30)
                             for c in decision.candidates if c.prediction}


def _compare(fast, full, label: str = "full depth") -> str:
    chosen, rows = _rows(fast)
    chosen_full, rows_full = _rows(full)
    short = label.split()[0]
    out = [f"  chosen: {chosen} ({label}: {chosen_full}; {'same' if chosen == chosen_full else 'DIFFERENT'})",
           f"  {'candidate':40s} {'step s':>9s} {short:>9s} {'diff':>7s} {'peak GiB':>9s} {short:>9s} {'diff':>7s}"]
    def diff(a: float, b: float) -> str:  # "=": the same float
        return f"{'=':>7s}" if a == b else f"{100 * (a / b - 1):+6.2f}%"

    for name, (step, peak) in rows.items():
        step_full, peak_full = rows_full.get(name, (float("nan"), float("nan")))
        out.append(f"  {name:40s} {step:9.4f} {step_full:9.4f} {diff(step, step_full)} "
                   f"{peak:9.3f} {peak_full:9.3f} {diff(peak, peak_full)}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from autosp.plan import TrainingSetup, load_cluster
    from autosp.plan.candidates import candidate_plans, candidates_for
    from autosp.plan.planner import plan_memory
    from autosp.plan.prediction import predict
    from autosp.plan.strategy_choice import choose_strategy
    from autosp.plan.traces import TraceReuse

    handler = _Seconds()
    logging.getLogger("autosp.plan").addHandler(handler)
    logging.getLogger("autosp.plan").setLevel(logging.INFO)
    setup = TrainingSetup(seq_len=args.seq_len, sp_size=args.sp_size, depth=args.depth)
    cluster = load_cluster(args.cluster, world_size=setup.world_size)
    # The two checkpointing plans of one trace group (issue 20's "2 plans"): SAC and full recomputation.
    plans = candidate_plans(checkpointing=("sac", "full"), tiled_loss=("off",), tiled_mlp=("off",),
                            activation_offload=("off",))
    start = time.perf_counter()  # warm-up: the first trace of a process pays for imports and first compiles
    predict(args.model, TrainingSetup(seq_len=args.seq_len, sp_size=args.sp_size, depth="extrapolated"), cluster)
    sys.stdout.write(f"{'warm-up':15s} {time.perf_counter() - start:7.1f} s  (1 and 2 layers traced)\n")
    runs = [(what, setup, True) for what in args.only]
    if args.compare:
        full = dataclasses.replace(setup, depth="full")
        runs = [run for what in args.only for run in ((what, setup, True), (what, full, True))]
    if args.separate_traces and "strategy-auto" in args.only:
        at = next(i for i, run in enumerate(runs) if run[0] == "strategy-auto")
        runs.insert(at + 1, ("strategy-auto", setup, False))
    decided = {}
    planned = setup  # the decisions --ranks takes: at the default depth, or --depth
    for what, setup, shared in runs:
        handler.seconds = dict.fromkeys(handler.PATTERNS, 0.0)
        start, cpu = time.perf_counter(), time.process_time()
        if what == "strategy-auto":
            reuse = TraceReuse([])
            report = choose_strategy(args.model, setup, cluster, reuse=reuse, share_capture=shared)
            counts, answer = f"{reuse.traces} traces", f"chose {report.chosen}"
        else:
            longest = what.startswith("longest")
            report = plan_memory(args.model, setup, cluster, objective="longest" if longest else "fastest",
                                 plans=candidates_for(args.model, setup, cluster.device.memory_bytes)
                                 if what == "default-plan" else plans,
                                 max_probes=args.max_probes, resize_lengths=what != "longest-traced")
            chosen = report.candidates[report.chosen] if report.chosen is not None else None
            lengths = sorted(chosen.prediction.max_length["lengths_simulated"]) if longest and chosen else []
            counts = f"{report.traces} traces, {report.partitions} partitions"
            answer = (f"chose {chosen.plan.name if chosen else None}"
                      + (f", max length {chosen.max_seq_len} over lengths {lengths}" if longest and chosen else ""))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        spent = ", ".join(f"{k} {v:.1f} s" for k, v in handler.seconds.items())
        label = f"{what} ({'full depth' if setup.depth == 'full' else 'extrapolated'}" + (
            "" if shared else ", separate traces") + ")"
        sys.stdout.write(f"{label:48s} {seconds:7.1f} s wall, {cpu:7.1f} s CPU  ({counts}; {spent}); {answer}\n")
        if what in decided and not what.startswith("longest"):
            other = "full depth" if setup.depth == "full" else "separate traces"
            sys.stdout.write(_compare(decided[what], report, other) + "\n")
        decided.setdefault(what, report)
        sys.stdout.flush()
    from experiments.launch import run_on_ranks

    for what in (w for w in ON_RANKS if w in decided):
        for world in args.ranks:
            results = run_on_ranks(_on_ranks, world, what, args.model, planned, args.cluster, args.planner_ahead,
                                   timeout_s=3600, collective_timeout_s=1800)
            sys.stdout.write(_ranks_table(what, world, results, decided[what]) + "\n")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
