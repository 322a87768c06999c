"""Perfetto / Chrome trace-event JSON of a simulated step (open it at ui.perfetto.dev or chrome://tracing).

One process per simulated rank (its name lists the ranks it represents), one thread per stream: ``compute``
shows kernels and stalls (collective waits, blocking collectives), each ``comm:<group>`` thread shows transfers
and, before them, the time a collective waited for its peers. A ``memory`` counter track per rank follows the
memory timeline. Zero-duration ops (views) are omitted. Times are microseconds, as the format requires.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from simulator.result import RankTimeline, Result
from simulator.schedule import BLOCKING, COMPUTE, COMPUTE_STREAM, WAIT

_US = 1e6


def _slice(pid: int, tid: int, name: str, cat: str, begin_s: float, end_s: float, args: dict | None = None) -> dict:
    event = {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": begin_s * _US,
             "dur": (end_s - begin_s) * _US}
    if args:
        event["args"] = args
    return event


def _rank_events(tl: RankTimeline) -> list[dict[str, Any]]:
    cp = tl.compiled
    pid = tl.rank
    streams = [COMPUTE_STREAM] + sorted(f"comm:{g}" for g in cp.comm_streams)
    tid = {name: i for i, name in enumerate(streams)}
    label = f"rank {tl.rank}" if len(tl.represents) == 1 else f"rank {tl.rank} (represents {list(tl.represents)})"
    events: list[dict[str, Any]] = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": label}},
                                    {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}}]
    for name, i in tid.items():
        events.append({"ph": "M", "pid": pid, "tid": i, "name": "thread_name", "args": {"name": name}})
        events.append({"ph": "M", "pid": pid, "tid": i, "name": "thread_sort_index", "args": {"sort_index": i}})
    per_stream: dict[int, list[dict[str, Any]]] = {i: [] for i in tid.values()}
    ops = cp.program.ops
    for pos, op in enumerate(ops):
        kind = cp.kinds[pos]
        begin, end = float(tl.begin_s[pos]), float(tl.end_s[pos])
        if kind == COMPUTE:
            if end > begin:
                per_stream[0].append(_slice(pid, 0, op.name, op.phase, begin, end,
                                            {"op_id": op.id, "op_class": op.op_class, "flops": op.flops,
                                             "bytes": op.bytes_read + op.bytes_written}))
            continue
        if kind == WAIT:
            if end > begin:
                per_stream[0].append(_slice(pid, 0, op.name, "stall", begin, end, {"op_id": op.id}))
            continue
        coll = op.collective
        t = tid[cp.stream_of[pos]]
        transfer = float(tl.transfer_start_s[pos])
        if transfer > begin:
            per_stream[t].append(_slice(pid, t, f"wait for peers: {op.name}", "rendezvous", begin, transfer,
                                        {"op_id": op.id}))
        per_stream[t].append(_slice(pid, t, op.name, coll.kind, transfer, end,
                                    {"op_id": op.id, "kind": coll.kind, "group": coll.group,
                                     "message_bytes": coll.message_bytes, "key": coll.key}))
        if kind == BLOCKING and end > tl.stall_begin_s[pos]:
            per_stream[0].append(_slice(pid, 0, op.name, "stall", float(tl.stall_begin_s[pos]), end,
                                        {"op_id": op.id, "blocking": True}))
    for stream_events in per_stream.values():
        stream_events.sort(key=lambda ev: ev["ts"])
        events.extend(stream_events)
    mem = tl.memory
    last = None
    for t_s, total in zip(mem.times_s.tolist(), mem.total_bytes.tolist(), strict=True):
        if math.isfinite(t_s) and total != last:
            events.append({"ph": "C", "pid": pid, "name": "memory", "ts": t_s * _US, "args": {"bytes": total}})
            last = total
    return events


def chrome_trace(result: Result, other_data: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The trace of ``result`` as a JSON-serialisable dict; ``other_data`` adds to (or replaces) its summary
    figures (``python -m simulator``: `simulator.max_length.DevicePeak.to_dict`)."""
    events: list[dict[str, Any]] = []
    for rank in sorted(result.timelines):
        events.extend(_rank_events(result.timelines[rank]))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"workload": result.workload_name, "step_time_s": result.step_time_s,
                          "cluster": result.cluster.get("preset"), "note": result.note,
                          "peak_memory_bytes": result.peak_memory_bytes, **(other_data or {})}}


def write_chrome_trace(result: Result, path: str | os.PathLike[str],
                       other_data: Mapping[str, Any] | None = None) -> None:
    """Write :func:`chrome_trace` of ``result`` to ``path``."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(chrome_trace(result, other_data), fh, separators=(",", ":"))
