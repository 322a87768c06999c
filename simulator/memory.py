"""Per-rank device-memory timeline: static bytes plus live tensors over simulated time, peak and OOM.

Memory is computed after the event loop from each tensor's lifetime: it becomes live when its allocating op
begins and dies when its freeing op ends (never, within the step, if nothing frees it). Because every tensor
contributes ``+bytes`` on an interval whose end is not before its start, the live total can never go negative.
Out-of-memory is *reported*, not enforced: the first instant the total exceeds the capacity is returned with the
op whose allocation crossed it, and the step keeps running so the caller also gets its time. (A blocking
``simpy.Container`` would stall instead of reporting.) See Note [Same-instant ordering].

Note [Same-instant ordering]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Events at one instant are applied as: frees of tensors allocated earlier, then allocations, then frees of
tensors allocated at that same instant. So an op that starts exactly when its predecessor ends can reuse the
predecessor's freed memory, while a zero-duration op's workspace still counts at its instant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Memory of one rank over one step."""

    times_s: np.ndarray
    """Instants at which the total changes (starts at 0.0)."""
    total_bytes: np.ndarray
    """Total bytes (static + live tensors) from each instant on."""
    static_bytes: int
    """Static part (parameters, gradients, optimizer state, other)."""
    peak_bytes: int
    """Maximum of ``total_bytes``."""
    peak_time_s: float
    """First instant the peak is reached."""
    oom_index: int | None
    """Index into ``alloc_ops`` of the allocation that first exceeded the capacity (``-1``: static memory alone
    exceeds it); ``None`` if memory fits."""
    oom_time_s: float | None
    """When the capacity was first exceeded."""
    oom_bytes: int | None
    """Total bytes needed at that instant."""


def memory_timeline(*, static_bytes: int, sizes: Sequence[int], alloc_s: Sequence[float], free_s: Sequence[float],
                    capacity_bytes: float) -> MemoryReport:
    """Memory over time from tensor lifetimes (``free_s`` may be ``inf`` for tensors alive at step end).

    ``sizes[i]`` bytes are live on ``[alloc_s[i], free_s[i]]``; a free earlier than its allocation is clamped to
    the allocation instant. ``oom_index`` in the report indexes these arrays.
    """
    size = np.asarray(sizes, dtype=np.int64)
    alloc = np.asarray(alloc_s, dtype=np.float64)
    free = np.maximum(np.asarray(free_s, dtype=np.float64), alloc)
    n = len(size)
    finite = np.isfinite(free)
    # Phase per event (see Note [Same-instant ordering]): 0 free-of-earlier, 1 alloc, 2 free-of-same-instant.
    free_phase = np.where(free > alloc, 0, 2)[finite]
    times = np.concatenate([alloc, free[finite]])
    phase = np.concatenate([np.ones(n, dtype=np.int64), free_phase])
    delta = np.concatenate([size, -size[finite]])
    source = np.concatenate([np.arange(n), np.flatnonzero(finite)])
    order = np.lexsort((phase, times))
    times, delta, source, phase = times[order], delta[order], source[order], phase[order]
    totals = static_bytes + np.cumsum(delta)
    oom_index = oom_time = oom_bytes = None
    if static_bytes > capacity_bytes:
        oom_index, oom_time, oom_bytes = -1, 0.0, int(static_bytes)
    elif len(totals):
        over = np.flatnonzero(totals > capacity_bytes)
        if len(over):
            first = int(over[0])
            oom_index, oom_time, oom_bytes = int(source[first]), float(times[first]), int(totals[first])
    all_times = np.concatenate([[0.0], times])
    all_totals = np.concatenate([[static_bytes], totals]).astype(np.int64)
    peak_at = int(np.argmax(all_totals))
    return MemoryReport(times_s=all_times, total_bytes=all_totals, static_bytes=int(static_bytes),
                        peak_bytes=int(all_totals[peak_at]), peak_time_s=float(all_times[peak_at]),
                        oom_index=oom_index, oom_time_s=oom_time, oom_bytes=oom_bytes)
