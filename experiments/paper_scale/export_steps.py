"""Export whole paper-scale training steps as workload JSON files, for ``python -m simulator --max-length DIR``.

Each file is one system's whole step (the traced forward and backward on fake tensors, the ring or ZeRO-3
rewrite where its `simulator.strategies.WorkloadRecipe` says so, DeepSpeed's gradient reduction and optimizer
step: exactly what `experiments.paper_scale.simulate.step_workload` simulates) for one paper model at one length and one traced
depth, with `simulator.max_length.step_metadata` saying which model, system, length, depth and training
configuration it is.  The simulator then finds the longest of the exported lengths that fits, with the ledger's
band, without torch::

    python -m experiments.paper_scale.export_steps --model llama-3.1-8b --systems autosp ulysses \\
        --lengths 16384 32768 65536 131072 --out steps/
    python -m simulator --max-length steps/ --cluster a100-80gb-sxm

``--layers extrapolated`` exports one- and two-layer steps instead of the full depth (fast; the simulator then
extrapolates in the depth and says so: too low under checkpointing, Note [Depth extrapolation] in
simulator/max_length.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from experiments.models import PAPER_MODELS
from experiments.paper_scale.config import PAPER_CONFIG, PaperConfig, training_config
from experiments.paper_scale.simulate import LAYER_MODES, TraceCache, simulated_strategy, step_workload
from simulator.max_length import step_metadata
from simulator.strategies import STRATEGIES

log = logging.getLogger(__name__)


def export_steps(model_name: str, systems: tuple[str, ...], lengths: tuple[int, ...], out: Path, *,
                 layers: str = "full", ranks: int = 8, config: PaperConfig = PAPER_CONFIG,
                 cache: TraceCache | None = None, progress: bool = False) -> list[Path]:
    """Write one whole-step workload per system, length and traced depth into ``out``; returns the paths."""
    if model_name not in PAPER_MODELS:
        raise ValueError(f"unknown paper model {model_name!r}; choose one of {sorted(PAPER_MODELS)}")
    for system in systems:
        simulated_strategy(system)  # an unknown name, or one never simulated, is refused with the valid ones
    if layers not in LAYER_MODES:
        raise ValueError(f"layers={layers!r}: choose one of {LAYER_MODES}")
    model = PAPER_MODELS[model_name]
    depths = (model.num_layers,) if layers == "full" else (1, 2)
    # From the fifth length on, the length-invariant systems are interpolated (Note [One trace per length class]
    # in experiments/paper_scale/simulate.py).
    cache = cache if cache is not None else TraceCache(interpolate_lengths=True)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(system, length, depth) for system in systems for length in lengths for depth in depths]
    written = []
    for system, length, depth in tqdm(jobs, desc="export", file=sys.stderr, disable=not progress):
        workload = step_workload(system, model, length, depth, ranks=ranks, cache=cache,
                                 config=replace(config, world_size=ranks))
        meta = step_metadata(model=model_name, system=system, seq_len=length, layers=depth,
                             model_layers=model.num_layers,
                             config=training_config(model, system, replace(config, world_size=ranks)))
        workload = replace(workload, metadata={**workload.metadata, **meta})
        path = out / f"{model_name}__{system.replace('+', '-')}__L{depth}__S{length}.json"
        workload.to_json(path)
        written.append(path)
        log.info("wrote %s", path)
    return written


def build_parser() -> argparse.ArgumentParser:
    from experiments import cli

    parser = cli.parser("experiments.paper_scale.export_steps", __doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(PAPER_MODELS), help="paper model")
    systems = STRATEGIES.table("paper-scale")
    parser.add_argument("--systems", nargs="+", default=list(systems), choices=systems, metavar="SYSTEM",
                        help=f"systems to export: {', '.join(systems)}")
    parser.add_argument("--lengths", nargs="+", type=int, required=True, metavar="TOKENS", help="sequence lengths")
    parser.add_argument("--layers", default="full", choices=LAYER_MODES,
                        help="trace at the full depth, or at one and two layers")
    parser.add_argument("--ranks", type=int, default=8, help="GPUs")
    parser.add_argument("--out", type=Path, required=True, help="directory for the workload JSON files")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.lengths) < 1 or args.ranks < 1:
        parser.error("--lengths and --ranks must be positive")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    paths = export_steps(args.model, tuple(args.systems), tuple(args.lengths), args.out, layers=args.layers,
                         ranks=args.ranks, progress=True)
    print(f"wrote {len(paths)} workloads to {args.out}; next: python -m simulator --max-length {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
