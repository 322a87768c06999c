"""The schedule export: compiled AOT graphs -> simulator Workload (FLOPs, lifetimes, JSON round trip)."""

from __future__ import annotations

import pytest
import torch

import autosp
from autosp.costs import attention_flops, attention_scores
from autosp.export import export_workload
from experiments.models import build_model, vocab_size
from simulator import Cluster, Workload, simulate
from tests.autosp.cases import make_sample
from tests.harness import fake_process_group

SEQ, WORLD, LAYERS = 64, 2, 2


@pytest.fixture(scope="module")
def aot_graphs():
    model = build_model("plain-llama", layers=LAYERS, hidden=64)
    with fake_process_group(WORLD, rank=0):
        compiled = autosp.compile(model, sp_size=WORLD, compiler="aot_eager")
        ids, labels = make_sample(SEQ, vocab_size(model), seed=0)
        compiled(**autosp.prepare_inputs(ids, labels=labels)).backward()
    return compiled.report.aot_graphs


def _export(aot_graphs, **kwargs) -> Workload:
    return export_workload(aot_graphs, name="tiny", sp_size=WORLD, parameter_bytes=1000, **kwargs)


def test_export_attention_flops_are_counted_causal_over_the_full_sequence(aot_graphs):
    ops = _export(aot_graphs).ranks[0].ops
    forward = [op for op in ops if op.op_class == "attention" and op.phase == "forward"]
    assert len(forward) == LAYERS
    # plain-llama: batch 2, 4 heads over 2 ranks, head dim 16; each rank attends over the full sequence
    expected = attention_flops((2, 2, SEQ, 16), (2, 2, SEQ, 16), causal=True, backward=False)
    assert all(op.flops == expected for op in forward)
    assert attention_flops((1, 1, 8, 4), (1, 1, 8, 4), causal=False, backward=False) == 4 * 8 * 8 * 4


def test_export_attention_ops_carry_their_scores_forward_and_backward(aot_graphs):
    ops = _export(aot_graphs).ranks[0].ops
    scores = attention_scores((2, 2, SEQ, 16), (2, 2, SEQ, 16), causal=True, backward=False)
    assert scores == 2 * 2 * SEQ * SEQ // 2
    by_phase = {phase: [op.attention_scores for op in ops if op.op_class == "attention" and op.phase == phase]
                for phase in ("forward", "backward")}
    assert by_phase == {"forward": [scores] * LAYERS, "backward": [int(scores * 2.5)] * LAYERS}
    assert all(op.attention_scores == 0 for op in ops if op.op_class != "attention")


def test_export_round_trips_through_json(aot_graphs, tmp_path):
    workload = _export(aot_graphs)
    workload.to_json(tmp_path / "w.json")
    again = Workload.from_json(tmp_path / "w.json")
    assert again.to_dict() == workload.to_dict()


def test_export_holding_saved_activations_to_the_end_of_backward_raises_memory_only_there(aot_graphs):
    cluster = Cluster.from_preset("cpu-gloo")
    freed = simulate(_export(aot_graphs), cluster).ranks[0]
    held_workload = _export(aot_graphs, saved_freed_at_last_use=False)
    held = simulate(held_workload, cluster).ranks[0]
    assert held.peak_memory_bytes >= freed.peak_memory_bytes
    # every tensor the forward hands to the backward is freed by the backward's last op
    ops = held_workload.ranks[0].ops
    last = ops[-1]
    forward_tensors = {t for op in ops if op.phase == "forward" for t in op.allocates}
    backward_frees = {t for op in ops if op.phase == "backward" for t in op.frees}
    carried = forward_tensors & backward_frees
    assert carried and carried <= set(last.frees)


def test_export_refuses_graphs_without_a_backward():
    with pytest.raises(ValueError, match="backward"):
        export_workload([("forward", torch.fx.symbolic_trace(torch.nn.Identity()))], name="x", sp_size=2,
                        parameter_bytes=0)
