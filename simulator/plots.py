"""Matplotlib PNGs of a simulated step: a per-stream timeline and memory over time.

matplotlib is imported lazily inside the functions, with the non-interactive Agg backend, so importing the
simulator never needs it and headless machines can render. :func:`plot_timeline` draws one row per stream of each
simulated rank (kernels coloured by phase, transfers per group, stalls and peer waits in grey);
:func:`plot_memory` draws each simulated rank's total memory (the engine's count) with its peak, the device
capacity and any OOM point; :func:`plot_memory_by_category` stacks the memory ledger's categories along the step of
the rank that peaks highest, with their peak. Each PNG keeps its title in its ``Title`` metadata.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from simulator.ledger import CATEGORIES, LedgerLine
from simulator.result import Result
from simulator.schedule import BLOCKING, COMPUTE, COMPUTE_STREAM, WAIT

_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green", "stall": "dimgrey",
            "peer wait": "lightgrey", "transfer": "tab:purple"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike[str], title: str) -> None:
    """Write ``fig`` to the PNG ``path``, ``title`` in its metadata, and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Title": title})
    _pyplot().close(fig)


def plot_timeline(result: Result, path: str | os.PathLike[str], *, max_ranks: int = 8) -> None:
    """Write a Gantt-style PNG of the first ``max_ranks`` simulated ranks' streams to ``path``."""
    plt = _pyplot()
    rows: list[tuple[str, dict[str, list[tuple[float, float]]]]] = []
    for rank in sorted(result.timelines)[:max_ranks]:
        tl = result.timelines[rank]
        cp = tl.compiled
        streams = {COMPUTE_STREAM: {}}
        for group in sorted(cp.comm_streams):
            streams[f"comm:{group}"] = {}
        for pos, op in enumerate(cp.program.ops):
            kind, begin, end = cp.kinds[pos], float(tl.begin_s[pos]), float(tl.end_s[pos])
            if kind == COMPUTE:
                streams[COMPUTE_STREAM].setdefault(op.phase, []).append((begin, end - begin))
            elif kind == WAIT:
                streams[COMPUTE_STREAM].setdefault("stall", []).append((begin, end - begin))
            else:
                lane = streams[cp.stream_of[pos]]
                transfer = float(tl.transfer_start_s[pos])
                lane.setdefault("peer wait", []).append((begin, transfer - begin))
                lane.setdefault("transfer", []).append((transfer, end - transfer))
                if kind == BLOCKING:
                    stall = float(tl.stall_begin_s[pos])
                    streams[COMPUTE_STREAM].setdefault("stall", []).append((stall, end - stall))
        for name, bars in streams.items():
            rows.append((f"rank {rank} {name}", bars))
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(rows) + 1.5))
    labelled: set[str] = set()
    for y, (_, bars) in enumerate(reversed(rows)):
        for category, spans in bars.items():
            spans = [(b, w) for b, w in spans if w > 0]
            if not spans:
                continue
            colour = _COLOURS.get(category, "tab:purple")
            legend = category if category not in labelled else None
            labelled.add(category)
            ax.broken_barh([(b * 1e3, w * 1e3) for b, w in spans], (y - 0.4, 0.8), facecolors=colour,
                           label=legend)
    ax.set_yticks(range(len(rows)), [label for label, _ in reversed(rows)])
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{result.workload_name}: step {result.step_time_s * 1e3:.2f} ms")
    ax.legend(loc="upper right", fontsize="small")
    _save(fig, path, ax.get_title())


def plot_memory(result: Result, path: str | os.PathLike[str], *, max_ranks: int = 8) -> None:
    """Write a PNG of memory over time (GiB) of the first ``max_ranks`` simulated ranks to ``path``: the program's
    tensors plus the workload's static memory (the engine's count), and its peak over all ranks."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 5))
    gib = 2.0**30
    for rank in sorted(result.timelines)[:max_ranks]:
        mem = result.timelines[rank].memory
        times = list(mem.times_s * 1e3) + [result.step_time_s * 1e3]
        totals = list(mem.total_bytes / gib) + [mem.total_bytes[-1] / gib]
        ax.step(times, totals, where="post", label=f"rank {rank}")
        host = result.timelines[rank].host_memory  # offloaded tensors (Note [Host tensors] in simulator/workload_types.py)
        if host is not None:
            ax.step(list(host.times_s * 1e3) + [result.step_time_s * 1e3],
                    list(host.total_bytes / gib) + [host.total_bytes[-1] / gib], where="post", linestyle=":",
                    label=f"rank {rank} host")
    peak = result.peak_memory_bytes / gib
    ax.axhline(peak, color="black", linestyle=":", label=f"peak {peak:.2f} GiB")
    capacity = result.ranks[0].memory_capacity_bytes / gib
    ax.axhline(capacity, color="red", linestyle="--", label=f"capacity {capacity:.1f} GiB")
    oom = result.oom
    if oom is not None:
        ax.plot([oom.time_s * 1e3], [oom.bytes_needed / gib], "rx", markersize=12, label=f"OOM: {oom.op_name}")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("memory (GiB)")
    ax.set_title(f"{result.workload_name}: peak {peak:.2f} GiB (the program's tensors and the workload's static "
                 "memory)")
    ax.legend(loc="best", fontsize="small")
    _save(fig, path, ax.get_title())


def memory_by_category(result: Result, lines: Sequence[LedgerLine], pool: str = "device"
                       ) -> tuple[list[float], dict[str, list[float]]]:
    """Memory per ledger category along the simulated step, in bytes, for ``pool``'s lines of ``lines`` (the
    ledger inside backward whose ``activations`` line is this step's, as `autosp.plan.prediction.Prediction.lines`
    are): (times in seconds, {category: bytes at each time}).  Every category but the activations holds its ledger
    bytes through the step (as the ledger counts them inside backward); the activations are what the simulated
    rank that peaks highest holds above its static floor at each moment (device), or has offloaded (host).  So at
    the activation peak the stack's top is the sum of the pool's lines, the predicted peak (docs/design.md, "One
    memory definition")."""
    reports = [tl.memory if pool == "device" else tl.host_memory for tl in result.timelines.values()]
    memory = max((m for m in reports if m is not None), key=lambda m: m.peak_bytes - m.static_bytes, default=None)
    floor = memory.static_bytes if memory is not None else 0
    times = [0.0, result.step_time_s] if memory is None else [*map(float, memory.times_s), result.step_time_s]
    dynamic = [0.0, 0.0] if memory is None else [float(b) - floor for b in memory.total_bytes]
    if memory is not None:
        dynamic.append(dynamic[-1])
    held: dict[str, float] = {}
    for line in lines:
        if line.pool == pool and line.category != "activations":
            held[line.category] = held.get(line.category, 0.0) + line.bytes
    out = {c: [held[c]] * len(times) for c in CATEGORIES if held.get(c)}
    out["activations"] = dynamic
    return times, out


def plot_memory_by_category(result: Result, lines: Sequence[LedgerLine], path: str | os.PathLike[str]) -> None:
    """Write a PNG of memory per ledger category along the simulated step (`memory_by_category`), stacked, in GiB,
    with the stack's peak: the device against its capacity, and the host pool below it when the step offloads
    anything."""
    plt = _pyplot()
    pools = ["device"] + (["host"] if any(ln.pool == "host" for ln in lines) or result.host_peak_memory_bytes else [])
    fig, axes = plt.subplots(len(pools), 1, figsize=(10, 3.5 * len(pools)), squeeze=False)
    gib = 2.0**30
    colours = dict(zip(CATEGORIES, plt.get_cmap("tab10").colors, strict=False))
    for ax, pool in zip(axes[:, 0], pools, strict=True):
        times, stacks = memory_by_category(result, lines, pool)
        ax.stackplot([t * 1e3 for t in times], *([b / gib for b in series] for series in stacks.values()),
                     labels=list(stacks), colors=[colours[c] for c in stacks], step="post")
        peak = max(sum(series[i] for series in stacks.values()) for i in range(len(times))) / gib
        ax.axhline(peak, color="black", linestyle=":", label=f"peak {peak:.2f} GiB")
        of = ""
        if pool == "device":
            capacity = result.ranks[0].memory_capacity_bytes / gib
            of = f" of {capacity:.1f}"
            if peak >= capacity / 2:  # else the line would flatten the stack
                ax.axhline(capacity, color="red", linestyle="--", label=f"capacity {capacity:.1f} GiB")
        ax.set_title(f"{result.workload_name}: {pool} memory per category, peak {peak:.2f}{of} GiB")
        ax.set_xlabel("time (ms)")
        ax.set_ylabel("memory (GiB)")
        ax.legend(loc="upper left", fontsize="small")
    _save(fig, path, "; ".join(ax.get_title() for ax in axes[:, 0]))
