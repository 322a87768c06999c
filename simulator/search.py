"""Maximum trainable sequence length: binary search over sequence lengths for the longest one that fits.

The caller supplies ``make_workload(seq_len) -> Workload`` (the exporter at that length, or a synthetic
generator) and a cluster; :func:`max_sequence_length` simulates candidate lengths on a grid (multiples of
``granularity``, e.g. 1024 or the SP degree) and returns the largest that does not run out of memory, with every
trial it made. It assumes memory grows with sequence length (a longer sequence that fits after a shorter one
failed is logged as a warning and ignored).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from simulator.cluster import Cluster
from simulator.engine import simulate
from simulator.result import Result
from simulator.workload import Workload

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One simulated candidate."""

    seq_len: int
    """Sequence length tried."""
    fits: bool
    """No rank ran out of memory."""
    peak_memory_bytes: int
    """Largest per-rank peak."""
    step_time_s: float
    """Simulated step time."""


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """Outcome of :func:`max_sequence_length`."""

    max_seq_len: int | None
    """Longest fitting sequence length on the grid, or ``None`` if even the shortest does not fit."""
    result: Result | None
    """Simulation result at ``max_seq_len``."""
    trials: tuple[Trial, ...]
    """Every candidate simulated, in the order tried."""
    hit_upper_bound: bool
    """True when the upper bound itself fits (the real maximum may be larger: raise ``high``)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly summary."""
        return {"max_seq_len": self.max_seq_len, "hit_upper_bound": self.hit_upper_bound,
                "step_time_s": None if self.result is None else self.result.step_time_s,
                "trials": [t.__dict__ for t in self.trials]}


def max_sequence_length(make_workload: Callable[[int], Workload], cluster: Cluster, *, low: int, high: int,
                        granularity: int = 1024, **simulate_kwargs: Any) -> SearchResult:
    """Largest ``seq_len`` in ``[low, high]`` that is a multiple of ``granularity`` and does not OOM.

    Costs about ``log2((high - low) / granularity) + 2`` simulations. ``simulate_kwargs`` go to
    :func:`simulator.simulate`.
    """
    if granularity < 1:
        raise ValueError(f"granularity must be a positive integer, got {granularity}")
    lo_k, hi_k = -(-low // granularity), high // granularity
    if low < 1 or lo_k > hi_k:
        raise ValueError(f"no multiple of {granularity} lies in [{low}, {high}]; widen the range or lower the "
                         "granularity")
    trials: list[Trial] = []
    results: dict[int, Result] = {}

    def fits(k: int) -> bool:
        seq_len = k * granularity
        result = simulate(make_workload(seq_len), cluster, **simulate_kwargs)
        trials.append(Trial(seq_len=seq_len, fits=result.fits, peak_memory_bytes=result.peak_memory_bytes,
                            step_time_s=result.step_time_s))
        logger.info("seq_len %d: %s (peak %.2f GiB)", seq_len, "fits" if result.fits else "OOM",
                    result.peak_memory_bytes / 2**30)
        results[k] = result
        return result.fits

    if not fits(lo_k):
        return SearchResult(max_seq_len=None, result=None, trials=tuple(trials), hit_upper_bound=False)
    if hi_k == lo_k or fits(hi_k):
        return SearchResult(max_seq_len=hi_k * granularity, result=results[hi_k], trials=tuple(trials),
                            hit_upper_bound=True)
    good, bad = lo_k, hi_k  # invariant: good fits, bad does not
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    for trial in trials:
        if not trial.fits and trial.seq_len < good * granularity:
            logger.warning("seq_len %d does not fit although the longer %d does: memory is not monotonic in the "
                           "sequence length", trial.seq_len, good * granularity)
    return SearchResult(max_seq_len=good * granularity, result=results[good], trials=tuple(trials),
                        hit_upper_bound=False)
