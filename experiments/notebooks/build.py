"""Write the notebooks of this folder from the cells below (``python -m experiments.notebooks.build``).

The notebooks are thin: parameters in the first code cell, then calls into
`experiments` and `simulator`, then a plot.  They are stored without outputs;
``tests/experiments/test_notebooks.py`` executes each one.  Edit the cells here
and rebuild rather than editing the ``.ipynb`` files by hand.
"""

from __future__ import annotations

import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = pathlib.Path(__file__).resolve().parent

SETUP = """\
import os
import pathlib
import sys

# Run from the repository root whatever the notebook's working folder (experiments/notebooks).
root = next(p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "experiments").is_dir())
os.chdir(root)
sys.path.insert(0, str(root))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / ".torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")"""

NOTEBOOKS = {
    "equivalence_and_overhead.ipynb": [
        new_markdown_cell(
            "# Equivalence and overhead on CPU gloo ranks\n\n"
            "Each system trains one step of a small Hugging Face Llama on real gloo ranks; its loss and gradients "
            "are compared with single-device training of the full sequence, and its median step time with "
            "hand-written Ulysses. `python -m experiments.reproduce --only measured-cpu` runs the full-size "
            "version of this table."),
        new_code_cell("# Parameters (small: the notebook runs in well under a minute)\n"
                      "RANKS = 2\nSEQ_LEN = 128\nSTEPS = 2\n"
                      'SYSTEMS = ["autosp", "autosp-nosac", "ulysses", "ring"]'),
        new_code_cell(SETUP),
        new_code_cell(
            "from experiments.cpu.measure import measure_on_rank\n"
            "from experiments.launch import run_on_ranks\n"
            "from experiments.reproduce import CPU_MODEL, CPU_MODEL_OPTIONS\n\n"
            'spec = {"model": CPU_MODEL, "model_options": CPU_MODEL_OPTIONS, "seq_len": SEQ_LEN,\n'
            '        "systems": SYSTEMS, "steps": STEPS}\n'
            "per_rank = run_on_ranks(measure_on_rank, RANKS, spec, timeout_s=600, collective_timeout_s=300)\n"
            'results = {s: [r["systems"][s] for r in per_rank] for s in SYSTEMS}\n'
            'ulysses_s = max(r["median_step_s"] for r in results["ulysses"])\n'
            "for s, rs in results.items():\n"
            '    print(f"{s:14s} loss error {max(r[\'loss_error\'] for r in rs):.1e}  "\n'
            '          f"grad error {max(r[\'grad_max_rel_error\'] for r in rs):.1e}  "\n'
            '          f"step / ulysses {max(r[\'median_step_s\'] for r in rs) / ulysses_s:.2f}")'),
        new_code_cell(
            "import matplotlib.pyplot as plt\n\n"
            "fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))\n"
            'ax1.bar(SYSTEMS, [max(max(r["grad_max_rel_error"] for r in results[s]), 1e-12) for s in SYSTEMS])\n'
            'ax1.set_yscale("log")\n'
            'ax1.set_ylabel("max relative gradient error")\n'
            'ax2.bar(SYSTEMS, [max(r["median_step_s"] for r in results[s]) / ulysses_s for s in SYSTEMS])\n'
            'ax2.axhline(1, color="black", lw=0.8)\n'
            'ax2.set_ylabel("step time / Ulysses")\n'
            "for ax in (ax1, ax2):\n"
            '    ax.tick_params(axis="x", labelsize=7)\n'
            'fig.suptitle(f"{RANKS} gloo ranks, {SEQ_LEN} tokens")\n'
            "fig.tight_layout()\n"
            "plt.show()"),
    ],
    "simulated_timeline.ipynb": [
        new_markdown_cell(
            "# A simulated AutoSP step\n\n"
            "Traces a paper model's training step through the AutoSP pass on a fake process group (no real "
            "memory or GPU), exports the collective schedule and simulates it on a cluster preset: compute and "
            "communication streams per rank, then memory over time. `python -m experiments.reproduce` writes "
            "the same plots (and a Perfetto trace) for its iteration-time model (`--iteration-model`)."),
        new_code_cell("# Parameters (small: a few seconds of tracing)\n"
                      'MODEL = "llama-3.2-3b"\nSEQ_LEN = 4096\nLAYERS = 1\nSP_SIZE = 8\nCLUSTER = "a100-80gb-sxm"'),
        new_code_cell(SETUP),
        new_code_cell(
            "import tempfile\n\n"
            "from IPython.display import Image, display\n\n"
            "from experiments.models import PAPER_MODELS\n"
            "from experiments.paper_scale.simulate import _simulate_layers\n"
            "from simulator import Cluster, simulate\n"
            "from simulator.plots import plot_memory, plot_timeline\n\n"
            "cluster = Cluster.from_preset(CLUSTER)\n"
            "_, _, workload = _simulate_layers(PAPER_MODELS[MODEL], SEQ_LEN, LAYERS, SP_SIZE, cluster, SP_SIZE)\n"
            "result = simulate(workload, cluster)\n"
            'print(f"step {result.step_time_s * 1e3:.1f} ms, peak {result.ranks[0].peak_memory_bytes / 2**30:.2f} GiB")'),
        new_code_cell(
            "folder = pathlib.Path(tempfile.mkdtemp())\n"
            'plot_timeline(result, folder / "timeline.png", max_ranks=2)\n'
            'plot_memory(result, folder / "memory.png", max_ranks=2)\n'
            'display(Image(filename=str(folder / "timeline.png")), Image(filename=str(folder / "memory.png")))'),
    ],
    "max_sequence_length.ipynb": [
        new_markdown_cell(
            "# Longest trainable sequence\n\n"
            "The simulated AutoSP maximum sequence length of one paper model on a node of A100-80GB GPUs (a "
            "coarse bisection up to the search ceiling set in the parameters: each probe traces the model "
            "through the real pass and simulates it; a length at the ceiling prints as a lower bound, ≥), "
            "beside the published figures of all four systems. `python -m experiments.reproduce --only "
            "max-seq-len` searches every model for all four systems at a finer granularity (its `--help` "
            "lists the settings): the baselines are simulated as rewrites of graphs the real compiler produces "
            "(Ulysses: AutoSP's graph without checkpointing; ring attention: that graph with each attention "
            "split into peer-to-peer ring steps; ZeRO-3: the single-device graph with per-layer parameter "
            "gathers and gradient reduce-scatters; see `experiments/paper_scale/workload_rewrites.py`)."),
        new_code_cell("# Parameters (coarse: a handful of simulated probes)\n"
                      'MODEL = "llama-3.2-3b"\nSP_SIZE = 8\nGRANULARITY = 16384\n'
                      "CEILING = 262144  # search ceiling (tokens): a fit at the ceiling is reported as ≥ CEILING\n"
                      'RESULTS = "results"  # a folder written by python -m experiments.reproduce, if there is one'),
        new_code_cell(SETUP),
        new_code_cell(
            "from experiments.paper_scale.simulate import max_trainable_seq_len\n"
            "from experiments.reproduce import SYSTEMS, published_figures\n\n"
            "simulated = max_trainable_seq_len(MODEL, sp_size=SP_SIZE, granularity=GRANULARITY, high=CEILING)\n"
            'published = {r["system"]: float(r["value"]) for r in published_figures()\n'
            '             if r["figure"] == "max_seq_len" and r["model"] == MODEL}\n'
            'print(f"simulated AutoSP on {SP_SIZE}×A100-80GB: {simulated} tokens (granularity {GRANULARITY}, "\n'
            '      f"search ceiling {simulated.upper_bound})")\n'
            'print(f"published: {published}")'),
        new_code_cell(
            "import matplotlib.pyplot as plt\n\n"
            "fig, ax = plt.subplots(figsize=(6, 3.2))\n"
            'ax.bar([f"{s}\\n(published)" for s in SYSTEMS], [published[s] for s in SYSTEMS])\n'
            'label = "autosp\\n(simulated, ≥)" if simulated.hit_upper_bound else "autosp\\n(simulated)"\n'
            'ax.bar([label], [simulated.max_seq_len], hatch="//", color="white", edgecolor="black")\n'
            'ax.set_ylabel("max trainable sequence (tokens)")\n'
            'ax.set_title(f"{MODEL}, {SP_SIZE}×A100-80GB")\n'
            'ax.tick_params(axis="x", labelsize=7)\n'
            "fig.tight_layout()\n"
            "plt.show()"),
        new_code_cell(
            "# The full reproduction beside the paper, from its results folder (if there is one)\n"
            "import csv\n\n"
            "import torch\n\n"
            "from experiments.reproduce import DISAGREEMENT\n\n"
            "\n"
            "def number(text):\n"
            "    try:\n"
            "        return float(text)\n"
            "    except ValueError:\n"
            "        return None  # empty, or OOM\n"
            "\n"
            "\n"
            'print(f"flagged: simulated more than {DISAGREEMENT:.0%} away from published; torch {torch.__version__}")\n'
            'folder = pathlib.Path(RESULTS)\n'
            'if not (folder / "max-seq-len.csv").exists():\n'
            '    print(f"no {folder}/max-seq-len.csv: python -m experiments.reproduce --out {folder} writes it")\n'
            "else:\n"
            '    rows = list(csv.DictReader((folder / "max-seq-len.csv").open()))\n'
            "    ratios = {}\n"
            "    for r in rows:\n"
            '        if number(r["simulated_over_published"]) is not None:\n'
            '            ratios.setdefault(r["system"], []).append(number(r["simulated_over_published"]))\n'
            "    for system, values in ratios.items():\n"
            '        print(f"{system:15s} simulated / published: {min(values):.2f} to {max(values):.2f}")\n'
            '    by = {(r["model"], r["system"]): r for r in rows}\n'
            '    for model in sorted({r["model"] for r in rows}):\n'
            '        autosp, ulysses = by.get((model, "autosp")), by.get((model, "ulysses"))\n'
            "        pairs = [(number(autosp[k]), number(ulysses[k])) for k in (\"simulated_tokens\", \"published_tokens\")\n"
            "                 ] if autosp and ulysses else []\n"
            "        if pairs and all(a and u for a, u in pairs):\n"
            '            print(f"{model}: AutoSP / Ulysses simulated {pairs[0][0] / pairs[0][1]:.1f}, "\n'
            '                  f"published {pairs[1][0] / pairs[1][1]:.1f}")\n'
            'if (folder / "iteration-time.csv").exists():\n'
            '    for r in csv.DictReader((folder / "iteration-time.csv").open()):\n'
            '        published_s, simulated_s = number(r["published_s"]), number(r["simulated_s"])\n'
            "        if published_s and simulated_s:\n"
            '            print(f"iteration {r[\'system\']} at {r[\'seq_len\']} tokens: published / simulated "\n'
            '                  f"{published_s / simulated_s:.0f}×")'),
        new_markdown_cell(
            "## Why the simulated lengths are longer than the published ones\n\n"
            "The reproduction flags every simulated maximum length further from the paper's than the "
            "threshold printed above, and the cell above prints, from a reproduction's results folder, how far "
            "each system's simulated lengths are from the published ones and the AutoSP/Ulysses ratio in "
            "both. In our runs the three sequence-parallel systems (AutoSP, hand-written Ulysses, ring "
            "attention) were simulated at several times their published lengths while their *ratios* stayed "
            "close to the paper's; ZeRO-3's simulated lengths were close to its published ones: without "
            "sequence parallelism each rank holds a whole sequence's activations, which dwarf the memory "
            "listed below. What the simulator leaves out is memory that does not scale with the program's "
            "tensors or that the exported schedule does not contain:\n\n"
            "- the CUDA context, NCCL buffers and cuBLAS/attention workspaces (gigabytes per GPU);\n"
            "- the caching allocator's reserved-but-unused blocks and fragmentation (the simulator frees "
            "a tensor's bytes exactly at its last use and never rounds sizes);\n"
            "- anything the paper's training loop keeps beyond one step of the model: its data loader, "
            "logits kept for logging, fp32 copies made outside the compiled graph, gradient-accumulation "
            "buffers, and the partitioner choices of the PyTorch release the paper used (the simulation uses "
            "this project's graphs on the torch printed above);\n"
            "- the published figures are read off a plot at the resolution of its bars.\n\n"
            "So read the simulated numbers as an upper bound from the program's own tensors, and compare "
            "systems by their ratio. The simulated iteration time is likewise one sequence's step; the "
            "published iteration is many times longer (the cell above prints by how much), which fits an "
            "iteration of many sequences (its batch size is not given with the figure)."),
    ],
}


def build(folder: pathlib.Path = HERE) -> list[pathlib.Path]:
    paths = []
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(cells=cells, metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"},
        })
        nbformat.validate(nb)
        path = folder / name
        nbformat.write(nb, path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    build()
