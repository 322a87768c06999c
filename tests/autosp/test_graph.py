"""Graph structure of the AutoSP program, traced on a fake multi-rank group in one process."""

from __future__ import annotations

import pytest
import torch

import autosp
from experiments.models import build_model, vocab_size
from tests.autosp.cases import make_sample
from tests.harness import fake_process_group

A2A = torch.ops.autosp_testbed.all_to_all.default
ALL_REDUCE = torch.ops.autosp_testbed.all_reduce_sum.default
A2A_START = torch.ops.autosp_testbed.all_to_all_start.default
A2A_WAIT = torch.ops.autosp_testbed.all_to_all_wait.default


def _compile_and_step(model_name: str, *, world: int, seq_len: int, rank: int = 1, options=None, **overrides):
    model = build_model(model_name, **overrides)
    with fake_process_group(world, rank=rank):
        compiled = autosp.compile(model, sp_size=world, compiler="aot_eager", **(options or {}))
        ids, labels = make_sample(seq_len, vocab_size(model), seed=0)
        out = compiled(**autosp.prepare_inputs(ids, labels=labels))
        (out if isinstance(out, torch.Tensor) else out.loss).backward()
    graphs = {kind: gm for kind, gm in compiled.report.aot_graphs}
    return compiled, graphs["forward"], graphs["backward"]


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
@pytest.mark.parametrize("model_name", ["plain-llama", "hf-llama", "hf-gpt2"])
def test_graph_four_all_to_alls_per_attention_layer_forward_and_backward(model_name, overlap):
    layers = 2
    compiled, forward, backward = _compile_and_step(model_name, world=4, seq_len=64, layers=layers,
                                                    options={"overlap_communication": overlap})
    assert len(compiled.report.attention_sites) == layers
    blocking, started = (0, 4 * layers) if overlap else (4 * layers, 0)
    for graph in (forward, backward):
        # Backward: exactly the four all-to-alls' own gradients; none of forward's recomputed.
        assert (_count(graph, A2A), _count(graph, A2A_START), _count(graph, A2A_WAIT)) == (blocking, started, started)
    assert _count(forward, ALL_REDUCE) == 1  # the exact loss


def test_graph_all_to_alls_not_recomputed_under_min_cut_partitioner():
    # Inductor's partitioner recomputes cheap ops in backward; the collectives must not be among them.
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from autosp.context import TraceContext
    from autosp.pipeline import run_passes

    model = build_model("plain-llama", layers=2)
    graphs = {}

    with fake_process_group(2, rank=0) as group:
        ctx = TraceContext(sp_size=2, sp_rank=0, group_name=group.group_name, ignore_index=-100)

        def record(kind):
            def compiler(gm, inputs):
                graphs[kind] = gm
                return make_boxed_func(gm.forward)
            return compiler

        def backend(gm, example_inputs):
            gm = run_passes(gm, example_inputs, ctx=ctx)
            return aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"),
                                partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)

        ids = torch.randint(0, 256, (1, 16))
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        compiled(input_ids=ids[:, :8]).sum().backward()
    assert _count(graphs["forward"], A2A) == 8 and _count(graphs["backward"], A2A) == 8


def _full_sequence_square_nodes(gm, seq_len: int) -> list[str]:
    found = []
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and sum(1 for d in value.shape if d >= seq_len) >= 2:
            found.append(f"{node.name}{tuple(value.shape)}")
    return found


@pytest.mark.parametrize("model_name", ["plain-llama", "hf-llama"])
def test_graph_nothing_of_size_s_by_s_per_rank(model_name):
    seq_len = 128
    _, forward, backward = _compile_and_step(model_name, world=4, seq_len=seq_len, hidden=32, vocab=64)
    assert _full_sequence_square_nodes(forward, seq_len) == []
    assert _full_sequence_square_nodes(backward, seq_len) == []


def test_graph_shapes_are_local_except_inside_attention():
    seq_len, world = 64, 4
    compiled, forward, _ = _compile_and_step("plain-llama", world=world, seq_len=seq_len,
                                             options={"overlap_communication": False})
    gathered = [n for n in forward.graph.nodes if n.op == "call_function" and n.target == A2A]
    q_in = gathered[0].args[0].meta["val"]
    q_out = gathered[0].meta["val"]
    assert q_in.shape[2] == seq_len // world and q_out.shape[2] == seq_len  # [B, H, S/P, D] -> [B, H/P, S, D]
    assert q_out.shape[1] == q_in.shape[1] // world
    embedding_out = [n for n in forward.graph.nodes if "embedding" in str(n.target)][0].meta["val"]
    assert embedding_out.shape[1] == seq_len // world


def test_graph_positions_built_by_the_model_start_at_the_shard_offset():
    compiled, _, _ = _compile_and_step("plain-llama", world=4, seq_len=64, rank=2)
    dynamo_graph = compiled.report.forward_graphs[-1]
    aranges = [n for n in dynamo_graph.graph.nodes if n.target is torch.arange]
    bounds = {tuple(a.args) for a in aranges}
    assert (32, 48) in bounds  # rank 2 of 4 holds tokens 32..47


def test_dead_code_elimination_keeps_a_write_into_an_input_and_drops_what_writes_nothing():
    """Dynamo records ``mask.scatter_(1, index, 1)`` written as a statement as a node nobody uses (later reads use
    ``mask``'s own node): FX's own dead-code test would drop it and the program would read the unwritten mask.
    ``operator.and_`` only looks like an in-place name."""
    import operator

    from torch import fx

    from autosp.passes.graph_utils import eliminate_dead_code

    graph = fx.Graph()
    x, index = graph.placeholder("x"), graph.placeholder("index")
    mask = graph.call_function(torch.zeros_like, (x,))
    graph.call_method("scatter_", (mask, 1, index, 1))
    graph.call_function(operator.iadd, (mask, x))
    graph.call_function(torch.add, (x, 1), {"out": mask})
    graph.call_function(operator.and_, (x, x))
    graph.call_function(torch.mul, (x, 3))
    graph.output(graph.call_function(torch.mul, (mask, 2)))
    assert eliminate_dead_code(graph)
    assert [n.name for n in graph.nodes if n.op == "call_function" or n.op == "call_method"] == [
        "zeros_like", "scatter_", "iadd", "add", "mul_1"]
