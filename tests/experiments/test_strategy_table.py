"""The strategies table (experiments/paper_scale/strategy_table.py) on a one-layer Llama with 8 query heads and 4
key/value heads at 128 tokens over 8 GPUs (one H100 node: Ulysses, two hybrids, the ring) and 16 (two nodes:
Ulysses refused, three hybrids, the ring): every candidate of the registry gets a row, named as the registry names
it; the auto choice is the fastest candidate that fits, also when the capacity leaves out the one it chose first; a
group where nothing fits says so.  ``python -m experiments.reproduce --only strategies`` runs the paper-scale table
(minutes)."""

from __future__ import annotations

import json

import pytest

from experiments.paper_scale import strategy_table as st
from simulator.strategies import STRATEGIES, sp_candidates

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256,
    "max_position_embeddings": 4096, "attention_dropout": 0.0, "tie_word_embeddings": False,
}
SEQ, GPUS = 128, (8, 16)


@pytest.fixture(scope="module")
def decided(tmp_path_factory):
    """(model, {gpus: (TraceReuse, decision)}, rows): the table's decisions, traced at full depth (one layer)."""
    from autosp.plan.traces import TraceReuse

    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(LLAMA))
    model, found, rows = str(path), {}, []
    for gpus in GPUS:
        reuse = TraceReuse([])
        found[gpus] = reuse, st.decide(model, SEQ, gpus, st.cluster_for(gpus), depth="full", reuse=reuse)
        rows += st.group_rows(model, SEQ, gpus, st.cluster_for(gpus), found[gpus][1].to_dict(),
                              st.sweep_names(model, gpus))
    return model, found, st.sort_rows(rows)


def _fastest_fitting(group: list[dict]) -> str:
    return min((r for r in group if r["fits"] == "true"), key=lambda r: float(r["step_time_s"]))["strategy"]


def test_strategy_table_rows_are_the_registrys_candidates_and_auto_is_the_fastest_that_fits(decided, tmp_path):
    model, _, rows = decided
    assert [st.cluster_for(g) for g in (8, 16, 64)] == ["h100-sxm", "h100-sxm-2x8", "h100-sxm-8x8"]
    tasks = st.strategy_tasks(model=model, lengths=(SEQ,), gpus=GPUS, depth="full")
    assert [args[2:4] for _, args in tasks] == [(16, "h100-sxm-2x8"), (8, "h100-sxm")]  # most ranks first
    for gpus in GPUS:
        group = [r for r in rows if r["gpus"] == gpus]
        names = [r["strategy"] for r in group]
        registry = [s.name for s in sp_candidates(gpus, heads=8, kv_heads=4)]
        assert names == list(dict.fromkeys(["autosp", *registry])) and all(STRATEGIES[n].name == n for n in names)
        assert {STRATEGIES[n].sequence_parallel for n in registry} == {"ulysses", "hybrid", "ring"} - (
            set() if gpus == 8 else {"ulysses"})
        timed = [r for r in group if r["strategy"] in registry]
        assert all(r["fits"] == "true" and float(r["step_time_s"]) > 0 and r["note"] == "" for r in timed)
        chosen = [r["strategy"] for r in group if r["chosen"] == "true"]
        assert chosen == [_fastest_fitting(group)] == [group[0]["auto_choice"]] == [group[0]["sweep_best"]]
        assert {r["auto_within_5pct"] for r in group} == {"true"}
    ulysses, auto = (next(r for r in rows if r["gpus"] == 8 and r[k] == v)
                     for k, v in (("strategy", "autosp"), ("chosen", "true")))
    assert float(auto["auto_vs_ulysses"]) == pytest.approx(
        float(ulysses["step_time_s"]) / float(auto["step_time_s"]), rel=1e-3)
    refused = next(r for r in rows if r["gpus"] == 16 and r["strategy"] == "autosp")
    assert refused["fits"] == "false" and refused["step_time_s"] == "" and refused["note"].startswith("refused: 8")
    s = st.summary(rows)
    assert s["groups"] == s["decided"] == s["auto_within_5pct"] == 2
    assert s["multi_node_vs_ulysses"] == {"128/16": refused["note"]} and s["multi_node_strictly_faster"] == []
    assert any("128 tokens on 16 GPUs: n/a (refused: 8" in line for line in st.footer(s))
    st.plot_strategies(rows, tmp_path / "strategies.png")
    assert (tmp_path / "strategies.png").stat().st_size > 0


def test_strategy_table_a_group_where_nothing_fits_says_so(decided):
    model, found, _ = decided  # the same traces, decided again with room for nothing (TraceReuse)
    reuse, first = found[8]
    none = st.decide(model, SEQ, 8, "h100-sxm", depth="full", reuse=reuse, capacity_bytes=1)
    assert reuse.traces == len([c for c in first.candidates if c.prediction is not None])  # nothing traced again
    rows = st.group_rows(model, SEQ, 8, "h100-sxm", none.to_dict(), st.sweep_names(model, 8))
    assert {(r["fits"], r["auto_choice"], r["sweep_best"], r["chosen"], r["auto_within_5pct"]) for r in rows} == {
        ("false", "none", "none", "false", "")}
    assert st.summary(rows)["none_fit"] == ["128/8"]


def _candidate(system: str, step: float, fits: bool) -> dict:
    return {"system": system, "fits": fits, "step_time_s": step, "peak_bytes": 2**30, "refused": None}


@pytest.mark.parametrize(("chosen", "best", "within", "vs_ulysses"), [
    ("autosp-ring", "autosp-ring", "true", ""),  # Ulysses is faster but does not fit
    ("autosp-hybrid-2x2", "autosp-ring", "false", ""),  # a choice 10 % slower than the sweep's best is flagged
])
def test_strategy_table_sweep_best_counts_only_what_fits_and_flags_a_slow_choice(chosen, best, within, vs_ulysses):
    decision = {"chosen": chosen, "candidates": [_candidate("autosp", 1.0, False),
                                                 _candidate("autosp-hybrid-2x2", 2.2, True),
                                                 _candidate("autosp-ring", 2.0, True)]}
    rows = st.group_rows("m", 64, 4, "h100-sxm", decision, ("autosp", "autosp-hybrid-2x2", "autosp-ring"))
    assert [r["chosen"] for r in rows].count("true") == 1
    assert {(r["sweep_best"], r["auto_within_5pct"], r["auto_vs_ulysses"]) for r in rows} == {(best, within, vs_ulysses)}
    missing = st.group_rows("m", 64, 4, "h100-sxm", decision, ("autosp", "autosp-ring"))
    assert [r["note"] for r in missing][-1] == "not in the registry's sweep"
