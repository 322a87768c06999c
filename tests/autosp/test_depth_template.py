"""The planner's fast decisions: shallow traces checkpointed as the full model (Note [Shallow traces checkpointed for
the full depth] in autosp/plan/depth.py).

A six-layer Llama config (hidden 64, so q/k/v/o, gate and up tie in SAC's cost per byte) on fake tensors over 2 SP
ranks: SAC's decision synthesised from a two-layer joint graph equals, layer by layer, the decision SAC takes on the
six-layer graph itself, and the extrapolated prediction is within a stated tolerance of the full-depth one.  The
8B comparisons are in experiments/bench_planner.py --compare.
"""

from __future__ import annotations

import json

import pytest

from autosp.joint_template import partition_at
from autosp.passes.joint.checkpointing import choose_recomputation, tag_recomputation
from autosp.plan import TrainingSetup, load_cluster, predict
from autosp.plan.depth import FullDepthTagger, _matmuls, _split
from autosp.plan.model_source import ModelSource
from autosp.plan.predict import _Captured, trace_step

LAYERS = 6
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 4096, "attention_dropout": 0.0, "tie_word_embeddings": False,
}
SETUP = TrainingSetup(seq_len=512, sp_size=2, compiler="aot_eager")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama6") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


def _capture(model: str, layers: int | None):
    source = ModelSource(model)
    hf = source.config(seq_len=SETUP.seq_len)
    into = _Captured()
    trace_step(source, SETUP, seq_len=SETUP.seq_len, layers=layers, options={}, capture_into=into,
               config=SETUP.training_config(source.parameter_numels(hf)))
    return into


def test_sac_decision_from_two_layers_is_the_full_models(model):
    full, two = _capture(model, None), _capture(model, 2)
    limit = full.facts.compiled_with.sac_recompute_limit
    seen = {}

    def own(candidates, flops):  # SAC on the six-layer graph itself, recording what it decided per layer
        chosen = choose_recomputation(candidates.values(), forward_flops=sum(flops.values()), recompute_limit=limit,
                                      memory_budget=None)
        layers, outside = _split(candidates)
        seen["per_layer"] = tuple(frozenset(p for p, c in enumerate(_matmuls(layers[j])) if c.name in chosen)
                                  for j in range(LAYERS))
        seen["outside"] = frozenset(i for i, c in enumerate(_matmuls(outside)) if c.name in chosen)
        return chosen

    partition_at(full.capture, full.facts.compiled_with, tag_joint=lambda g: tag_recomputation(
        g, setting="sac", recompute_limit=limit, memory_budget=None, decide=own))
    tags = FullDepthTagger(model_layers=LAYERS, recompute_limit=limit, memory_budget=None)
    partition_at(two.capture, two.facts.compiled_with, tag_joint=tags.tagger("every"))
    decision = tags.decision
    assert (decision.per_layer, decision.outside) == (seen["per_layer"], seen["outside"])
    # the budget ends inside a tie: layers differ, so two programs bracket the full one
    assert decision.every != decision.some and 0 < decision.share < 1


def test_extrapolated_prediction_is_within_tolerance_of_the_full_depth(model):
    cluster = load_cluster("h100-sxm", world_size=SETUP.world_size)
    full = predict(model, SETUP, cluster)
    fast = predict(model, TrainingSetup(**{**SETUP.__dict__, "depth": "extrapolated"}), cluster)
    assert full.step.extrapolated_from is None and fast.step.extrapolated_from == (1, 2)
    # measured: activations +6.7 %, peak +0.01 %, step +1.4 % (at this toy size the fixed costs weigh most); the
    # activations were -2.8 % while aot_eager was priced holding the saved tensors to the end of the backward, before
    # Note [Boxed graphs free their inputs] (autosp/backend.py): freed at their last reader, the peak is not linear
    # in the depth the way the held tensors were
    assert fast.step.dynamic_memory_bytes == pytest.approx(full.step.dynamic_memory_bytes, rel=0.08)
    assert fast.peak_bytes == pytest.approx(full.peak_bytes, rel=0.01)
    assert fast.step.step_time_s == pytest.approx(full.step.step_time_s, rel=0.03)
