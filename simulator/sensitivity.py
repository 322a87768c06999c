"""How the longest trainable sequence moves when each uncertain memory constant moves within its band.

Given one simulated step at ``seq_len`` tokens - its memory above static memory (activations, the part that grows
with the length) - and a :class:`simulator.ledger.TrainingConfig` for the static part, :func:`length_sensitivity`
finds the longest length whose ledger total (at the end of backward, activations scaled linearly from the
simulated length, see Note [Linear activations]) fits the device, once with every constant of
:data:`simulator.device_reserve.UNCERTAIN` at its nominal value, then with each constant alone at the low and
at the high end of its band, then with all of them at once. Uses :func:`simulator.search.search_max_length`.

:func:`timing_sensitivity` does the same for the efficiency and latency constants of a GPU preset
(:data:`simulator.gpu_constants.GPU_CONSTANTS`): it rebuilds the preset with one constant at each end of its band,
re-simulates the workload and reports the step time and the longest length (the activations re-simulated, the
ledger at its nominal values). Compute efficiencies move the step time; they move the length only through the
memory timeline (when tensors are freed relative to collectives), usually not at all.

Note [Linear activations]
~~~~~~~~~~~~~~~~~~~~~~~~~
Activation memory is taken as proportional to the length (flash-style attention keeps it O(S)): ``S / seq_len``
times the simulated amount. That is a first-order estimate around the simulated length - the number to trust is
a full search with the simulator at each length - but it is what a sensitivity needs: the same yardstick under
each moved constant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from simulator.device_reserve import UNCERTAIN, Uncertain
from simulator.gpu_constants import GPU_CONSTANTS, moved
from simulator.ledger import TrainingConfig, memory_ledger, summarize
from simulator.search import Probe, search_max_length


@dataclass(frozen=True, kw_only=True)
class SensitivityRow:
    """Longest length with one constant (or all) moved."""

    name: str
    """The constant (``nominal``: none moved; ``all``: every constant moved together)."""
    low_value: float | None
    high_value: float | None
    at_low: int | None
    """Longest fitting length with the constant at the low end (``None``: nothing fits)."""
    at_high: int | None
    provenance: str = ""


def _max_len(cfg: TrainingConfig, table: Mapping[str, Uncertain], *, seq_len: int, activation_bytes: int,
             capacity_bytes: int, granularity: int, ceiling: int) -> int | None:
    def probe(length: int) -> Probe:
        lines = memory_ledger(cfg, at="backward", uncertain=table,
                              activation_bytes=int(activation_bytes * length / seq_len))
        total = summarize(lines).nominal
        return Probe(fits=total <= capacity_bytes, peak_memory_bytes=total, step_time_s=0.0)

    return search_max_length(probe, low=granularity, high=ceiling, granularity=granularity).max_seq_len


def _moved(to: str, only: str | None = None) -> dict[str, Uncertain]:
    return {n: dataclasses.replace(u, nominal=getattr(u, to)) if only in (None, n) else u
            for n, u in UNCERTAIN.items()}


def length_sensitivity(cfg: TrainingConfig, *, seq_len: int, activation_bytes: int, capacity_bytes: int,
                       granularity: int = 1024, ceiling: int = 2**22) -> list[SensitivityRow]:
    """Rows: nominal, one per uncertain constant (low end / high end of its band), and all constants together.

    ``activation_bytes``: the simulated peak above static memory at ``seq_len`` (Note [Linear activations]).
    """
    if seq_len < 1 or activation_bytes < 0:
        raise ValueError("seq_len must be positive and activation_bytes non-negative")
    kw = dict(seq_len=seq_len, activation_bytes=activation_bytes, capacity_bytes=capacity_bytes,
              granularity=granularity, ceiling=ceiling)
    nominal = _max_len(cfg, UNCERTAIN, **kw)
    rows = [SensitivityRow(name="nominal", low_value=None, high_value=None, at_low=nominal, at_high=nominal)]
    for name, u in UNCERTAIN.items():
        rows.append(SensitivityRow(name=name, low_value=u.low, high_value=u.high, provenance=u.provenance,
                                   at_low=_max_len(cfg, _moved("low", name), **kw),
                                   at_high=_max_len(cfg, _moved("high", name), **kw)))
    rows.append(SensitivityRow(name="all", low_value=None, high_value=None, at_low=_max_len(cfg, _moved("low"), **kw),
                               at_high=_max_len(cfg, _moved("high"), **kw)))
    return rows


def format_sensitivity(rows: list[SensitivityRow]) -> str:
    """A plain-text table; the low end of a memory constant gives the *longer* length."""
    def fmt(v: int | None) -> str:
        return "none" if v is None else f"{v:,}"

    out = [f"{'constant':30s} {'band':>26s} {'max len (low)':>14s} {'max len (high)':>15s}"]
    for r in rows:
        band = "" if r.low_value is None else f"{r.low_value:.3g} .. {r.high_value:.3g}"
        out.append(f"{r.name:30s} {band:>26s} {fmt(r.at_low):>14s} {fmt(r.at_high):>15s}")
    return "\n".join(out)



@dataclass(frozen=True, kw_only=True)
class TimingRow:
    """Step time and longest length with one GPU constant at each end of its band."""

    name: str
    low_value: float | None
    high_value: float | None
    step_low_s: float
    step_high_s: float
    at_low: int | None
    at_high: int | None
    provenance: str = ""
    assumption: bool = False


def timing_sensitivity(cfg: TrainingConfig, *, constants: tuple[str, ...],
                       simulate_with: Callable[[Mapping[str, Uncertain]], tuple[float, int]], seq_len: int,
                       capacity_bytes: int, granularity: int = 1024, ceiling: int = 2**22) -> list[TimingRow]:
    """Rows: nominal, then one per name in ``constants`` (keys of ``GPU_CONSTANTS``).

    ``simulate_with(table)`` simulates the workload on the preset rebuilt from ``table`` and returns (step time,
    activation bytes above static memory); the longest length follows Note [Linear activations].
    """
    kw = dict(seq_len=seq_len, capacity_bytes=capacity_bytes, granularity=granularity, ceiling=ceiling)

    def run(table: Mapping[str, Uncertain]) -> tuple[float, int | None]:
        step, activations = simulate_with(table)
        return step, _max_len(cfg, UNCERTAIN, activation_bytes=activations, **kw)

    step, length = run(GPU_CONSTANTS)
    rows = [TimingRow(name="nominal", low_value=None, high_value=None, step_low_s=step, step_high_s=step,
                      at_low=length, at_high=length)]
    for name in constants:
        u = GPU_CONSTANTS[name]
        (s_lo, l_lo), (s_hi, l_hi) = run(moved(name, "low")), run(moved(name, "high"))
        rows.append(TimingRow(name=name, low_value=u.low, high_value=u.high, step_low_s=s_lo, step_high_s=s_hi,
                              at_low=l_lo, at_high=l_hi, provenance=u.provenance, assumption=u.assumption))
    return rows


def format_timing_sensitivity(rows: list[TimingRow]) -> str:
    """A plain-text table; ``*`` marks constants that are assumptions (no measurement pins them down)."""
    def fmt(v: int | None) -> str:
        return "none" if v is None else f"{v:,}"

    out = [f"{'constant':32s} {'band':>22s} {'step ms (low)':>14s} {'step ms (high)':>15s} "
           f"{'max len (low)':>14s} {'max len (high)':>15s}"]
    for r in rows:
        band = "" if r.low_value is None else f"{r.low_value:.3g} .. {r.high_value:.3g}"
        name = r.name + (" *" if r.assumption else "")
        out.append(f"{name:32s} {band:>22s} {r.step_low_s * 1e3:14.3f} {r.step_high_s * 1e3:15.3f} "
                   f"{fmt(r.at_low):>14s} {fmt(r.at_high):>15s}")
    return "\n".join(out)
