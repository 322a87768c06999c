"""The schedule export: compiled AOT graphs -> simulator Workload (FLOPs, lifetimes, JSON round trip)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import autosp
from autosp.costs import attention_flops, attention_scores
from autosp.export import export_workload
from experiments.models import build_model, vocab_size
from simulator import Cluster, Workload, simulate
from simulator.hardware import LinkSpec, get_preset
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


def _forward_end_memory(workload: Workload, cluster: Cluster) -> tuple[int, int]:
    """(device bytes while the forward's last kernel runs, host peak) of ``workload`` simulated on ``cluster``."""
    result = simulate(workload, cluster)
    timeline, ops = result.timelines[0], workload.ranks[0].ops
    end = max(timeline.end_s[i] for i, op in enumerate(ops) if op.phase == "forward" and op.kind == "compute")
    memory = timeline.memory
    return int(memory.total_bytes[np.searchsorted(memory.times_s, end, side="left") - 1]), \
        result.host_peak_memory_bytes


def test_export_activation_offload_moves_saved_activations_to_the_host_pool(aot_graphs):
    """activation_offload="on" (Note [Activation offload in the export]): each offloaded tensor is copied to a host
    tensor on the rank's host stream and back; at the end of the forward the device holds less (the offloaded tensors'
    storage, unless an alias the forward saves keeps it), and the host peak is the bytes the pass moved (every host
    copy lives from its forward copy to its reload in backward).  Copies over an instant host link, so that memory
    is read at program points; their overlap is tests/simulator/test_activation_offload.py's."""
    model = build_model("plain-llama", layers=LAYERS, hidden=64)
    with fake_process_group(WORLD, rank=0):
        compiled = autosp.compile(model, sp_size=WORLD, compiler="aot_eager", activation_offload="on")
        ids, labels = make_sample(SEQ, vocab_size(model), seed=0)
        compiled(**autosp.prepare_inputs(ids, labels=labels)).backward()
    moved = compiled.report.offload_plans[-1]
    assert moved.count > 0
    workload = _export(compiled.report.aot_graphs)
    program = workload.ranks[0]
    starts = [op for op in program.ops if op.kind == "collective_start" and op.collective.group == "host"]
    assert sorted(op.collective.kind for op in starts) == sorted(["to_host", "from_host"] * moved.count)
    assert len([op for op in program.ops if op.kind == "collective_wait" and op.collective.group == "host"]) == \
        moved.count
    assert sum(program.tensors[t] for t in program.host_tensors) == moved.offloaded_bytes
    assert workload.groups["host"] == ((0,), (1,))
    preset = get_preset("h100-sxm")
    instant = Cluster.from_preset(dataclasses.replace(preset, host_memory_link=LinkSpec(
        bandwidth_bytes_per_s=1e30, latency_s=0.0)))
    (on, host), (off, no_host) = _forward_end_memory(workload, instant), _forward_end_memory(_export(aot_graphs), instant)
    assert host == moved.offloaded_bytes and no_host == 0
    assert 0 < off - on <= moved.offloaded_bytes
    assert simulate(workload, Cluster.from_preset(preset)).host_peak_memory_bytes == moved.offloaded_bytes


def _tuple_ops_step():
    """Hand-made AOT graphs: a forward whose multi-output ops' elements die at different times, and the backward
    of its one output (a tangent the size of the output, read by the backward's only op)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    aten = torch.ops.aten

    def forward(x):
        out, _mean, _rstd = aten.native_layer_norm(x, [8], None, None, 1e-5)  # mean and rstd: nobody reads them
        a = out * 2
        var, mean = aten.var_mean(a, [1], correction=0)
        b = a + var.unsqueeze(-1)  # var's last reader
        c = b * 3
        return (c + mean.unsqueeze(-1),)  # mean's last reader

    def backward(tangents_1):
        return (tangents_1 * 2,)

    x = torch.randn(4, 8)
    graphs = make_fx(forward)(x), make_fx(backward)(x)
    for gm in graphs:  # as AOTAutograd's graphs: no getitem of an element nobody reads
        gm.graph.eliminate_dead_code()
    return graphs


def test_export_prices_each_element_of_a_multi_output_op_as_its_own_tensor():
    """Note [Tensor lifetimes in the export]: native_layer_norm's output, mean and rstd and var_mean's two
    outputs are a tensor each; an element nobody reads is freed by its op, the others after their last reader."""
    forward, backward = _tuple_ops_step()
    program = export_workload([("forward", forward), ("backward", backward)], name="tuples", sp_size=1,
                              parameter_bytes=0).ranks[0]
    by_name = {op.name.split(".", 1)[1]: op for op in program.ops if op.phase == "forward"}
    freed_by = {t: name for name, op in by_name.items() for t in op.frees}
    norm, stats = by_name["native_layer_norm"], by_name["var_mean"]
    assert [program.tensors[t] for t in norm.allocates] == [4 * 8 * 4, 4 * 4, 4 * 4]
    assert [program.tensors[t] for t in stats.allocates] == [4 * 4, 4 * 4]
    out, mean, rstd = norm.allocates
    var, mean_of_a = stats.allocates
    assert (freed_by[mean], freed_by[rstd], freed_by[out]) == ("native_layer_norm", "native_layer_norm", "mul")
    assert (freed_by[var], freed_by[mean_of_a]) == ("add", "add_1")


def test_export_prices_the_backward_tangents_and_frees_unheld_outputs_after_the_forward():
    """Note [Outputs and tangents in the export], on the hand-made step: the forward's output (the caller's, not
    saved) is freed by the forward's last op, or never with ``outputs_held``; the backward's tangent is a tensor of
    the output's size allocated by the backward's first op and freed by its last reader."""
    forward, backward = _tuple_ops_step()
    graphs = [("forward", forward), ("backward", backward)]
    dropped, held = (export_workload(graphs, name="tuples", sp_size=1, parameter_bytes=0, outputs_held=h).ranks[0]
                     for h in (False, True))
    ops = dropped.ops
    last_forward = max(i for i, op in enumerate(ops) if op.phase == "forward")
    output = ops[last_forward].allocates[0]
    assert output in ops[last_forward].frees
    assert all(output not in op.frees for op in held.ops)
    first_backward = ops[last_forward + 1]
    tangent = first_backward.allocates[0]
    assert dropped.tensors[tangent] == dropped.tensors[output] == 4 * 8 * 4
    assert tangent in first_backward.frees  # its only reader


def test_export_matches_the_measured_peak_of_a_model_with_unread_outputs():
    """The Hugging Face Llama returns logits and its KV cache beside the loss: the backward takes a zero-filled
    tangent for each (Note [Outputs and tangents in the export]); under per-layer checkpointing the attention runs
    inside an RNG wrapper, a higher-order op whose outputs only its getitems describe.  The simulated peak of the export is
    the peak PeakMemory measures on the same step, with the caller dropping the outputs or holding them."""
    from experiments.cpu.measure import _register_rng_ops_for
    from experiments.cpu.peak_memory import PeakMemory
    from tests.autosp.cases import loss_of

    torch.manual_seed(0)
    model = build_model("hf-llama", layers=LAYERS, hidden=64, kv_heads=4)
    _register_rng_ops_for(PeakMemory)
    measured = {}
    with fake_process_group(WORLD, rank=0):
        compiled = autosp.compile(model, sp_size=WORLD, compiler="aot_eager", checkpointing="layer")
        ids, labels = (t[:1] for t in make_sample(1024, vocab_size(model), seed=0))
        inputs = autosp.prepare_inputs(ids, labels=labels)
        loss_of(compiled(**inputs)).backward()
        params = list(model.parameters())
        for held in (False, True):
            model.zero_grad(set_to_none=False)
            with PeakMemory(static=params + [p.grad for p in params], keep_breakdown=False) as pm:
                out = compiled(**inputs)
                if not held:
                    out = loss_of(out)
                loss_of(out).backward()
            measured[held] = pm.peak_bytes
            loss_bytes = loss_of(out).nbytes
            del out
    parameter_bytes = sum(p.numel() * p.element_size() for p in params)
    # the attention that runs under an RNG wrapper (forward, and recomputed in backward) is priced as attention
    ops = export_workload(compiled.report.aot_graphs, name="hf", sp_size=WORLD, parameter_bytes=0).ranks[0].ops
    wrapped = [op for op in ops if "rng_state" in op.name]
    assert len(wrapped) == 2 * LAYERS and all(op.op_class == "attention" and op.flops > 0 for op in wrapped)
    predicted = {held: simulate(export_workload(
        compiled.report.aot_graphs, name="hf", sp_size=WORLD, parameter_bytes=parameter_bytes,
        optimizer_bytes_per_parameter_byte=0.0, saved_freed_at_last_use=True, outputs_held=held),  # Note [Boxed graphs free their inputs]
        Cluster.from_preset("cpu-gloo")).ranks[0].peak_memory_bytes for held in (False, True)}
    for held in (False, True):
        assert predicted[held] == pytest.approx(measured[held], rel=0.01), held
    # Dropping the outputs, the caller still holds the loss it calls backward on; the export drops it too (a scalar)
    assert predicted[True] - predicted[False] == measured[True] - measured[False] + loss_bytes > loss_bytes


def test_export_prices_the_tiled_mlp_backward_as_the_memory_its_kernel_holds():
    """The tiled MLP's backward over three chunks (96 rows, 32 per chunk), run on real tensors: PeakMemory's peak
    inside the kernel is its outputs plus the one-chunk scratch the export allocates and frees with the op
    (`autosp.costs.workspace_bytes`); a chunk's value kept into the next chunk would be measured above it."""
    from autosp.costs import TILED_MLP, nbytes_of, workspace_bytes
    from autosp.tracing import trace_fake_step
    from experiments.cpu.peak_memory import PeakMemory

    torch._dynamo.reset()
    compiled, _ = trace_fake_step(lambda: build_model("hf-llama", layers=1, vocab=320), seq_len=192, sp_size=2,
                                  vocab_size=320, dtype=torch.float32, tiled_mlp="on", mlp_chunk_tokens=32)
    node = next(n for n in dict(compiled.report.aot_graphs)["backward"].graph.nodes if n.target is TILED_MLP[1])
    torch.manual_seed(0)
    args = [torch.randn(a.meta["val"].shape) if isinstance(a, torch.fx.Node) else a for a in node.args]
    with PeakMemory(keep_breakdown=False) as pm:
        node.target(*args)
    assert pm.peak_bytes == nbytes_of(node.meta["val"]) + workspace_bytes(node)


def test_export_prices_the_tiled_loss_backward_as_the_memory_its_kernel_holds():
    """The tiled loss's backward over token chunks (fp32 weight: 96 rows, 16 per chunk), run on real tensors:
    PeakMemory's peak inside the kernel is its outputs plus the two [chunk, vocab] fp32 buffers the export allocates
    and frees with the op (`autosp.costs.workspace_bytes`), and at most 64 bytes per chunk row more: the targets'
    index and mask temporaries of `autosp.tiled_ops._grad_logits` (a few int64 and bool values per row: 784 bytes
    here), which the export leaves unpriced.  A [vocab, hidden] product made per chunk before it is added to the
    weight's gradient (81,920 bytes here; the kernel used to make one) would be measured far above."""
    from autosp.costs import TILED_LOSS, nbytes_of, workspace_bytes
    from autosp.tracing import trace_fake_step
    from experiments.cpu.peak_memory import PeakMemory

    torch._dynamo.reset()
    compiled, _ = trace_fake_step(lambda: build_model("hf-llama", layers=1, vocab=320), seq_len=192, sp_size=2,
                                  vocab_size=320, dtype=torch.float32, tiled_loss="on", loss_chunk_tokens=16,
                                  return_logits=False)
    node = next(n for n in dict(compiled.report.aot_graphs)["backward"].graph.nodes if n.target is TILED_LOSS[1])
    torch.manual_seed(0)
    args = []
    for a in node.args:
        val = a.meta["val"] if isinstance(a, torch.fx.Node) else None
        if val is None:
            args.append(a)
        elif val.dtype in (torch.int64, torch.int32):  # the targets: classes of the vocabulary
            args.append(torch.randint(0, 320, val.shape, dtype=val.dtype))
        else:
            args.append(torch.randn(val.shape, dtype=val.dtype))
    with PeakMemory(keep_breakdown=False) as pm:
        node.target(*args)
    priced = nbytes_of(node.meta["val"]) + workspace_bytes(node)
    assert priced <= pm.peak_bytes <= priced + 64 * 16, (pm.peak_bytes, priced)
