"""strategy="auto" in the planner: each strategy the pass compiles traced, exported and simulated on its own, the
fastest that fits chosen (`autosp.plan.predict.choose_strategy`, ``python -m autosp.plan --strategy auto``).

A one-layer Llama config (4 heads, 2 key/value heads) on one simulated H100 node: SP 2 x DP 2, where both
strategies run, and SP 3, where Ulysses cannot (4 heads over 3 ranks) and ring is chosen.
"""

from __future__ import annotations

import json

import pytest

from autosp.errors import AutoSPError
from autosp.plan import TrainingSetup, load_cluster
from autosp.plan.__main__ import build_parser, main
from autosp.plan.predict import AUTO_STRATEGIES, STRATEGY_CHOICES, TraceReuse, choose_strategy
from simulator.strategies import SEQUENCE_PARALLEL
from simulator.workload import COMPILED_STRATEGIES

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 4096, "attention_dropout": 0.0, "tie_word_embeddings": False,
}
SEQ, CLUSTER = 96, "h100-sxm"


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


@pytest.fixture(scope="module")
def decided(llama_config):
    setup = TrainingSetup(seq_len=SEQ, sp_size=2, dp_size=2, zero_stage=2)
    cluster, reuse = load_cluster(CLUSTER, world_size=setup.world_size), TraceReuse([])
    return setup, cluster, reuse, choose_strategy(llama_config, setup, cluster, reuse=reuse)


def test_strategy_auto_choices_are_the_registrys():
    assert STRATEGY_CHOICES == (*AUTO_STRATEGIES, "auto") and set(AUTO_STRATEGIES) <= set(COMPILED_STRATEGIES) and set(STRATEGY_CHOICES) <= set(SEQUENCE_PARALLEL)
    assert build_parser().parse_args(["--model", "tiny-llama", "--cluster", CLUSTER, "--seq-len", "64",
                                      "--strategy", "ring"]).strategy == "ring"


def test_strategy_auto_simulates_each_strategy_on_its_own_trace_and_picks_the_argmin(decided):
    setup, _, _, decision = decided
    by_name = {c.strategy: c for c in decision.candidates}
    assert list(by_name) == list(AUTO_STRATEGIES) and all(c.prediction is not None for c in by_name.values())
    ulysses, ring = (by_name[s].prediction.step.simulated for s in ("ulysses", "ring"))
    # Ulysses' symmetric program collapses to one simulated rank; the ring's names its neighbours: every rank.
    assert ulysses.collapsed and not ring.collapsed and len(ring.simulated_ranks) == setup.world_size
    assert ulysses.step_time_s != ring.step_time_s
    times = {c.strategy: c.prediction.step.step_time_s for c in decision.candidates if c.fits}
    assert times and decision.chosen == min(times, key=times.get)
    assert decision.prediction is by_name[decision.chosen].prediction
    assert decision.options == {"strategy": decision.chosen}
    text = decision.format()
    assert all(f"{c.prediction.step.step_time_s * 1e3:10.3f}" in text for c in decision.candidates)
    assert decision.to_dict()["chosen"] == decision.chosen


def test_strategy_auto_chooses_only_among_strategies_that_fit(decided, llama_config):
    setup, cluster, reuse, decision = decided
    peaks = {c.strategy: c.prediction.peak_bytes for c in decision.candidates}
    times = {c.strategy: c.prediction.step.step_time_s for c in decision.candidates}
    assert len(set(peaks.values())) == len(peaks)  # the capacities below separate the candidates
    for capacity in sorted({p + delta for p in peaks.values() for delta in (-1, 0)}):
        again = choose_strategy(llama_config, setup, cluster, reuse=reuse, capacity_bytes=capacity)
        fitting = [s for s in times if peaks[s] <= capacity]
        assert again.chosen == (min(fitting, key=times.get) if fitting else None)
        assert [c.fits for c in again.candidates] == [peaks[c.strategy] <= capacity for c in again.candidates]
        if not fitting:
            with pytest.raises(AutoSPError, match="no strategy fits"):
                _ = again.options


def test_strategy_auto_chooses_ring_when_heads_do_not_divide_over_the_ranks(llama_config, tmp_path):
    out = tmp_path / "auto.json"
    argv = ["--model", llama_config, "--cluster", CLUSTER, "--seq-len", str(SEQ), "--sp-size", "3",
            "--strategy", "auto", "--json", str(out), "-q"]
    assert main(argv) == 0
    answer = json.loads(out.read_text())
    by_name = {c["strategy"]: c for c in answer["candidates"]}
    assert "4 attention heads are not divisible by sp_size 3" in by_name["ulysses"]["refused"]
    assert by_name["ring"]["step_time_s"] > 0 and by_name["ring"]["fits"]
    assert answer["chosen"] == "ring" and answer["prediction"]["setup"]["sp_size"] == 3
