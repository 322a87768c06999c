"""Maximum trainable sequence length: search a grid of lengths for the longest one that fits, and say why it stopped.

:func:`search_max_length` is the general search: the caller supplies ``probe(seq_len)`` returning whether that
length fits, its peak memory and step time (a :class:`Probe` or a ``(fits, peak_bytes, step_time_s)`` tuple) -
a simulation, a layer-extrapolated simulation, anything; nothing here needs torch. It tries multiples of
``granularity`` in ``[low, high]`` by bisection or, given the capacity, by the secant search of Note [Secant
search], and returns a :class:`SearchResult` whose :attr:`~SearchResult.stopped` says whether the answer is exact
(``converged``), a lower bound because the ceiling still fits (``ceiling``) or because the probe budget ran out
(``probe_budget``), or that nothing fits (``none_fit``); :meth:`SearchResult.display` renders it ("≥ 131,072" at
the ceiling). :func:`max_sequence_length` is the same search over simulated workloads. Memory is assumed to grow
with the length (a longer length that fits after a shorter one failed is logged as a warning and ignored).

Note [Secant search]
~~~~~~~~~~~~~~~~~~~~
Peak memory above static memory grows about linearly in the length (activations), so the next length is where a
straight line crosses the headroom (capacity minus static memory): through the first probe and the origin at
first, then through the two longest fitting (or two shortest failing) probes, and once the headroom is
bracketed through the bracket's ends (regula falsi), clamped so that the bracket shrinks by at least a quarter
per probe; rounded to the grid and kept strictly inside the bracket. It converges in a handful of probes where
bisection needs ``log2`` of the grid size.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

STOP_REASONS = ("converged", "ceiling", "probe_budget", "none_fit")


@dataclass(frozen=True, kw_only=True)
class Probe:
    """What the caller's probe reports for one length."""

    fits: bool
    peak_memory_bytes: int
    step_time_s: float
    static_memory_bytes: int = 0
    """Part of the peak that does not depend on the length (the secant search works above it)."""
    result: Any = None
    """Anything the caller wants back for the best length (e.g. a :class:`simulator.Result`)."""


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One probed length."""

    seq_len: int
    fits: bool
    peak_memory_bytes: int
    step_time_s: float


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """Outcome of a search."""

    max_seq_len: int | None
    """Longest fitting length found (``None``: none fitted)."""
    stopped: str
    """Why the search stopped, one of :data:`STOP_REASONS`: ``converged`` (the next grid length does not fit),
    ``ceiling`` (``high`` fits: the true maximum may be larger), ``probe_budget`` (``max_probes`` spent before the
    bracket closed: a lower bound), ``none_fit`` (``low`` does not fit, or static memory alone exceeds capacity)."""
    trials: tuple[Trial, ...]
    """Every probe, in the order made."""
    result: Any = None
    """The probe's ``result`` at ``max_seq_len``."""
    step_time_s: float | None = None
    """Step time at ``max_seq_len``."""

    @property
    def hit_upper_bound(self) -> bool:
        """True when the ceiling itself fits."""
        return self.stopped == "ceiling"

    @property
    def is_lower_bound(self) -> bool:
        """True when the real maximum may be longer than :attr:`max_seq_len`."""
        return self.stopped in ("ceiling", "probe_budget")

    def display(self) -> str:
        """``131,072`` when exact, ``≥ 131,072`` for a lower bound, ``< 4,096`` when nothing fitted."""
        if self.max_seq_len is None:
            failed = [t.seq_len for t in self.trials if not t.fits]
            return f"< {min(failed):,}" if failed else "none"
        return f"{'≥ ' if self.is_lower_bound else ''}{self.max_seq_len:,}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly summary."""
        return {"max_seq_len": self.max_seq_len, "stopped": self.stopped, "display": self.display(),
                "hit_upper_bound": self.hit_upper_bound, "step_time_s": self.step_time_s,
                "trials": [t.__dict__ for t in self.trials]}


def _as_probe(value: Probe | tuple) -> Probe:
    if isinstance(value, Probe):
        return value
    fits, peak, time_s = value
    return Probe(fits=bool(fits), peak_memory_bytes=int(peak), step_time_s=float(time_s))


def _secant_guess(points: list[tuple[int, int, bool]], headroom: int, lo: int, hi: int) -> float:
    """Next length (off the grid) from [(length, bytes above static, fits)] (Note [Secant search])."""
    mem = {s: m for s, m, _ in points}
    fits = sorted(s for s, _, ok in points if ok)
    fails = sorted(s for s, _, ok in points if not ok)
    if fits and fails and lo in mem and hi in mem:
        slope = (mem[hi] - mem[lo]) / (hi - lo)
        guess = lo + (headroom - mem[lo]) / slope if slope > 0 else (lo + hi) / 2
        return min(max(guess, lo + (hi - lo) / 4), hi - (hi - lo) / 4)
    if len(points) == 1:
        s0, m0, _ = points[0]
        return s0 * headroom / max(m0, 1)
    (s0, m0), (s1, m1) = ([(s, mem[s]) for s in fits[-2:]] if not fails else [(s, mem[s]) for s in fails[:2]])
    slope = (m1 - m0) / (s1 - s0)
    if slope > 0:
        return s1 + (headroom - m1) / slope
    return 2 * s1 if not fails else s0 / 2


class _Grid:
    """The lengths a search may probe, indexed by integers: multiples of a granularity, or an explicit list."""

    def __init__(self, low: int, high: int, granularity: int, lengths: Sequence[int] | None) -> None:
        if lengths is None:
            if granularity < 1:
                raise ValueError(f"granularity must be a positive integer, got {granularity}")
            self._lengths = None
            self.granularity = granularity
            self.lo, self.hi = -(-low // granularity), high // granularity
            if low < 1 or self.lo > self.hi:
                raise ValueError(f"no multiple of {granularity} lies in [{low}, {high}]; widen the range or lower "
                                 "the granularity")
            return
        self._lengths = sorted({int(n) for n in lengths if low <= n <= high})
        if not self._lengths or self._lengths[0] < 1:
            raise ValueError(f"no positive length of {sorted(lengths)} lies in [{low}, {high}]; widen the range")
        self.lo, self.hi = 0, len(self._lengths) - 1

    def length(self, k: int) -> int:
        return k * self.granularity if self._lengths is None else self._lengths[k]

    def at_or_below(self, length: float) -> int:
        """Index of the longest grid length <= ``length`` (``lo - 1`` when none)."""
        if self._lengths is None:
            return int(length // self.granularity)
        return bisect.bisect_right(self._lengths, length) - 1

    def at_or_above(self, length: float) -> int:
        """Index of the shortest grid length >= ``length`` (``hi + 1`` when none)."""
        if self._lengths is None:
            return -int(-length // self.granularity)
        return bisect.bisect_left(self._lengths, length)


def search_max_length(probe: Callable[[int], Probe | tuple], *, low: int, high: int, granularity: int = 1024,
                      capacity_bytes: int | None = None, start: int | None = None,
                      max_probes: int | None = None, lengths: Sequence[int] | None = None) -> SearchResult:
    """Longest multiple of ``granularity`` in ``[low, high]`` whose ``probe`` fits, and why the search stopped.

    Without ``capacity_bytes``: bisection (``low``, then ``high``, then midpoints; about ``log2`` of the grid
    size + 2 probes). With it: the secant search of Note [Secant search] from ``start`` (default ``low``) on the
    probes' peak memory above their static memory. ``max_probes`` caps the number of probes (``stopped ==
    "probe_budget"`` when it bites). ``lengths`` replaces the multiples of ``granularity`` by an explicit set of
    lengths (e.g. the lengths of exported workloads): the answer is then the longest of them that fits, and
    ``converged`` means the next one of them does not.
    """
    grid = _Grid(low, high, granularity, lengths)
    lo_k, hi_k = grid.lo, grid.hi
    if max_probes is not None and max_probes < 1:
        raise ValueError("max_probes must be at least 1")
    trials: list[Trial] = []
    probes: dict[int, Probe] = {}

    def run(k: int) -> Probe:
        seq_len = grid.length(k)
        got = probes[k] = _as_probe(probe(seq_len))
        trials.append(Trial(seq_len=seq_len, fits=got.fits, peak_memory_bytes=got.peak_memory_bytes,
                            step_time_s=got.step_time_s))
        logger.info("seq_len %d: %s (peak %.2f GiB)", seq_len, "fits" if got.fits else "does not fit",
                    got.peak_memory_bytes / 2**30)
        return got

    def done(stopped: str) -> SearchResult:
        fitting = [k for k, p in probes.items() if p.fits]
        best = max(fitting, default=None)
        for k, p in probes.items():
            if best is not None and not p.fits and k < best:
                logger.warning("seq_len %d does not fit although the longer %d does: memory is not monotonic in "
                               "the sequence length", grid.length(k), grid.length(best))
        if best is None:
            return SearchResult(max_seq_len=None, stopped="none_fit" if stopped != "probe_budget" else stopped,
                                trials=tuple(trials))
        return SearchResult(max_seq_len=grid.length(best), stopped=stopped, trials=tuple(trials),
                            result=probes[best].result, step_time_s=probes[best].step_time_s)

    budget = max_probes if max_probes is not None else 10**9
    good, bad = lo_k - 1, hi_k + 1  # invariant: good fits (or is below the grid), bad does not (or is above it)
    k = lo_k if capacity_bytes is None else min(max(grid.at_or_above(start or low), lo_k), hi_k)
    while True:
        if len(trials) >= budget:
            return done("probe_budget")
        got = run(k)
        if got.fits:
            good = k
        else:
            bad = k
        headroom = None if capacity_bytes is None else capacity_bytes - got.static_memory_bytes
        if headroom is not None and headroom <= 0:
            return done("none_fit")
        if bad == lo_k:
            return done("none_fit")
        if good == hi_k:
            return done("ceiling")
        if bad - good <= 1:
            return done("converged")
        if capacity_bytes is None:
            k = hi_k if len(trials) == 1 else (good + bad) // 2
            continue
        points = [(grid.length(kk), p.peak_memory_bytes - p.static_memory_bytes, p.fits)
                  for kk, p in probes.items()]
        # The bracket's ends as lengths; an end outside the grid (nothing probed there yet) is never read.
        lo_len = grid.length(good) if good >= lo_k else 0
        hi_len = grid.length(bad) if bad <= hi_k else 0
        guess = _secant_guess(points, headroom, lo_len, hi_len)
        k = min(max(grid.at_or_below(guess), good + 1, lo_k), bad - 1, hi_k)


def max_sequence_length(make_workload: Callable, cluster: Any, *, low: int, high: int, granularity: int = 1024,
                        max_probes: int | None = None, **simulate_kwargs: Any) -> SearchResult:
    """Largest ``seq_len`` in ``[low, high]`` (a multiple of ``granularity``) whose simulated workload
    ``make_workload(seq_len)`` fits on ``cluster``, by bisection; ``simulate_kwargs`` go to
    :func:`simulator.simulate`. The result's ``result`` is the :class:`simulator.Result` at the maximum."""
    from simulator.engine import simulate

    def probe(seq_len: int) -> Probe:
        result = simulate(make_workload(seq_len), cluster, **simulate_kwargs)
        return Probe(fits=result.fits, peak_memory_bytes=result.peak_memory_bytes, step_time_s=result.step_time_s,
                     result=result)

    return search_max_length(probe, low=low, high=high, granularity=granularity, max_probes=max_probes)
