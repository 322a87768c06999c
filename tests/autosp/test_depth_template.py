"""The planner's fast decisions: shallow traces checkpointed as the full model (Note [Shallow traces checkpointed for
the full depth] in autosp/plan/depth.py).

A six-layer Llama config (hidden 64, so q/k/v/o, gate and up tie in SAC's cost per byte) on fake tensors over 2 SP
ranks: SAC's decision synthesised from a two-layer joint graph equals, layer by layer, the decision SAC takes on the
six-layer graph itself, and the extrapolated prediction is within a stated tolerance of the full-depth one.  The
8B comparisons are in experiments/bench_planner.py --compare.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils import _pytree as pytree

from autosp.export import export_workload
from autosp.joint_template import partition_at, propagate_fake
from autosp.passes.graph_utils import graph_copy
from autosp.passes.joint.checkpointing import choose_recomputation, tag_recomputation
from autosp.plan import TrainingSetup, load_cluster, predict
from autosp.plan.depth import FullDepthTagger, _matmuls, _split
from autosp.plan.model_source import ModelSource
from autosp.plan.traces import CaptureKeeper, trace_step

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
    into = CaptureKeeper()
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


@pytest.mark.parametrize("layers", [1, 2])
def test_a_traced_joint_graph_partitions_on_its_traces_fake_tensors_as_on_propagated_ones(model, layers):
    """Note [The trace's fake tensors] in autosp/joint_template.py: a capture keeps its trace's fake mode and
    inputs, and `propagate_fake` hands them back; every node's value equals a fresh propagation's, and the
    partition (SAC) exports to the same workload."""
    captured = _capture(model, layers)
    capture, config = captured.capture, captured.facts.compiled_with
    assert capture.traced is not None and propagate_fake(capture) is capture.traced

    def copied():  # node metadata copied per node (shallow), as the planner's per-pattern copies are
        return dataclasses.replace(capture, graph=graph_copy(capture.graph))

    fresh = dataclasses.replace(copied(), traced=None)
    propagate_fake(fresh)
    def described(value):  # a tensor's shape, strides and dtype; other values as they are
        return pytree.tree_map(lambda v: (v.shape, v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v, value)

    for ours, theirs in zip(capture.graph.graph.nodes, fresh.graph.graph.nodes, strict=True):
        assert described(ours.meta.get("val")) == described(theirs.meta.get("val")), ours.name
        if isinstance(ours.meta.get("val"), torch.Tensor):
            # requires_grad aside: the trace's parameters require grad (Note [The trace's fake tensors])
            assert ours.meta["tensor_meta"]._replace(requires_grad=False) == \
                theirs.meta["tensor_meta"]._replace(requires_grad=False), ours.name

    def exported(joint):  # the trace's own SAC tags
        report = partition_at(joint, config, propagated=propagate_fake(joint))
        return export_workload(report.aot_graphs, name="traced", sp_size=SETUP.sp_size, parameter_bytes=0)

    assert exported(copied()) == exported(fresh)


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
