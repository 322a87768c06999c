"""``python -m autosp.plan``: predict a training configuration for a model on a cluster before running it.

Answers whether it fits, the peak per rank by ledger category, the step time and (with ``--max-length``) the
longest sequence that fits; ``--json`` writes the same as a document.  Every answer starts with what it assumed
(Note [The planner CLI's defaults]).  Exit status 0 with an answer (also when it does not fit), 2 on a usage error
with a message saying what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from autosp.config import ACTIVATION_OFFLOAD, MEMORY_PLAN, AutoSPConfig
from autosp.entry import positive_int
from autosp.errors import AutoSPError
from autosp.plan.cluster_file import cluster_names
from autosp.plan.model_source import ModelSource
from autosp.plan.planner import OBJECTIVES
from autosp.plan.setup import (
    COMPILERS,
    DEPTHS,
    DTYPES,
    ENGINES,
    OFFLOADS,
    OPTIMIZERS,
    PLAIN_TRAINING_LOOP,
    TrainingSetup,
)
from autosp.plan.shares import AUTO_WORKERS_MAX, WORKERS_AUTO, workers_argument, workers_for
from autosp.plan.strategy_choice import STRATEGY_CHOICES
from autosp.presets import model_argument
from simulator.workload import CHOSEN_STRATEGIES, MEMORY_PLANNED_STRATEGIES, SPLayout, SPLayoutError

log = logging.getLogger("autosp.plan")

# Note [The planner CLI's defaults]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Unless told otherwise the command answers for what ``autosp.compile(model, sp_size=P)`` would do on the cluster:
#
# - the memory planned (``--memory-plan auto``, Note [The default memory plan] in autosp/plan/auto.py: on a cluster
#   there is always a memory size), under every strategy the planner plans (`MEMORY_PLANNED_STRATEGIES`), except
#   where the compile leaves the options as given (``--strategy auto``) or the command searches the longest length
#   of the options as given (``--max-length``): ``off`` there, the answer saying why;
# - the training setup the compiled model's own plan prices a plain training loop at (`library_setup`:
#   `TrainingSetup`'s defaults under `autosp.plan.setup.PLAIN_TRAINING_LOOP`, as the compiled model builds
#   it): no ZeRO, AdamW, no optimizer offload; the dtype is TrainingSetup's (the compiled model plans at its parameters' dtype, which a
#   config file does not say);
# - every rank of the cluster (a cluster preset's or file's; a hardware preset's one node, or as many nodes as
#   the ranks given need), SP inside one node (``--sp-size`` defaults to a node's GPUs, the other ranks
#   data-parallel replicas) and an SP group across nodes refused unless ``--allow-cross-node-sp`` (`resolve_ranks`).
#
# Option values have one spelling, the library's (``off``, not ``none``: that old spelling still maps to ``off``
# with a warning).  Each answer, printed and ``--json``, starts with the assumptions it made, each marked given or
# default (`Assumption`).

def library_setup() -> dict:
    """The `TrainingSetup` a compiled model's own plan prices a job at when nothing describes it (``plan_setup``
    unset): `TrainingSetup`'s defaults under `PLAIN_TRAINING_LOOP` and ``autosp.compile``'s compiler, as
    `autosp.plan.auto` builds it (the job's own length, ranks and dtype come from the command line)."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingSetup) if f.default is not dataclasses.MISSING}
    return {**defaults, "compiler": _config_default("compiler"), **PLAIN_TRAINING_LOOP}


def _config_default(name: str):
    return next(f.default for f in dataclasses.fields(AutoSPConfig) if f.name == name)


LIBRARY_STRATEGY = _config_default("strategy")
"""``autosp.compile``'s default strategy."""

DEPRECATED_MEMORY_PLAN = {"none": "off"}
"""Old spellings of ``--memory-plan`` values, accepted with a warning."""

EPILOG = """\
--cluster takes a hardware preset (one node, or as many nodes as the ranks given need), a multi-node cluster preset,
or a cluster file (JSON; fields and units: docs/design.md, "Cluster files"; example:
docs/examples/two_node_cluster.json).
Unless told otherwise the answer is for what autosp.compile(model, sp_size=P) would do: every rank of the cluster,
SP inside one node (the other ranks data-parallel replicas), the memory planned, and the setup a compiled model
assumes of a plain training loop (no ZeRO, AdamW, no offload). Every answer starts with what it assumed, each
given or default.
Peak memory is one definition everywhere: the DeepSpeed memory ledger inside backward (parameters, gradients,
optimizer state, communication buffers, CUDA context, NCCL, workspaces, allocator rounding and fragmentation)
plus the simulated activations of the traced AutoSP step - what python -m simulator --max-length reports.

examples:
  python -m autosp.plan --model llama-3.1-8b --cluster h100-sxm --seq-len 65536
  python -m autosp.plan --model path/to/config.json --cluster docs/examples/two_node_cluster.json \\
      --seq-len 131072 --zero-stage 2 --micro-batch 2 --json plan.json
  python -m autosp.plan --model tiny-llama --cluster a100-80gb-sxm --seq-len 4096 --sp-size 2 --max-length
  python -m autosp.plan --model llama-3.1-8b --cluster h100-sxm --seq-len 131072 --strategy auto
  python -m autosp.plan --model llama-3.1-8b --cluster h100-sxm --seq-len 65536 --zero-stage 2 \\
      --offload optimizer --memory-plan off
  python -m autosp.plan --model llama-3.1-8b --cluster h100-sxm --seq-len 262144 --memory-plan off \\
      --activation-offload on
  python -m autosp.plan --model llama-3.1-8b --cluster h100-sxm --seq-len 3670016 --zero-stage auto --workers 4
"""


def _cluster(value: str) -> str:
    if value in cluster_names() or Path(value).is_file():
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither a preset ({', '.join(cluster_names())}) nor a "
                                     "cluster file")


def _memory_plan(value: str) -> str:
    """``--memory-plan``: the library's spelling; an old one (`DEPRECATED_MEMORY_PLAN`) mapped, with a warning."""
    if value in DEPRECATED_MEMORY_PLAN:
        new = DEPRECATED_MEMORY_PLAN[value]
        log.warning("--memory-plan %s is deprecated: it is spelled %s now, as in autosp.compile(memory_plan=%r)",
                    value, new, new)
        return new
    return value


def _zero_stage(value: str) -> int | str:
    """``--zero-stage``: a stage, or auto."""
    try:
        return int(value)
    except ValueError:
        return value  # argparse's choices name a typo


def build_parser() -> argparse.ArgumentParser:
    from autosp.presets import PRESETS as MODEL_PRESETS

    lib = library_setup()
    p = argparse.ArgumentParser(
        prog="python -m autosp.plan", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Predict an AutoSP training configuration for a model on a cluster: whether it fits, the peak "
                    "memory per rank by\nledger category, the step time and the longest sequence that fits. The "
                    "model is traced on fake tensors\n(no weights, no downloads) and the step simulated.")
    p.add_argument("--model", required=True, type=model_argument,
                   help=f"a preset of autosp.presets ({', '.join(MODEL_PRESETS)}) or the path of any "
                        "Hugging Face causal-LM config.json (or its folder)")
    p.add_argument("--cluster", required=True, type=_cluster, metavar="PRESET_OR_FILE",
                   help=f"a hardware or cluster preset ({', '.join(cluster_names())}) or a cluster file (JSON)")
    p.add_argument("--seq-len", required=True, type=positive_int, help="tokens per sample (the full sequence)")
    p.add_argument("--sp-size", type=positive_int, default=None,
                   help="ranks sharing one sequence, inside one node unless --allow-cross-node-sp (default: a "
                        "node's GPUs, or fewer where the ranks given need: every rank of the cluster in SP groups "
                        "inside nodes, the other ranks data-parallel replicas)")
    p.add_argument("--dp-size", type=positive_int, default=None,
                   help="data-parallel replicas (default: as many SP groups as the ranks hold: --world-size / "
                        "--sp-size, else every rank of the cluster)")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="ranks in all, SP x DP (default: --sp-size x --dp-size where both are given, else every "
                        "rank of the cluster: a cluster preset's or file's, one node of a hardware preset)")
    p.add_argument("--allow-cross-node-sp", action="store_true",
                   help="let an SP group span nodes (its all-to-alls then cross the network); without it an SP "
                        "group that would is refused")
    p.add_argument("--zero-stage", type=_zero_stage, default=None, choices=(0, 1, 2, 3, "auto"),
                   help="DeepSpeed ZeRO stage 0-2, or 3: AutoSP's own sharded parameters (autosp.compile(..., "
                        "shard_parameters=True), or \"stage\": 3 under autosp.deepspeed_initialize, where --offload "
                        "optimizer offloads its optimizer; Ulysses); auto (with the "
                        "memory plan): the planner chooses ZeRO 1, 2, 2 with optimizer offload, 3 or 3 with "
                        "optimizer offload, the first under which a plan fits, keeping --offload if given (default: "
                        f"{lib['zero_stage']}, what a compiled model's own plan assumes of a plain training loop)")
    p.add_argument("--micro-batch", type=positive_int, default=1,
                   help="samples per SP group per micro-step (default: %(default)s)")
    p.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-steps per optimizer step (default: %(default)s)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help=f"parameter and compute dtype (default: {lib['dtype']})")
    p.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                   help=f"optimizer whose state the ledger counts (default: {lib['optimizer']})")
    p.add_argument("--offload", default=None, choices=OFFLOADS,
                   help="optimizer: DeepSpeed's offload_optimizer (device cpu; ZeRO 1, 2 or 3): fp32 master weights, "
                        "gradient partitions and optimizer state in host memory, CPU Adam; reports the host peak "
                        f"beside the device peak (default: {lib['offload']}; with --zero-stage auto, the planner's "
                        "choice)")
    p.add_argument("--engine", default=None, choices=ENGINES,
                   help="what steps --zero-stage 3's shards: torch (an optimizer over compiled.parameters()) or "
                        "deepspeed (autosp.deepspeed_initialize) (default: deepspeed with --offload optimizer, else torch)")
    p.add_argument("--activation-offload", default=None, choices=ACTIVATION_OFFLOAD,
                   help="AutoSP's activation offload (autosp.compile's activation_offload): on moves the tensors saved "
                        "for backward to host memory and back, asynchronously, and reports the host peak beside the "
                        "device peak; auto (with the memory plan) lets the planner try each plan with and without "
                        "it (default: auto with the memory plan, else off)"),
    p.add_argument("--compiler", default=None, choices=COMPILERS,
                   help="backend the graphs run under (frees saved activations after last use; aot_eager holds "
                        f"them to the end of backward) (default: {lib['compiler']})")
    p.add_argument("--depth", default=None, choices=DEPTHS,
                   help="trace every layer, or 1 and 2 layers and extrapolate, SAC deciding as for the full model "
                        "(faster; the full depth where that is refused) (default: full for a prediction, "
                        "extrapolated for --strategy auto and the memory plan)")
    p.add_argument("--max-length", action="store_true",
                   help="also search the longest sequence that fits the options as given (one trace per length "
                        "probed; the memory planner's own search is --objective longest)")
    p.add_argument("--max-length-high", type=positive_int, default=None,
                   help="ceiling of the --max-length search (default: 8 x --seq-len)")
    p.add_argument("--granularity", type=positive_int, default=1024,
                   help="length grid of the --max-length search, rounded up to a multiple of --sp-size "
                        "(default: %(default)s)")
    p.add_argument("--max-probes", type=positive_int, default=8,
                   help="lengths the --max-length search may simulate (default: %(default)s)")
    p.add_argument("--strategy", default=None, choices=STRATEGY_CHOICES,
                   help="how the sequence is split: the strategy autosp.compile traces with (hybrid: with "
                        "--ulysses-size), or auto: trace and simulate each, print each one's step time and peak, "
                        "choose the fastest that fits; with --memory-plan auto or --max-length, one decision over "
                        "every strategy and memory plan (default: "
                        f"{LIBRARY_STRATEGY}, autosp.compile's)")
    p.add_argument("--ulysses-size", type=positive_int, default=None,
                   help="--strategy hybrid: the ranks of one Ulysses group (a divisor of --sp-size that divides the "
                        "attention heads); the ring runs over --sp-size / --ulysses-size of them, as "
                        "autosp.compile(strategy='hybrid', ulysses_size=...)")
    p.add_argument("--memory-plan", type=_memory_plan, default=None, choices=MEMORY_PLAN,
                   help="auto: choose checkpointing (per-layer among them), SAC budget, tiled loss and tiled MLP by "
                        "predicting every candidate plan, print the candidate table and the chosen autosp.compile "
                        "options, as autosp.compile plans by default; off: predict the options as given, what "
                        "memory_plan='off' compiles (none, the old spelling of off, is accepted with a warning) "
                        "(default: auto, as autosp.compile, under --strategy ulysses, ring or hybrid; off with "
                        "--strategy auto, which leaves the memory options as given unless --memory-plan auto plans "
                        "them with the strategy, and with --max-length, which searches the options as given)")
    p.add_argument("--objective", default="fastest", choices=OBJECTIVES,
                   help="with the memory plan: the fastest step that fits at --seq-len, or the longest length "
                        "that fits (ties by speed) (default: %(default)s)")
    p.add_argument("--workers", type=workers_argument, default=WORKERS_AUTO,
                   help="with the memory plan: processes predicting the candidates side by side, the same predictions "
                        f"and choice (default: {WORKERS_AUTO}: for the longest length, --objective longest or "
                        f"--max-length, the cores this process may run on, at most {AUTO_WORKERS_MAX}; else 1)")
    p.add_argument("--target-memory", type=float, default=None, metavar="GiB",
                   help="memory per rank a plan must fit (default: the device's memory)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="also write the answer as JSON to this file, its assumptions first (default: none)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress logging")
    return p


@dataclasses.dataclass(frozen=True)
class Assumption:
    """One thing an answer assumed: its value, whether a flag gave it, and for a default where it comes from."""

    key: str
    value: object
    given: bool
    why: str = ""

    def to_dict(self) -> dict:
        return {"value": self.value, "given": self.given, "why": self.why}

    def format(self) -> str:
        label = self.key.replace("_", " ")
        return f"  {label:12s} {self.value} ({'given' if self.given else 'default'}{': ' if self.why else ''}" \
               f"{self.why})"


def format_assumptions(assumed: tuple[Assumption, ...]) -> str:
    """The ``assumed:`` block every printed answer starts with."""
    return "\n".join(["assumed:", *(a.format() for a in assumed)])


def assumptions_dict(assumed: tuple[Assumption, ...]) -> dict:
    """The ``assumed`` section every ``--json`` answer starts with: key -> {value, given, why}."""
    return {a.key: a.to_dict() for a in assumed}


@dataclasses.dataclass(frozen=True)
class ClusterShape:
    """What the rank defaults need of ``--cluster``: its ranks (None: a hardware preset, as many nodes as the
    ranks need, one by default) and GPUs per node."""

    name: str
    devices_per_node: int
    ranks: int | None = None


def cluster_shape(spec: str) -> ClusterShape:
    """The `ClusterShape` of a ``--cluster`` value (a cluster file or a cluster preset is read here)."""
    from autosp.plan.cluster_file import load_cluster
    from simulator.hardware import get_preset, preset_names

    if spec in preset_names():
        return ClusterShape(spec, get_preset(spec).devices_per_node)
    cluster = load_cluster(spec, world_size=1)
    return ClusterShape(spec, cluster.devices_per_node, cluster.world_size)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """SP x DP over a cluster, and how each was arrived at (`resolve_ranks`)."""

    sp_size: int
    dp_size: int
    nodes: int
    assumed: tuple[Assumption, ...]

    @property
    def world_size(self) -> int:
        return self.sp_size * self.dp_size


def _straddles(sp: int, dp: int, per_node: int) -> int | None:
    """The first SP group (contiguous ranks, rank r on node r // per_node) that spans two nodes; None: none."""
    return next((g for g in range(dp) if (g * sp) // per_node != (g * sp + sp - 1) // per_node), None)


def resolve_ranks(shape: ClusterShape, *, sp_size: int | None = None, dp_size: int | None = None,
                  world_size: int | None = None, allow_cross_node_sp: bool = False) -> Ranks:
    """SP and DP sizes from the flags given (None: not given) on ``shape`` (Note [The planner CLI's defaults]):
    every rank of the cluster unless ``world_size`` or both sizes say otherwise, SP inside a node unless given
    (the largest size that keeps every group inside a node, at most a node's GPUs), the rest DP replicas; an SP
    group across nodes refused unless ``allow_cross_node_sp``."""
    per_node, fixed = shape.devices_per_node, shape.ranks
    inside = not allow_cross_node_sp

    def fits(sp: int, dp: int) -> bool:
        return not inside or _straddles(sp, dp, per_node) is None

    def every(ranks: int) -> str:
        if fixed is not None:
            return "every rank of the cluster"
        return f"every rank of {'one node' if ranks == per_node else f'the {ranks // per_node} nodes it needs'}"

    world_why = ""
    if world_size is not None:
        world = world_size
        if sp_size is not None and world % sp_size:
            raise AutoSPError(f"--world-size {world} is not a multiple of --sp-size {sp_size}")
        if dp_size is not None and world % dp_size:
            raise AutoSPError(f"--world-size {world} is not a multiple of --dp-size {dp_size}")
        if sp_size is not None and dp_size is not None and sp_size * dp_size != world:
            raise AutoSPError(f"--world-size {world} != --sp-size {sp_size} x --dp-size {dp_size}")
        sp = sp_size or (world // dp_size if dp_size else
                         max(s for s in range(1, min(per_node, world) + 1) if world % s == 0 and fits(s, world // s)))
        dp = world // sp
    elif sp_size is not None and dp_size is not None:
        sp, dp = sp_size, dp_size
        world_why = "--sp-size x --dp-size"
    elif sp_size is not None:
        sp = sp_size
        ranks = fixed or per_node * -(-sp // per_node)
        if sp > ranks:
            raise AutoSPError(f"--sp-size {sp} is more than the {ranks} ranks of --cluster {shape.name}")
        dp = max([d for d in range(1, ranks // sp + 1) if fits(sp, d)] or [1])
        world_why = (every(ranks) if sp * dp == ranks else
                     f"as many SP groups of {sp} as the cluster's {ranks} ranks hold inside nodes, "
                     f"{ranks - sp * dp} idle")
    else:
        ranks = fixed or per_node * (dp_size or 1)
        dp_ = dp_size or ranks // min(per_node, ranks)
        if dp_ > ranks:
            raise AutoSPError(f"--dp-size {dp_} is more than the {ranks} ranks of --cluster {shape.name}")
        sp = max(s for s in range(1, min(per_node, ranks // dp_) + 1) if fits(s, dp_) or s == 1)
        dp = dp_
        world_why = (every(ranks) if sp * dp == ranks else
                     f"{sp * dp} of the cluster's {ranks} ranks, {ranks - sp * dp} idle")
    world = sp * dp
    if fixed is not None and world > fixed:
        raise AutoSPError(f"SP {sp} x DP {dp} = {world} ranks, and --cluster {shape.name} has {fixed}; give fewer "
                          "ranks or a larger cluster")
    if inside and sp > per_node:
        raise AutoSPError(f"--sp-size {sp} is more than a node's {per_node} GPUs ({shape.name}): an SP group would "
                          f"span nodes; give --sp-size {per_node} or less (the other ranks data-parallel), or "
                          "--allow-cross-node-sp")
    group = None if not inside else _straddles(sp, dp, per_node)
    if group is not None:
        first = group * sp
        raise AutoSPError(f"SP {sp} x DP {dp} on nodes of {per_node} GPUs puts SP group {group} (ranks {first}-"
                          f"{first + sp - 1}) across two nodes; give an --sp-size that divides {per_node}, fewer "
                          "ranks, or --allow-cross-node-sp")
    nodes = -(-world // per_node)
    across = sp > per_node or _straddles(sp, dp, per_node) is not None
    sp_why = ("" if sp_size is not None else
              "--world-size / --dp-size" if dp_size is not None and world_size is not None else
              "the ranks over --dp-size, at most a node's GPUs" if dp_size is not None else
              "a node's GPUs: SP inside one node" if sp == per_node else
              f"the largest that keeps every SP group inside a node of {per_node}")
    sp_why += "; across nodes (--allow-cross-node-sp)" if across else ""
    world_given = world_size is not None
    cluster_nodes = None if fixed is None else fixed // per_node
    assumed = (
        Assumption("world_size", world, world_given, "" if world_given else world_why),
        Assumption("nodes", nodes, fixed is not None,
                   (f"as many {shape.name} nodes as the ranks need" if fixed is None else
                    f"the cluster's {cluster_nodes}" if nodes == cluster_nodes else
                    f"{nodes} of the cluster's {cluster_nodes}") + f", {per_node} GPUs each"),
        Assumption("sp_size", sp, sp_size is not None, sp_why.lstrip("; ")),
        Assumption("dp_size", dp, dp_size is not None,
                   "" if dp_size is not None else "the other ranks, data-parallel replicas"),
    )
    return Ranks(sp_size=sp, dp_size=dp, nodes=nodes, assumed=assumed)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What the flags ask, every default filled in (`resolve`)."""

    setup: TrainingSetup
    memory_plan: str
    zero_auto: bool
    """``--zero-stage auto``: the planner chooses the DeepSpeed setup (`autosp.plan.plan_job`)."""
    assumed: tuple[Assumption, ...]
    strategy: str = LIBRARY_STRATEGY
    """``--strategy``, or autosp.compile's (`LIBRARY_STRATEGY`) where not given."""
    strategy_options: dict = dataclasses.field(default_factory=dict)
    """The ``autosp.compile`` options of a strategy other than the library's: ``strategy``, and the hybrid's
    ``ulysses_size``; empty for the library's own."""


def _memory_plan_default(args: argparse.Namespace, strategy: str) -> tuple[str, str]:
    """The default ``--memory-plan`` for the other flags (``strategy``: ``--strategy`` resolved), and why."""
    if strategy == "auto":
        return "off", "--strategy auto decides the strategy and leaves the memory options as given, as " \
                      "autosp.compile(strategy='auto') does"
    if strategy not in MEMORY_PLANNED_STRATEGIES:
        return "off", f"the memory planner does not plan --strategy {strategy} (nor does autosp.compile)"
    if args.max_length:
        return "off", "--max-length searches the options as given (the planner's own search: --memory-plan auto " \
                      "--objective longest)"
    return "auto", "as autosp.compile plans (Note [The default memory plan] in autosp/plan/auto.py)"


def resolve(args: argparse.Namespace, shape: ClusterShape | None = None) -> Resolved:
    """The training setup, memory plan and assumptions of parsed flags (Note [The planner CLI's defaults]); every
    refusal before any work.  ``shape``: the cluster's (None: read from ``--cluster``)."""
    lib = library_setup()
    ranks = resolve_ranks(shape or cluster_shape(args.cluster), sp_size=args.sp_size, dp_size=args.dp_size,
                          world_size=args.world_size, allow_cross_node_sp=args.allow_cross_node_sp)
    strategy = LIBRARY_STRATEGY if args.strategy is None else args.strategy
    strategy_options = _strategy_options(args, strategy, ranks.sp_size)
    if args.memory_plan is None:
        memory_plan, plan_why = _memory_plan_default(args, strategy)
    else:
        memory_plan, plan_why = args.memory_plan, ""
    zero_auto = args.zero_stage == "auto"
    if args.engine is not None and args.zero_stage != 3:
        raise AutoSPError(f"--engine says what steps the shards of --zero-stage 3 (given: {args.zero_stage}; "
                          "--zero-stage auto prices them under DeepSpeed's engine): drop --engine, or give --zero-stage 3")
    if zero_auto and memory_plan != "auto":
        raise AutoSPError("--zero-stage auto chooses the DeepSpeed setup with the memory plan, and the memory is not "
                          f"planned here (--memory-plan {memory_plan}" + (f": {plan_why}" if plan_why else "")
                          + "); give a ZeRO stage")
    if args.sp_size is None and args.seq_len % ranks.sp_size:
        raise AutoSPError(f"--seq-len {args.seq_len} is not divisible by the default --sp-size {ranks.sp_size} (a "
                          "node's GPUs); give a multiple of it, or --sp-size")
    chosen = {name: getattr(args, name) for name in ("dtype", "optimizer", "offload", "compiler")}
    fields = {name: lib[name] if value is None else value for name, value in chosen.items()}
    zero = lib["zero_stage"] if args.zero_stage is None or zero_auto else args.zero_stage
    if zero == 3 and strategy != "ulysses":  # as autosp.compile refuses shard_parameters=True there
        raise AutoSPError(f"--zero-stage 3 is AutoSP's sharded parameters, priced under --strategy ulysses only, not "
                          f"{strategy}: give --strategy ulysses, or a ZeRO stage 0-2 (--zero-stage auto chooses one)")
    setup = TrainingSetup(seq_len=args.seq_len, sp_size=ranks.sp_size, dp_size=ranks.dp_size, zero_stage=zero, **fields,
                          micro_batch=args.micro_batch, grad_accum=args.grad_accum, depth=args.depth, engine=args.engine)
    # under --zero-stage auto each setup the planner tries is checked (autosp.plan.deepspeed_setups.job_setups); ZeRO 2
    # takes all of them here
    (dataclasses.replace(setup, zero_stage=2) if zero_auto else setup).check()
    plain = "as autosp.compile assumes of a plain training loop"
    assumed = (
        *ranks.assumed,
        Assumption("zero_stage", "auto" if zero_auto else zero, args.zero_stage is not None,
                   "" if args.zero_stage is not None else
                   f"{plain}; --zero-stage auto lets the planner choose"),
        *([Assumption("engine", setup.shard_engine, args.engine is not None, "" if args.engine else
                      "deepspeed with --offload optimizer, else torch")] if zero == 3 else []),
        Assumption("optimizer", fields["optimizer"], args.optimizer is not None, "" if args.optimizer else plain),
        Assumption("offload", "auto" if zero_auto and args.offload is None else fields["offload"],
                   args.offload is not None,
                   "" if args.offload else "chosen with the ZeRO stage" if zero_auto else plain),
        Assumption("strategy", strategy + (f" (Ulysses {args.ulysses_size} x ring {ranks.sp_size // args.ulysses_size})"
                                           if args.ulysses_size else ""), args.strategy is not None,
                   "" if args.strategy is not None else "autosp.compile's"),
        Assumption("memory_plan", memory_plan, args.memory_plan is not None, plan_why),
        Assumption("dtype", fields["dtype"], args.dtype is not None,
                   "" if args.dtype else "a compiled model plans at its parameters' dtype; give --dtype for "
                                         "another"),
    )
    return Resolved(setup=setup, memory_plan=memory_plan, zero_auto=zero_auto, assumed=assumed, strategy=strategy,
                    strategy_options=strategy_options)


def _strategy_options(args: argparse.Namespace, strategy: str, sp_size: int) -> dict:
    """The ``autosp.compile`` strategy options of the flags (`Resolved.strategy_options`), refused before any work
    where the compile would refuse them: degrees that do not divide ``sp_size``, and attention heads the Ulysses
    groups cannot split (the binding limit named with what to give instead)."""
    if args.ulysses_size is not None and strategy != "hybrid":
        raise AutoSPError(f"--ulysses-size is the hybrid's Ulysses degree, and the strategy is {strategy}: give "
                          "--strategy hybrid too, or leave --ulysses-size out")
    if strategy == "auto":
        return {}
    if strategy == "hybrid" and args.ulysses_size is None:
        raise AutoSPError(f"--strategy hybrid needs its Ulysses degree: give --ulysses-size, a divisor of --sp-size "
                          f"{sp_size} (the ring then runs over --sp-size / --ulysses-size ranks)")
    try:
        layout = SPLayout.from_options(strategy, sp_size, ulysses_size=args.ulysses_size)
    except SPLayoutError as err:
        raise AutoSPError(f"--ulysses-size {args.ulysses_size}: {err}") from None
    heads = ModelSource(args.model).attention_heads(seq_len=args.seq_len)
    if heads is not None and layout.heads_rule(heads) is not None:
        hybrid_degrees = [d for d in layout.ulysses_degrees(heads) if 1 < d < sp_size]
        hybrid = (f"--strategy hybrid --ulysses-size {hybrid_degrees[-1]} (Ulysses over {hybrid_degrees[-1]} ranks, "
                  f"a ring over {sp_size // hybrid_degrees[-1]}), " if hybrid_degrees else "")
        raise AutoSPError(f"{args.model} has {heads} attention heads, which Ulysses groups of {layout.ulysses_size} "
                          f"ranks cannot split (--sp-size {sp_size}): give {hybrid}--strategy ring (any number of "
                          f"heads), or an --sp-size whose Ulysses degree divides {heads}")
    return {} if strategy == LIBRARY_STRATEGY else \
        {"strategy": strategy, **({"ulysses_size": layout.ulysses_size} if layout.kind.grouped else {})}


def setup_from_args(args: argparse.Namespace) -> TrainingSetup:
    """The training configuration of the flags, every default filled in (`resolve`)."""
    return resolve(args).setup


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        resolved = resolve(args)  # every refusal before any work
        setup, memory_plan, strategy = resolved.setup, resolved.memory_plan, resolved.strategy
        from autosp.plan.cluster_file import load_cluster
        from autosp.plan.prediction import predict

        cluster = load_cluster(args.cluster, world_size=setup.world_size)
        if args.target_memory is not None and args.target_memory <= 0:
            raise AutoSPError(f"--target-memory {args.target_memory}: give a positive number of GiB")
        target = None if args.target_memory is None else int(args.target_memory * 2**30)
        offload = args.activation_offload
        if offload == "auto" and memory_plan != "auto":
            raise AutoSPError("--activation-offload auto lets the memory planner decide, and the memory is not "
                              f"planned here (--memory-plan {memory_plan}); add --memory-plan auto, or choose on or "
                              "off")
        options = {"activation_offload": "on"} if offload == "on" else {}
        if memory_plan == "auto" and strategy not in (*MEMORY_PLANNED_STRATEGIES, *CHOSEN_STRATEGIES):
            raise AutoSPError(f"--strategy {strategy} is not combined with --memory-plan auto (the memory "
                              f"planner plans {' and '.join(MEMORY_PLANNED_STRATEGIES)}); add --memory-plan off")
        if memory_plan == "auto" and args.max_length:
            raise AutoSPError("--max-length searches the longest length of the options as given: add --memory-plan "
                              "off; the memory planner's own search is --objective longest")
        if strategy == "auto" and memory_plan != "auto" and not args.max_length:
            from autosp.plan.strategy_choice import choose_strategy

            answer = choose_strategy(args.model, setup, cluster, capacity_bytes=target, options=options,
                                     progress=lambda s: log.info("step at %s", s))
        elif memory_plan == "auto" or strategy == "auto":
            from autosp.plan import planner
            from autosp.plan.candidates import MemoryPlan, candidates_for, plan_name
            from autosp.plan.progress import DecisionProgress

            def memory_candidates(fixed: dict) -> tuple[MemoryPlan, ...]:
                if memory_plan != "auto":  # --max-length: the options as given
                    given = {**options, **fixed}
                    return (MemoryPlan(plan_name(given) or "options as given", given),)
                # the candidates autosp.compile(memory_plan="auto") tries, chunks sized for the same target
                return candidates_for(
                    args.model, setup, cluster.device.memory_bytes if target is None else target,
                    activation_offload=("off", "on") if offload in (None, "auto") else (offload,), fixed=fixed)

            if strategy == "auto":  # Note [The strategy and the memory in one decision]
                from autosp.plan.strategy_choice import every_strategy_plans

                hf = ModelSource(args.model).config(seq_len=setup.seq_len).to_dict()
                plans = every_strategy_plans(hf, setup, memory_candidates)
            else:
                plans = memory_candidates(resolved.strategy_options)
            objective = "longest" if args.max_length else args.objective
            shown = None if args.quiet else DecisionProgress()
            planning = dict(objective=objective, target_memory=target, plans=plans,
                            max_length_high=args.max_length_high, granularity=args.granularity,
                            max_probes=args.max_probes, workers=workers_for(args.workers, objective), progress=shown)
            try:
                if resolved.zero_auto:  # the planner chooses the DeepSpeed setup too
                    fixed = {} if args.offload is None else {"offload": args.offload}
                    answer = planner.plan_job(args.model, setup, cluster, fixed=fixed, **planning)
                else:
                    answer = planner.plan_memory(args.model, setup, cluster, **planning)
            finally:
                if shown is not None:
                    shown.close()
        else:
            from autosp.plan.traces import TraceReuse

            options = {**options, **resolved.strategy_options}
            answer = predict(args.model, setup, cluster, capacity_bytes=target, max_length=args.max_length,
                             max_length_high=args.max_length_high, granularity=args.granularity,
                             max_probes=args.max_probes, progress=lambda s: log.info("step at %s", s),
                             options=options or None, reuse=TraceReuse([options], resize_lengths=args.max_length))
    except AutoSPError as err:
        log.error("%s", err)
        return 2
    # The command's result (not a diagnostic): the answer on stdout, its assumptions first.
    sys.stdout.write(format_assumptions(resolved.assumed) + "\n" + answer.format() + "\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = {"assumed": assumptions_dict(resolved.assumed), **answer.to_dict()}
        args.json.write_text(json.dumps(document, indent=1, default=str))
        sys.stdout.write(f"wrote {args.json}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
