"""Write the notebooks of this folder from the cells below (``python -m experiments.notebooks.build``).

The notebooks are thin: a parameter cell, then calls into the public API - `autosp.plan` (what
``python -m autosp.plan`` runs: the model a name or a config.json stands for, a cluster preset or file,
`autosp.plan.predict`), `autosp.compile` and `autosp.prepare_inputs`, and `simulator.plots` - then a plot with a
sentence saying what it shows.  They are stored without outputs; ``tests/experiments/test_notebooks.py`` executes
each one.  Edit the cells here and rebuild rather than editing the ``.ipynb`` files by hand.

Parameters.  The first code cell of each notebook sets its parameters (``MODEL``: a preset of
``python -m autosp.train`` or the path of a Hugging Face config.json; ``CLUSTER``: a preset or a cluster file;
then the training configuration) and carries papermill's ``parameters`` tag.  `with_parameters` inserts a cell
after it that sets other values - what ``papermill NOTEBOOK OUT -p NAME VALUE`` does, with nbclient alone - so
the notebook test runs each notebook on a small model without changing its defaults.
"""

from __future__ import annotations

import copy
import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from experiments.reproduction.max_seq_len import TABLE as MAX_SEQ_LEN

HERE = pathlib.Path(__file__).resolve().parent
MAX_SEQ_LEN_CSV = f"{MAX_SEQ_LEN.name}.csv"
"""The reproduce table (`experiments.reproduction.TABLES`) whose results the max-sequence-length notebook reads; its
summary is run.json's ``MAX_SEQ_LEN.record``."""
PARAMETERS_TAG = "parameters"
"""The tag of the parameter cell (papermill's)."""

SETUP = """\
import os
import pathlib
import sys

# Run from the repository root whatever the notebook's working folder (experiments/notebooks): the paths of the
# parameters (a config.json, a cluster file, a results folder) are relative to it.
root = next(p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "experiments").is_dir())
os.chdir(root)
sys.path.insert(0, str(root))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / ".torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")"""

YOUR_MODEL = (
    "**Your model and cluster.** Set `MODEL` below to the path of a Hugging Face `config.json` (or its folder; "
    "the weights are random and nothing is downloaded) and `CLUSTER` to a preset (`python -m autosp.plan --help` "
    "lists them) or a cluster file (fields and units: docs/design.md, \"Cluster files\"; an example: "
    "`docs/examples/two_node_cluster.json`); paths are relative to the repository root. To run it with other "
    "values without editing it: `papermill NOTEBOOK OUT -p MODEL path/to/config.json` (the parameter cell is "
    "tagged `parameters`), or `experiments.notebooks.build.with_parameters` as the notebook test does.")


def _parameters(source: str):
    return new_code_cell(source, metadata={"tags": [PARAMETERS_TAG]})


TRAINING_PARAMETERS = (
    "SP_SIZE = {sp}  # ranks sharing one sequence\n"
    "DP_SIZE = 1  # data-parallel replicas (the world is SP_SIZE x DP_SIZE ranks)\n"
    "ZERO_STAGE = 1  # DeepSpeed ZeRO 0, 1 or 2\n"
    "MICRO_BATCH = 1  # samples per SP group per micro-step\n"
    'DTYPE = "bf16"  # or "fp32"\n'
    'DEPTH = "full"  # trace every layer; "extrapolated": shallow traces, too low under checkpointing '
    "(Note [Depth extrapolation] in simulator/max_length.py)")

SETUP_FROM_PARAMETERS = (
    "from autosp.plan import TrainingSetup, load_cluster, predict\n\n"
    "setup = TrainingSetup(seq_len={seq_len}, sp_size=SP_SIZE, dp_size=DP_SIZE, zero_stage=ZERO_STAGE,\n"
    "                      micro_batch=MICRO_BATCH, dtype=DTYPE, depth=DEPTH)\n"
    "cluster = load_cluster(CLUSTER, world_size=setup.world_size)\n")

NOTEBOOKS = {
    "equivalence_and_overhead.ipynb": [
        new_markdown_cell(
            "# Equivalence and overhead on CPU gloo ranks\n\n"
            "A model compiled by `autosp.compile` over `RANKS` gloo ranks of this machine trains one step beside "
            "the same step on one device over the full sequence (the README's \"Use it on your model\" snippet, "
            "in `experiments/notebooks/ranks.py`): the loss and every gradient are compared, then the median "
            "step time of each. `autosp.plan.predict` (what `python -m autosp.plan` prints) then simulates the "
            "same training step on `CLUSTER`, so the measured and the predicted step stand side by side. "
            "`python -m experiments.reproduce --only measured-cpu` compares AutoSP with the hand-written "
            "baselines (Ulysses, ring attention, ZeRO-3) at the reproduction's sizes."),
        new_markdown_cell(YOUR_MODEL + " On a CPU keep a large model small: copy its `config.json` and lower "
                          "`num_hidden_layers` and `hidden_size`."),
        _parameters(
            "# Parameters (small: the notebook runs in well under a minute)\n"
            'MODEL = "tiny-llama"  # a preset of python -m autosp.train, or the path of a Hugging Face config.json\n'
            'CLUSTER = "cpu-gloo"  # where the step is predicted: a preset or a cluster file (cpu-gloo: this '
            "machine's calibrated preset)\n"
            "RANKS = 2  # gloo ranks on this machine: the SP degree\n"
            "SEQ_LEN = 128  # tokens of the sample, before sharding\n"
            "STEPS = 3  # timed steps of each after the first\n"
            'COMPILER = "aot_eager"  # the backend AutoSP hands its graphs to ("inductor": slow cold compile on CPU)\n'
            'VARIANTS = {"autosp": {}, "autosp, no checkpointing": {"checkpointing": "none"}}  '
            "# name -> autosp.compile options"),
        new_code_cell(SETUP),
        new_code_cell(
            "from experiments.launch import run_on_ranks\n"
            "from experiments.notebooks.ranks import ATOL, RTOL, equivalence_on_rank\n\n"
            'spec = {"model": MODEL, "seq_len": SEQ_LEN, "steps": STEPS, "compiler": COMPILER, "variants": VARIANTS}\n'
            "per_rank = run_on_ranks(equivalence_on_rank, RANKS, spec, timeout_s=600, collective_timeout_s=300)\n"
            "# the slowest rank's step and the largest error over the ranks\n"
            'single_s = max(r["reference_median_step_s"] for r in per_rank)\n'
            'measured = {name: {key: max(r["variants"][name][key] for r in per_rank)\n'
            '                   for key in ("loss_error", "grad_max_rel_error", "first_step_s", "median_step_s")}\n'
            "            for name in VARIANTS}\n"
            'exact = {name: all(r["variants"][name]["grads_close"] for r in per_rank) for name in VARIANTS}\n'
            'print(f"single device, full sequence: step {single_s * 1e3:.1f} ms")\n'
            "for name, m in measured.items():\n"
            '    print(f"{name}: loss error {m[\'loss_error\']:.1e}, largest relative gradient error "\n'
            '          f"{m[\'grad_max_rel_error\']:.1e}, every gradient within rtol {RTOL:g} / atol {ATOL:g}: "\n'
            '          f"{exact[name]}; first (compiling) step {m[\'first_step_s\']:.1f} s, then "\n'
            '          f"{m[\'median_step_s\'] * 1e3:.1f} ms a training step ({m[\'median_step_s\'] / single_s:.2f} x "\n'
            '          "single device)")'),
        new_code_cell(
            "import matplotlib.pyplot as plt\n\n"
            "fig, ax = plt.subplots(figsize=(6, 3.2))\n"
            'ax.bar(list(VARIANTS), [max(measured[n]["grad_max_rel_error"], 1e-12) for n in VARIANTS])\n'
            'ax.axhline(RTOL, color="black", ls="--", lw=0.8, label=f"rtol {RTOL:g}")\n'
            'ax.set_yscale("log")\n'
            'ax.set_ylabel("largest relative gradient error")\n'
            'ax.set_title(f"{MODEL}: {RANKS} gloo ranks vs one device, {SEQ_LEN} tokens")\n'
            "ax.legend(fontsize=7)\n"
            "fig.tight_layout()\n"
            "plt.show()"),
        new_markdown_cell(
            "Each bar is the largest relative difference, over every parameter and rank, between the gradient "
            "AutoSP computed and the single-device one (log scale): a bar below the dashed tolerance line means "
            "the sequence-parallel step trained exactly what the single-device step trains, up to fp32 rounding "
            "(the printed line above says whether every gradient passed the elementwise check), and a bar above it "
            "is a bug to report."),
        new_code_cell(
            "from autosp.plan import TrainingSetup, load_cluster, predict\n\n"
            "# the same step predicted on CLUSTER: plain autosp.compile (no ZeRO), fp32, the ranks above\n"
            'setup = TrainingSetup(seq_len=SEQ_LEN, sp_size=RANKS, zero_stage=0, dtype="fp32", compiler=COMPILER)\n'
            "cluster = load_cluster(CLUSTER, world_size=setup.world_size)\n"
            "predicted = {name: predict(MODEL, setup, cluster, options=options) for name, options in VARIANTS.items()}\n"
            "print(next(iter(predicted.values())).format())"),
        new_code_cell(
            "import numpy as np\n\n"
            "names = list(VARIANTS)\n"
            "x = np.arange(len(names))\n"
            "fig, ax = plt.subplots(figsize=(7, 3.2))\n"
            'ax.bar(x - 0.2, [measured[n]["median_step_s"] * 1e3 for n in names], 0.4, label="measured here")\n'
            "ax.bar(x + 0.2, [predicted[n].step.step_time_s * 1e3 for n in names], 0.4, hatch=\"//\",\n"
            '       color="white", edgecolor="black", label=f"predicted on {CLUSTER}")\n'
            'ax.axhline(single_s * 1e3, color="gray", ls="--", lw=0.8, label="single device, measured")\n'
            "ax.set_xticks(x, names, fontsize=7)\n"
            'ax.set_ylabel("training step (ms)")\n'
            "ax.legend(fontsize=7)\n"
            "fig.tight_layout()\n"
            "plt.show()"),
        new_markdown_cell(
            "The solid bars are each variant's measured median training step on this machine's gloo ranks "
            "(forward, backward and an AdamW step) and the dashed line the single-device step over the whole "
            "sequence; the hatched bars are the step `autosp.plan.predict` simulates for the same model, length "
            "and ranks on `CLUSTER` (forward, backward, gradient reduction and optimizer step). With `cpu-gloo` "
            "calibrated on this machine (`python -m experiments.calibrate_cpu --update-preset`) and nothing else "
            "running, a hatched bar is the simulator's estimate of its solid neighbour, so their gap is the "
            "simulator's error here (a tiny model's step is mostly per-operation overhead, the hardest case); "
            "with another cluster it is that cluster's predicted step."),
    ],
    "simulated_timeline.ipynb": [
        new_markdown_cell(
            "# A simulated AutoSP step\n\n"
            "`autosp.plan.predict` (what `python -m autosp.plan` prints) traces a model's training step through "
            "the AutoSP pass on fake tensors (no weights, no GPU), adds the gradient reduction and DeepSpeed's "
            "optimizer step, and simulates it on a cluster; the simulated step it keeps "
            "(`prediction.step.simulated`) is drawn here with `simulator.plots`: compute and communication "
            "streams per rank, then memory over time. `python -m experiments.reproduce` writes the same plots "
            "(and a Perfetto trace) for its throughput model (`--iteration-model`)."),
        new_markdown_cell(YOUR_MODEL),
        _parameters(
            "# Parameters (a paper model at full depth: tracing takes a while on a laptop)\n"
            'MODEL = "llama-3.2-3b"  # a preset of python -m autosp.train, or the path of a Hugging Face '
            "config.json\n"
            'CLUSTER = "a100-80gb-sxm"  # a hardware or cluster preset, or a cluster file\n'
            "SEQ_LEN = 4096  # tokens per sample\n"
            + TRAINING_PARAMETERS.format(sp=8)),
        new_code_cell(SETUP),
        new_code_cell(
            SETUP_FROM_PARAMETERS.format(seq_len="SEQ_LEN")
            + "prediction = predict(MODEL, setup, cluster)\n"
            "print(prediction.format())\n"
            "result = prediction.step.simulated  # the simulator's result of the traced step"),
        new_code_cell(
            "import tempfile\n\n"
            "from IPython.display import Image, display\n\n"
            "from simulator.plots import plot_memory, plot_timeline\n\n"
            "folder = pathlib.Path(tempfile.mkdtemp())\n"
            'plot_timeline(result, folder / "timeline.png", max_ranks=2)\n'
            'display(Image(filename=str(folder / "timeline.png")))'),
        new_markdown_cell(
            "One row per stream of the first ranks over the simulated step (identical ranks are simulated "
            "once, so often only the first rank appears): the compute row runs the traced forward, then "
            "backward, then the optimizer step; the `comm:sp` row shows AutoSP's all-to-alls around each "
            "attention and the `comm:dp` row the gradient reduction at the end of backward. A grey stall in the "
            "compute row is time spent waiting for a collective; a collective under a coloured compute segment "
            "is overlapped."),
        new_code_cell(
            'plot_memory(result, folder / "memory.png", max_ranks=2)\n'
            'display(Image(filename=str(folder / "memory.png")))'),
        new_markdown_cell(
            "The memory the simulator counts on each rank over the step, against the device's capacity: the "
            "floor is the workload's static memory (the model's parameters, gradients and optimizer state), and "
            "on top of it the traced program's tensors climb through the forward as activations are saved, peak "
            "around the loss (where the logits are live) and fall through backward as they are freed. The peak "
            "`prediction.format()` prints above is the memory ledger of the training configuration "
            "(communication buffers, CUDA context and allocator reserve included) with this step's peak above its "
            "floor as the activations line (docs/design.md, \"One memory definition\")."),
        new_code_cell(
            "from simulator.plots import plot_memory_by_category\n\n"
            'plot_memory_by_category(result, prediction.lines, folder / "categories.png")\n'
            'display(Image(filename=str(folder / "categories.png")))'),
        new_markdown_cell(
            "The same step per category of the memory ledger (`simulator.plots.memory_by_category`): the "
            "parameters, gradients, optimizer state, communication buffers, runtime (CUDA context, NCCL, "
            "workspaces) and allocator lines held through the step as the ledger counts them inside backward, and "
            "on top the activations the simulated step holds at each moment. The highest top is the predicted "
            "peak. With `memory_plan` options such as `activation_offload=\"on\"` in the prediction "
            "(`predict(..., options=...)`) or optimizer offload in the setup, a second panel shows the host pool: "
            "the offloaded optimizer state and the activations in host memory along the step."),
    ],
    "max_sequence_length.ipynb": [
        new_markdown_cell(
            "# Longest trainable sequence, and where the memory goes\n\n"
            "`autosp.plan.predict` with `max_length=True` (what `python -m autosp.plan --max-length` prints) "
            "searches the longest sequence a model trains with AutoSP on a cluster: each probed length traces "
            "the model's step through the real pass on fake tensors, adds the gradient reduction and the "
            "optimizer step, simulates it, and prices memory with the DeepSpeed ledger of the training "
            "configuration (one memory definition: the ledger inside backward plus the simulated activations). "
            "The ledger's low and high ends give a band; the search says why it stopped (a length at the ceiling "
            "or at the probe budget prints as a lower bound, ≥)."),
        new_markdown_cell(
            YOUR_MODEL + "\n\n`DEPTH` is `\"full\"` by default: every probe traces every layer, which takes "
            "minutes for a paper model on a laptop. `\"extrapolated\"` traces shallow copies of the model and "
            "extrapolates linearly in the depth - much faster, but under activation checkpointing (AutoSP's "
            "default) the shallow graphs checkpoint a different share of each layer, so the memory comes out too "
            "low and the length too long (Note [Depth extrapolation] in `simulator/max_length.py`)."),
        _parameters(
            "# Parameters (a paper model on the paper's hardware, traced at full depth)\n"
            'MODEL = "llama-3.2-3b"  # a preset of python -m autosp.train, or the path of a Hugging Face '
            "config.json\n"
            'CLUSTER = "a100-80gb-sxm"  # a hardware or cluster preset, or a cluster file\n'
            + TRAINING_PARAMETERS.format(sp=8) + "\n"
            "START = 32768  # first length probed (tokens)\n"
            "GRANULARITY = 16384  # the answer is a multiple of this (rounded up to a multiple of SP_SIZE)\n"
            "CEILING = 524288  # search ceiling (tokens): a fit at the ceiling is reported as ≥ CEILING\n"
            "MAX_PROBES = 8  # lengths the search may simulate (one trace each)\n"
            'RESULTS = "results"  # a folder written by python -m experiments.reproduce, if there is one'),
        new_code_cell(SETUP),
        new_code_cell(
            SETUP_FROM_PARAMETERS.format(seq_len="START")
            + "prediction = predict(MODEL, setup, cluster, max_length=True, max_length_high=CEILING,\n"
            "                     granularity=GRANULARITY, max_probes=MAX_PROBES)\n"
            "print(prediction.format())\n"
            "found = prediction.max_length\n"
            "gib = 2**30\n"
            "capacity = prediction.capacity_bytes / gib"),
        new_code_cell(
            "import csv\n\n"
            "# The paper's published lengths (8 x A100-80GB, SP 8), where MODEL is one of its models\n"
            'figures = pathlib.Path("experiments/data/autosp-paper-figures.csv").read_text().splitlines()\n'
            'published = {r["system"]: int(r["value"]) for r in csv.DictReader(ln for ln in figures if ln and ln[0] != "#")\n'
            '             if r["figure"] == "max_seq_len" and r["model"] == MODEL}\n'
            'print(f"published for {MODEL}: " + (", ".join(f"{s} {v:,}" for s, v in published.items()) or "none") +\n'
            '      f"; predicted for AutoSP on {CLUSTER}: {found[\'display\']} tokens")'),
        new_code_cell(
            "import matplotlib.pyplot as plt\n\n"
            'probes = sorted(found["probes"], key=lambda p: p["seq_len"])\n'
            "fig, ax = plt.subplots(figsize=(7, 3.6))\n"
            'ax.plot([p["seq_len"] for p in probes], [p["peak_bytes"] / gib for p in probes], color="gray", lw=0.8)\n'
            "for fits, marker in ((True, \"o\"), (False, \"x\")):\n"
            '    ax.scatter([p["seq_len"] for p in probes if p["fits"] == fits],\n'
            '               [p["peak_bytes"] / gib for p in probes if p["fits"] == fits], marker=marker,\n'
            '               label="fits" if fits else "does not fit")\n'
            'ax.axhline(capacity, color="red", ls="--", lw=0.8, label="device memory")\n'
            'if found["max_seq_len"]:\n'
            '    ax.axvline(found["max_seq_len"], color="black", lw=0.8, label=f"longest: {found[\'display\']}")\n'
            'if "autosp" in published:\n'
            '    ax.axvline(published["autosp"], color="green", ls=":", label="published (AutoSP)")\n'
            'ax.set_xlabel("sequence length (tokens)")\n'
            'ax.set_ylabel("peak per rank (GiB)")\n'
            'ax.set_title(f"{MODEL}, SP {SP_SIZE} x DP {DP_SIZE}, ZeRO {ZERO_STAGE}, on {CLUSTER}")\n'
            "ax.legend(fontsize=7)\n"
            "fig.tight_layout()\n"
            "plt.show()"),
        new_markdown_cell(
            "Each marker is a length the search simulated, at its predicted peak per rank (the ledger plus the "
            "simulated activations); the peak grows with the length because the activations do, and the "
            "longest length that fits is the last one below the red device-memory line (black line). Where "
            "`MODEL` is one of the paper's models the dotted line marks the published AutoSP length, measured "
            "with the paper's own, unpublished DeepSpeed configuration (\"Reading the misses\" below discusses "
            "why predictions under the stated configuration come out longer)."),
        new_markdown_cell(
            "## The ledger at the longest length\n\n"
            "Per-rank peak by category at the first length probed and at the longest that fits: parameters, "
            "gradients and optimizer state as DeepSpeed's optimizer class allocates them, the simulated "
            "activations, communication buffers (ipg buckets, NCCL), the runtime (CUDA context, workspaces) and "
            "the caching allocator (rounding, fragmentation). Each ledger line cites the code it follows "
            "(`simulator/ledger.py`); the band comes from the uncertain device-side items "
            "(`simulator/device_reserve.py`)."),
        new_code_cell(
            'bars = {f"{START:,} tokens": prediction.by_category}\n'
            'if found["peak_by_category_bytes"]:\n'
            '    bars[f"{found[\'max_seq_len\']:,} tokens (longest)"] = found["peak_by_category_bytes"]\n'
            "categories = list(dict.fromkeys(c for b in bars.values() for c in b))\n"
            "for label, by_category in bars.items():\n"
            '    print(label + ": " + ", ".join(f"{c} {b / gib:.2f} GiB" for c, b in by_category.items()))\n'
            "fig, ax = plt.subplots(figsize=(6, 3.6))\n"
            "bottom = [0.0] * len(bars)\n"
            "for category in categories:\n"
            "    values = [b.get(category, 0) / gib for b in bars.values()]\n"
            "    ax.bar(list(bars), values, bottom=bottom, label=category)\n"
            "    bottom = [b + v for b, v in zip(bottom, values, strict=True)]\n"
            'ax.axhline(capacity, color="red", ls="--", lw=0.8)\n'
            'ax.set_ylabel("GiB per rank")\n'
            "ax.legend(fontsize=6)\n"
            "fig.tight_layout()\n"
            "plt.show()"),
        new_markdown_cell(
            "Each bar stacks the per-rank peak by ledger category at one length, against the device memory (red "
            "line): everything but the activations (and the allocator's share of them) stays the same as the "
            "length grows, so the gap between the two bars is what the longer sequence's activations cost, and "
            "the fixed part is what a different ZeRO stage, DP degree or precision would change."),
        new_markdown_cell(
            "## Every published length beside the simulated band\n\n"
            "From a reproduction's results folder (`python -m experiments.reproduce --out results`, every paper "
            "model and system simulated on the paper's hardware): each published maximum length, the simulated "
            "nominal length and band, the signed error and the search's stop reason, the length under the "
            "alternative configuration (fp32 gradient accumulation, `BF16_Optimizer`) and the memory per rank "
            "left free at the published length; then the summary (median absolute error, ordering of systems per "
            "model) and the misses read across models."),
        new_code_cell(
            "import json\n\n"
            "folder = pathlib.Path(RESULTS)\n"
            'if not (folder / "' + MAX_SEQ_LEN_CSV + '").exists():\n'
            '    print(f"no {folder}/' + MAX_SEQ_LEN_CSV + ': python -m experiments.reproduce --out {folder} writes it")\n'
            "else:\n"
            '    for r in csv.DictReader((folder / "' + MAX_SEQ_LEN_CSV + '").open()):\n'
            '        print(f"{r[\'model\']:13s} {r[\'system\']:15s} published {r[\'published_tokens\'] or \'-\':>6s}  "\n'
            '              f"simulated {r[\'simulated_tokens\']:>9s}  band {r[\'band_tokens\']:>19s}  "\n'
            '              f"error {r[\'error_pct\'] or \'-\':>5s} %  ({r[\'stopped\']}); alternative "\n'
            '              f"{r[\'alternative_tokens\']} (error {r[\'alternative_error_pct\'] or \'-\'} %), "\n'
            '              f"free at the published length {r[\'headroom_at_published_gib\'] or \'-\'} GiB")\n'
            '    summary = json.loads((folder / "run.json").read_text()).get("' + MAX_SEQ_LEN.record + '", {})\n'
            '    print(f"median |error| {summary.get(\'median_abs_error_pct\')} %, ordering: {summary.get(\'ordering\')}")\n'
            "    # The misses read across models: fixed memory per rank, or memory per token (Note [Fixed or\n"
            "    # per-token gap] in experiments/reproduction/max_seq_len.py); the smaller spread is the reading the data support.\n"
            '    for system, g in summary.get("gap_shape", {}).items():\n'
            '        print(f"{system}: as fixed GiB/rank {g[\'fixed_gib\']} (CV {g[\'fixed_cv\']}); as bytes per token, "\n'
            '              f"hidden unit and layer {g[\'per_token_hidden_layer_bytes\']} (CV {g[\'per_token_cv\']}); "\n'
            '              f"implied activation multiple {g[\'implied_activation_multiple\']} ({\', \'.join(g[\'models\'])})")'),
        new_markdown_cell(
            "## Reading the misses\n\n"
            "Under the stated configuration (ZeRO-1 without `BF16_Optimizer`, which is what DeepSpeed builds "
            "when nothing sets `grad_accum_dtype`) the sequence-parallel systems keep little fixed memory per "
            "rank: the flat bf16 parameters, an eighth of the fp32 master weights and Adam moments, the ipg "
            "buckets and the device reserve. Their simulated lengths then come out well above the published "
            "ones, while ZeRO-3, whose ranks each hold a whole sequence's activations, lands close. The "
            "alternative configuration adds the unpartitioned fp32 gradient buffer and the bf16 gradients "
            "`BF16_Optimizer` keeps until the step; where its length is close to the published one, the miss is "
            "explained by that buffer, and the stated configuration is the assumption to revisit. "
            "In our runs no single item explains every miss: the free memory at the published lengths is about "
            "the same for every sequence-parallel system of one model but does not grow with the parameter "
            "count the way those buffers do, so the alternative over-corrects the larger models and "
            "under-corrects the smallest. Where ZeRO-3 misses, it misses the other way: its simulated peak (a "
            "whole sequence's activations per rank on top of the ledger) exceeds the capacity before the "
            "published length. "
            "The last lines of the cell read the misses across models both ways: as a fixed amount per rank and "
            "as bytes per token, hidden unit and layer. Where the second spreads far less than the first, the "
            "missing memory behaves like activations, not like a buffer, and no ledger item can name it: what "
            "the real runs held beyond the traced graphs' activations (higher-precision copies, buffers of the "
            "hand-written attention, allocator fragmentation on the GPU) needs a measured step on the paper's "
            "hardware to attribute. "
            "Items the ledger does not hold at all are listed in `simulator/ledger.py` and "
            "`simulator/device_reserve.py` (the published figures are also read off a plot at the resolution of "
            "its bars)."),
        new_markdown_cell(
            "## Against runs whose whole configuration is published\n\n"
            "The paper's configuration is not published, so its misses cannot tell a ledger error from a "
            "different setting. Runs whose model, hardware, parallelism, checkpointing and batch are all "
            "published can: `python -m experiments.reproduce --only external-fidelity` simulates the per-GPU "
            "memory of Llama-3.1-8B runs published by torchtitan, Trainy and torchao, nothing fitted "
            "(`experiments/paper_scale/external_fidelity.py` gives the provenance of every figure and of every "
            "configuration item)."),
        new_code_cell(
            'if not (folder / "external-fidelity.csv").exists():\n'
            '    print(f"no {folder}/external-fidelity.csv: python -m experiments.reproduce --only external-fidelity "\n'
            '          f"--out {folder} writes it")\n'
            "else:\n"
            '    for r in csv.DictReader((folder / "external-fidelity.csv").open()):\n'
            '        print(f"{r[\'source\']:22s} {r[\'figure\']:45s} published {float(r[\'published\']):6.2f} GiB  "\n'
            '              f"simulated {float(r[\'simulated\']):6.2f} GiB  error {r[\'error\']} %")'),
        new_markdown_cell(
            "Source by source the misses sit in one ledger line. The static lines hold where a pair of runs "
            "isolates them: torchtitan's runs on one node and on sixteen differ only in how far the FSDP state "
            "is sharded, and the simulated difference is within about a gibibyte of the published one. What "
            "differs is the activations line: torchtitan's selective checkpointing policy has no equal here and "
            "is stood in for by this project's SAC. torchao measured one configuration on three kinds of GPU, "
            "each under its own torch version, and its figures spread wider than any static line could move, so "
            "that miss is the measurements' own spread."),
    ],
}


def with_parameters(nb, **values):
    """A copy of ``nb`` with a cell after its parameter cell (tagged ``parameters``) that sets ``values`` (Python
    literals): what ``papermill -p NAME VALUE`` does, for nbclient.  Unknown names are refused."""
    nb = copy.deepcopy(nb)
    at = next(i for i, c in enumerate(nb.cells) if PARAMETERS_TAG in c.get("metadata", {}).get("tags", ()))
    known = {}
    exec(nb.cells[at].source, {}, known)  # noqa: S102 - the notebook's own parameter cell: literals only
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{unknown} are not parameters of this notebook ({', '.join(known)})")
    source = "# Injected parameters\n" + "\n".join(f"{name} = {value!r}" for name, value in values.items())
    nb.cells.insert(at + 1, new_code_cell(source, metadata={"tags": ["injected-parameters"]}))
    return nb


def build(folder: pathlib.Path = HERE) -> list[pathlib.Path]:
    paths = []
    for name, cells in NOTEBOOKS.items():
        cells = copy.deepcopy(cells)
        for i, cell in enumerate(cells):  # stable ids: a rebuild changes only the cells edited here
            cell.id = f"{pathlib.Path(name).stem}-{i}"
        nb = new_notebook(cells=cells, metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"},
        })
        nbformat.validate(nb)
        path = folder / name
        nbformat.write(nb, path)
        paths.append(path)
    return paths


def build_parser():
    from experiments import cli

    parser = cli.parser("experiments.notebooks.build", "Write the notebooks of experiments/notebooks from the cells "
                        "defined in experiments/notebooks/build.py (stored without outputs).")
    parser.add_argument("--out", type=pathlib.Path, default=HERE,
                        help="folder to write the notebooks into (default: experiments/notebooks, i.e. rewrite the "
                             "tracked notebooks from the cells in experiments/notebooks/build.py)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in build(args.out):
        print(f"wrote {path}")  # noqa: T201 - the command's output
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
