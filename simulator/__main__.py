"""Command line: simulate a workload JSON on a hardware preset and write result.json, trace.json and PNG plots.

Run ``python -m simulator --help``. Exit status 0 on success (also when the workload runs out of memory: that is a
result, reported in result.json and on stdout), 2 on a usage or input error with a message saying what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from simulator.cluster import Cluster
from simulator.cluster_presets import CLUSTER_PRESETS
from simulator.collectives import ALL_TO_ALL_ALGORITHMS
from simulator.engine import simulate
from simulator.hardware import NETWORKS, get_preset, preset_names
from simulator.max_length import DevicePeak, device_peak
from simulator.workload import Workload, WorkloadError

log = logging.getLogger("simulator")

EPILOG = """\
outputs (in --out):
  result.json    step time, per-stream busy time, exposed communication, overlap, the printed peak memory
                 (peak_memory_bytes; the engine's own count: program_peak_memory_bytes), OOM per rank
  trace.json     Perfetto / Chrome trace (open at https://ui.perfetto.dev): one process per simulated rank,
                 one thread per stream, a memory counter track
  timeline.png   per-stream timeline;  memory.png  memory over time, with the printed peak (skipped with --no-plots)
  sensitivity.json  with --sensitivity: the static-memory ledger and how the longest trainable sequence moves
                 when each uncertain memory constant moves within its band; on a GPU preset also how the step
                 time and the longest sequence move with each efficiency and latency constant
                 (simulator.gpu_constants), each re-simulated at the low and high end of its band

with --max-length DIR (instead of a workload): the longest trainable sequence of every model and system whose
whole steps were exported into DIR (python -m experiments.paper_scale.export_steps), each step's static memory
from the memory ledger of the training configuration it was exported with, with the ledger's low-high band;
printed as a table, written to --out/max_length.json when --out is given.

example:
  python -m simulator workload.json --cluster a100-80gb-sxm --nodes 2 --out runs/a100x16
  python -m simulator workload.json --cluster h100-sxm-4x8 --all-to-all hierarchical --out runs/h100x32
  python -m simulator --max-length steps/ --cluster a100-80gb-sxm
  python -m simulator workload.json --out runs/s --sensitivity --params 8.03e9 --zero-stage 1 --dp 8
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m simulator",
        description="Simulate one training step of an exported collective schedule (a simulator.Workload JSON) "
                    "on a cluster built from a hardware preset.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("workload", nargs="?", type=Path, help="workload JSON written by Workload.to_json")
    parser.add_argument("--cluster", default="a100-80gb-sxm", choices=(*preset_names(), *CLUSTER_PRESETS),
                        metavar="PRESET",
                        help=f"hardware preset: {', '.join(preset_names())}, or a multi-node cluster preset: "
                             f"{', '.join(CLUSTER_PRESETS)} (default: %(default)s)")
    parser.add_argument("--all-to-all", default=None, choices=ALL_TO_ALL_ALGORITHMS,
                        help="all-to-all algorithm (default: the cluster preset's, else pairwise)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="number of nodes (default: just enough for the workload's world size)")
    parser.add_argument("--devices-per-node", type=int, default=None, help="override the preset's devices per node")
    parser.add_argument("--network", default=None, choices=tuple(NETWORKS),
                        help="inter-node network (default: the hardware preset's)")
    parser.add_argument("--memory-gib", type=float, default=None, help="override device memory capacity (GiB)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory, created if missing (default: none, print the result only)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    parser.add_argument("--no-collapse", action="store_true", help="simulate every rank even when symmetric")
    parser.add_argument("--include-ops", action="store_true", help="add every simulated op's times to result.json")
    parser.add_argument("--list-clusters", action="store_true", help="list hardware presets and exit")
    parser.add_argument("--max-length", type=Path, default=None, metavar="DIR",
                        help="longest trainable sequence from the whole-step workloads exported into DIR (below)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sens = parser.add_argument_group("sensitivity (static memory from the DeepSpeed ledger, simulator.ledger)")
    sens.add_argument("--sensitivity", action="store_true",
                      help="how the longest trainable sequence (and, on GPU presets, the step time) moves with "
                           "each uncertain memory, efficiency and latency constant")
    sens.add_argument("--params", type=float, help="trainable parameters of the full model (e.g. 8.03e9)")
    sens.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage (default: %(default)s)")
    sens.add_argument("--dp", type=int, default=None, help="ranks ZeRO partitions over (default: world size)")
    sens.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"),
                      help="training precision (default: %(default)s)")
    sens.add_argument("--grad-accum-dtype", default=None, choices=("bf16", "fp16", "fp32"),
                      help="DeepSpeed's data_types.grad_accum_dtype (default: unset, as DeepSpeed leaves it)")
    sens.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd", "sgd_momentum"),
                      help="optimizer whose state the ledger counts (default: %(default)s)")
    sens.add_argument("--seq-len", type=int, default=None, help="the workload's tokens (default: its metadata)")
    sens.add_argument("--granularity", type=int, default=1024, help="length grid (default: %(default)s)")
    return parser


def _list_clusters() -> None:
    for name in preset_names():
        preset = get_preset(name)
        dev = preset.device
        print(f"{name:16s} {preset.devices_per_node} x {dev.name}: {dev.peak_flops_per_s / 1e12:.1f} TFLOP/s, "
              f"{dev.memory_bandwidth_bytes_per_s / 1e9:.0f} GB/s, {dev.memory_bytes / 2**30:.0f} GiB; "
              f"{preset.intra_node_kind} {preset.intra_node.bandwidth_bytes_per_s / 1e9:.0f} GB/s per direction"
              f"{'' if preset.network is None else ', network ' + preset.network.name}"
              f"{' (calibrated)' if preset.calibrated else ''}")
    for name, spec in CLUSTER_PRESETS.items():
        print(f"{name:16s} {spec.nodes} nodes of {spec.node}, network {spec.network}, {spec.all_to_all} all-to-all")


def _cluster_spec(args: argparse.Namespace) -> tuple[str, int | None, str | None, str]:
    """(node preset, nodes, network, all-to-all algorithm) of ``--cluster``, the other flags taking precedence."""
    spec = CLUSTER_PRESETS.get(args.cluster)
    if spec is None:
        return args.cluster, args.nodes, args.network, args.all_to_all or "pairwise"
    return (spec.node, spec.nodes if args.nodes is None else args.nodes, args.network or spec.network,
            args.all_to_all or spec.all_to_all)


def _cluster_for(args: argparse.Namespace, world_size: int) -> Cluster:
    node, nodes, network, all_to_all = _cluster_spec(args)
    preset = get_preset(node)
    if args.memory_gib is not None:
        if args.memory_gib <= 0:
            raise ValueError("--memory-gib must be positive")
        preset = dataclasses.replace(preset, device=dataclasses.replace(
            preset.device, memory_bytes=int(args.memory_gib * 2**30)))
    per_node = args.devices_per_node or preset.devices_per_node
    nodes = nodes if nodes is not None else max(1, -(-world_size // per_node))
    return Cluster.from_preset(preset, nodes=nodes, devices_per_node=per_node, network=network,
                               all_to_all=all_to_all)


def _max_length(args: argparse.Namespace) -> int:
    import json

    from simulator.max_length import format_table, max_length_table, steps_from_workloads

    if not args.max_length.is_dir():
        raise ValueError(f"--max-length {args.max_length}: not a directory of exported workload JSON files")
    paths = sorted(args.max_length.glob("*.json"))
    if not paths:
        raise ValueError(f"{args.max_length} holds no *.json workloads; export some with "
                         "python -m experiments.paper_scale.export_steps")
    groups = steps_from_workloads(paths)

    def simulate_dynamic(path: Path) -> tuple[float, int]:
        workload = Workload.from_json(path)
        cluster = _cluster_for(args, workload.world_size)
        result = simulate(workload, cluster, collapse_symmetric=not args.no_collapse)
        return result.step_time_s, result.activation_peak_bytes

    capacity = int(_cluster_for(args, 1).device.memory_bytes)
    rows = max_length_table(groups, simulate_dynamic, capacity_bytes=capacity, progress=log.info)
    print(format_table(rows, capacity))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = [{"model": r.model, "system": r.system, "capacity_bytes": capacity,
                "static_memory_bytes": r.static_memory_bytes, "nominal": r.found.nominal.to_dict(),
                "low_memory": r.found.low_memory.to_dict(), "high_memory": r.found.high_memory.to_dict(),
                "next_length": r.next_length, "interpolated_crossing": r.crossing(capacity),
                "depth_extrapolated": r.extrapolated} for r in rows]
        (args.out / "max_length.json").write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {args.out / 'max_length.json'}")
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.max_length is not None:
        return _max_length(args)
    if args.workload is None or args.out is None:
        raise ValueError("give a workload JSON and --out DIR (or --list-clusters); see --help")
    if not args.workload.is_file():
        raise ValueError(f"workload file {args.workload} does not exist; pass the path of a Workload.to_json file")
    workload = Workload.from_json(args.workload)
    cluster = _cluster_for(args, workload.world_size)
    preset, nodes = cluster.preset, cluster.nodes
    result = simulate(workload, cluster, collapse_symmetric=not args.no_collapse)
    peak = device_peak(workload, result)
    args.out.mkdir(parents=True, exist_ok=True)
    _write_outputs(args, result, peak)
    overlap = result.overlap_fraction
    print(f"{workload.name} on {nodes} x {cluster.devices_per_node} {preset.name}")
    print(f"  step time        {result.step_time_s * 1e3:.3f} ms")
    print(f"  exposed comm     {result.exposed_comm_s * 1e3:.3f} ms"
          f"{'' if overlap is None else f' (overlap {overlap:.1%})'}")
    _print_memory(result, peak, cluster)
    if args.sensitivity:
        _sensitivity(args, workload, result, cluster, nodes)
    print(f"  wrote            {args.out}")
    return 0


def _write_outputs(args: argparse.Namespace, result, peak: DevicePeak) -> None:
    """result.json, trace.json and (unless --no-plots) the PNGs into --out, each with ``peak``."""
    import json

    from simulator.trace import write_chrome_trace

    doc = {**result.to_dict(include_ops=args.include_ops), **peak.to_dict()}
    (args.out / "result.json").write_text(json.dumps(doc, indent=1))
    write_chrome_trace(result, args.out / "trace.json", peak.to_dict())
    if args.no_plots:
        return
    from simulator.plots import plot_memory, plot_memory_by_category, plot_timeline

    plot_timeline(result, args.out / "timeline.png")
    if peak.lines:  # the ledger's categories, activations along the step: the stack's top peaks at peak_bytes
        plot_memory_by_category(result, peak.lines, args.out / "memory.png")
    else:  # the engine's count, whose peak is peak_bytes
        plot_memory(result, args.out / "memory.png")


def _print_memory(result, peak: DevicePeak, cluster: Cluster) -> None:
    """``peak``: with the one definition of --max-length and python -m autosp.plan (the ledger of the workload's
    training configuration inside backward, device reserve included, plus the simulated activations) when the
    workload names its configuration; else the engine's count, saying what it leaves out."""
    capacity = cluster.device.memory_bytes
    if result.host_peak_memory_bytes:  # offloaded tensors (Note [Host tensors] in simulator/workload_types.py)
        host_cap = cluster.host_memory_per_rank_bytes
        print(f"  host memory      {result.host_peak_memory_bytes / 2**30:.2f} GiB of offloaded tensors per rank, of "
              f"{'unknown' if host_cap is None else f'{host_cap / 2**30:.2f} GiB'}")
    if peak.lines:
        print(f"  peak memory      {peak.peak_bytes / 2**30:.2f} GiB of {capacity / 2**30:.2f} (the memory ledger of "
              f"the workload's training configuration, device reserve included, plus "
              f"{peak.activation_bytes / 2**30:.2f} GiB of simulated activations)")
        print(f"  fits             {'yes' if peak.fits else 'NO'}")
        return
    print(f"  peak memory      {peak.peak_bytes / 2**30:.2f} GiB of {capacity / 2**30:.2f} (the program's "
          "tensors plus the workload's static memory only)")
    print(f"  fits             {'yes' if peak.fits else 'NO: ' + result.oom.message()} - without the device "
          "reserve (CUDA context, NCCL buffers, workspaces, allocator rounding and fragmentation) and the ledger's "
          "DeepSpeed buffers that --max-length and python -m autosp.plan count: the workload's metadata names no "
          "training_config (simulator.max_length.step_metadata)")


def _sensitivity(args: argparse.Namespace, workload: Workload, result, cluster: Cluster, nodes: int) -> None:
    import json

    from simulator.ledger import TrainingConfig, memory_ledger
    from simulator.sensitivity import format_sensitivity, format_timing_sensitivity, length_sensitivity

    if args.params is None or args.params < 1:
        raise ValueError("--sensitivity needs --params (the full model's trainable parameter count)")
    seq_len = args.seq_len or workload.metadata.get("seq_len")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError("--sensitivity needs the workload's sequence length: pass --seq-len")
    cfg = TrainingConfig.from_parameter_count(int(args.params), zero_stage=args.zero_stage,
                                              dp_world_size=args.dp or workload.world_size,
                                              precision=args.precision, grad_accum_dtype=args.grad_accum_dtype,
                                              optimizer=args.optimizer)
    activations = result.activation_peak_bytes
    rows = length_sensitivity(cfg, seq_len=seq_len, activation_bytes=activations,
                              capacity_bytes=int(cluster.device.memory_bytes), granularity=args.granularity)
    print(f"  sensitivity      {cfg.wrapper}, ZeRO {cfg.zero_stage} over {cfg.dp_world_size} ranks; "
          f"activations {activations / 2**30:.2f} GiB at {seq_len:,} tokens, scaled linearly")
    print("\n".join("    " + line for line in format_sensitivity(rows).splitlines()))
    ledger = memory_ledger(cfg, at="backward")
    doc = {"config": dataclasses.asdict(cfg) | {"wrapper": cfg.wrapper}, "seq_len": seq_len,
           "activation_bytes": activations, "rows": [dataclasses.asdict(r) for r in rows],
           "ledger": [dataclasses.asdict(line) for line in ledger], "timing_rows": []}
    preset = cluster.preset
    if preset.architecture:
        timing = _timing_sensitivity(args, workload, cluster, nodes, cfg, seq_len)
        print(f"  GPU constants    {preset.name}: step time and longest sequence with each constant at the ends "
              "of its band (* = assumption; see simulator/gpu_constants.py)")
        print("\n".join("    " + line for line in format_timing_sensitivity(timing).splitlines()))
        doc["timing_rows"] = [dataclasses.asdict(r) for r in timing]
    (args.out / "sensitivity.json").write_text(json.dumps(doc, indent=1))


def _timing_sensitivity(args: argparse.Namespace, workload: Workload, cluster: Cluster, nodes: int, cfg,
                        seq_len: int) -> list:
    from simulator.gpu_constants import constants_for
    from simulator.hardware import build_network, build_preset
    from simulator.sensitivity import timing_sensitivity

    preset = cluster.preset
    memory_bytes = cluster.device.memory_bytes
    network = _cluster_spec(args)[2]

    def simulate_with(table) -> tuple[float, int]:
        rebuilt = build_preset(preset.name, table)
        rebuilt = dataclasses.replace(rebuilt, device=dataclasses.replace(rebuilt.device, memory_bytes=memory_bytes))
        moved = Cluster.from_preset(rebuilt, nodes=nodes, devices_per_node=cluster.devices_per_node,
                                    network=None if network is None else build_network(network, table),
                                    all_to_all=cluster.all_to_all)
        res = simulate(workload, moved, collapse_symmetric=not args.no_collapse)
        return res.step_time_s, res.activation_peak_bytes

    fabric = "nvlink" if preset.intra_node_kind == "nvswitch" else preset.intra_node_kind
    rails = nodes > 1 and cluster.network is not None and cluster.network.rail_optimized
    return timing_sensitivity(cfg, constants=constants_for(preset.architecture, fabric, rail_optimized=rails,
                                                               host=preset.host_memory_kind or "pcie"),
                              simulate_with=simulate_with,
                              seq_len=seq_len, capacity_bytes=int(memory_bytes), granularity=args.granularity)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if args.list_clusters:
        _list_clusters()
        return 0
    try:
        return _run(args)
    except (WorkloadError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
