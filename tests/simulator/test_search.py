"""Maximum trainable sequence length by binary search over a caller-supplied workload generator."""

from __future__ import annotations

import pytest

from simulator import ProgramBuilder, StaticMemory, Workload, max_sequence_length
from simulator.search import Probe
from tests.simulator.toys import GFLOP, toy_cluster

BYTES_PER_TOKEN = 1000


def _linear_memory_workload(seq_len: int) -> Workload:
    b = ProgramBuilder()
    t = b.tensor(seq_len * BYTES_PER_TOKEN)
    b.compute("activations", flops=GFLOP, allocates=[t])
    b.compute("backward", flops=GFLOP, frees=[t])
    return Workload(name=f"S={seq_len}", world_size=2, groups={"sp": [0, 1]}, symmetric=True,
                    ranks={0: b.build(StaticMemory(parameter_bytes=10**6))}, metadata={"seq_len": seq_len})


CLUSTER = toy_cluster(memory_bytes=10**6 + 50_000 * BYTES_PER_TOKEN)  # fits up to 50,000 tokens


def test_search_finds_the_largest_fitting_multiple_of_the_granularity():
    found = max_sequence_length(_linear_memory_workload, CLUSTER, low=1024, high=1024 * 100, granularity=1024)
    assert found.max_seq_len == 48 * 1024  # 49 * 1024 = 50,176 > 50,000
    assert found.result.fits and not found.hit_upper_bound
    assert len(found.trials) <= 10
    assert any(not t.fits and t.seq_len == 49 * 1024 for t in found.trials)


def test_search_reports_none_when_the_shortest_length_does_not_fit():
    found = max_sequence_length(_linear_memory_workload, CLUSTER, low=60_000, high=100_000, granularity=1000)
    assert found.max_seq_len is None and found.result is None
    assert found.to_dict()["trials"][0]["fits"] is False


def test_search_flags_an_upper_bound_that_still_fits():
    found = max_sequence_length(_linear_memory_workload, CLUSTER, low=1000, high=8000, granularity=1000)
    assert found.max_seq_len == 8000 and found.hit_upper_bound


@pytest.mark.parametrize(("low", "high", "granularity"), [(1000, 500, 100), (10, 20, 64), (100, 1000, 0)])
def test_search_rejects_an_empty_grid(low, high, granularity):
    with pytest.raises(ValueError):
        max_sequence_length(_linear_memory_workload, CLUSTER, low=low, high=high, granularity=granularity)


def _linear_probe(cap: int, *, static: int = 10**6, per_token: int = BYTES_PER_TOKEN, calls: list | None = None):
    from simulator import Probe

    def probe(seq_len: int) -> Probe:
        if calls is not None:
            calls.append(seq_len)
        peak = static + per_token * seq_len
        return Probe(fits=peak <= cap, peak_memory_bytes=peak, step_time_s=seq_len * 1e-6, static_memory_bytes=static)

    return probe


CAP = 10**6 + 50_000 * BYTES_PER_TOKEN


@pytest.mark.parametrize("capacity", [None, CAP], ids=["bisect", "secant"])
def test_search_max_length_converges_on_the_same_answer_either_way(capacity):
    from simulator import search_max_length

    found = search_max_length(_linear_probe(CAP), low=1024, high=1024 * 100, granularity=1024,
                              capacity_bytes=capacity, start=8192)
    assert (found.max_seq_len, found.stopped, found.display()) == (48 * 1024, "converged", "49,152")
    assert found.step_time_s == pytest.approx(48 * 1024 * 1e-6)
    assert len(found.trials) <= (4 if capacity else 10)


def test_search_max_length_reports_the_ceiling_as_a_lower_bound():
    from simulator import search_max_length

    for capacity in (None, CAP):
        found = search_max_length(_linear_probe(CAP), low=1024, high=16 * 1024, granularity=1024,
                                  capacity_bytes=capacity)
        assert (found.stopped, found.max_seq_len, found.display()) == ("ceiling", 16384, "≥ 16,384")
        assert found.hit_upper_bound and found.is_lower_bound


def test_search_max_length_reports_a_spent_probe_budget():
    from simulator import search_max_length

    calls: list[int] = []
    found = search_max_length(_linear_probe(CAP, calls=calls), low=1024, high=1024 * 100, granularity=1024,
                              max_probes=3)
    assert len(calls) == 3 and found.stopped == "probe_budget" and found.is_lower_bound
    assert found.max_seq_len == max(t.seq_len for t in found.trials if t.fits)
    assert found.display() == f"≥ {found.max_seq_len:,}"
    assert found.to_dict()["stopped"] == "probe_budget"


def test_search_max_length_when_nothing_fits():
    from simulator import search_max_length

    found = search_max_length(_linear_probe(CAP), low=60 * 1024, high=100 * 1024, granularity=1024)
    assert (found.max_seq_len, found.stopped, found.display()) == (None, "none_fit", "< 61,440")
    # static memory alone over the capacity: one probe, nothing fits
    found = search_max_length(_linear_probe(10**5), low=1024, high=8192, granularity=1024, capacity_bytes=10**5)
    assert (found.max_seq_len, found.stopped, len(found.trials)) == (None, "none_fit", 1)


def test_search_max_length_takes_plain_tuples():
    from simulator import search_max_length

    found = search_max_length(lambda s: (s <= 5000, s, 0.0), low=1000, high=9000, granularity=1000)
    assert (found.max_seq_len, found.stopped) == (5000, "converged")


@pytest.mark.parametrize("capacity_tokens", [900, 3_000, 12_345, 40_000, 99_999, 200_000])
@pytest.mark.parametrize("secant", [False, True])
def test_search_over_an_explicit_set_of_lengths_finds_the_longest_member_that_fits(capacity_tokens, secant):
    from simulator.search import search_max_length

    lengths = [1000, 1500, 4096, 7000, 12_000, 12_345, 30_000, 65_536, 100_000]
    static = 10**6
    probed = []

    def probe(seq_len):
        assert seq_len in lengths  # only exported lengths can be probed
        probed.append(seq_len)
        peak = static + seq_len * BYTES_PER_TOKEN
        return Probe(fits=peak <= static + capacity_tokens * BYTES_PER_TOKEN, peak_memory_bytes=peak,
                     step_time_s=1.0, static_memory_bytes=static)

    found = search_max_length(probe, low=lengths[0], high=lengths[-1], lengths=lengths, start=lengths[0],
                              capacity_bytes=static + capacity_tokens * BYTES_PER_TOKEN if secant else None)
    fitting = [n for n in lengths if n <= capacity_tokens]
    assert found.max_seq_len == (max(fitting) if fitting else None)
    assert found.stopped == {900: "none_fit", 200_000: "ceiling"}.get(capacity_tokens, "converged")
    assert len(probed) == len(set(probed))


def test_depth_extrapolation_is_a_straight_line_in_the_depth():
    from simulator.max_length import extrapolate_depth

    def at_depth(d):
        return 0.5 + 0.25 * d, 1000 + 300 * d

    assert extrapolate_depth(at_depth, 32, (1, 2)) == (8.5, 10600)
    assert extrapolate_depth(at_depth, 32, (32, 32)) == at_depth(32)  # traced at full depth: as is


@pytest.mark.parametrize("shallow,deeper", [((1.0, 5000), (1.5, 4000)),   # less memory at two layers
                                            ((1.0, 5000), (0.9, 6000))])  # less time at two layers
def test_depth_extrapolation_refuses_traces_that_shrink_with_the_depth(shallow, deeper):
    # Under SAC the 1- and 2-layer graphs can be planned differently; a line falling with the depth would
    # predict a 32-layer model holding less than one layer (below zero at long lengths): refused.
    from simulator.max_length import DepthExtrapolationError, extrapolate_depth

    with pytest.raises(DepthExtrapolationError, match="trace the full depth"):
        extrapolate_depth({1: shallow, 2: deeper}.__getitem__, 32, (1, 2))


def test_a_refused_extrapolation_falls_back_to_the_full_depth_and_says_so(caplog):
    from simulator.max_length import extrapolate_or_trace_full

    traced = []

    def at_depth(d):
        traced.append(d)
        return {2: (1.0, 5000), 3: (1.5, 4000), 32: (9.0, 70_000)}[d]  # 3 layers hold less than 2: refused

    assert extrapolate_or_trace_full(at_depth, 32, (2, 3), what="row x") == (9.0, 70_000, (32, 32))
    assert traced == [2, 3, 32] and "row x" in caplog.text and "tracing all 32 layers" in caplog.text
    straight = {1: (1.0, 1000), 2: (1.5, 1300)}.__getitem__
    assert extrapolate_or_trace_full(straight, 32, (1, 2)) == (16.5, 10300, (1, 2))
