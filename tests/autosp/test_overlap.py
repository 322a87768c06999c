"""Overlap of the all-to-alls: start/wait placement in the real partitioned graphs of a small model."""

from __future__ import annotations

import torch

import autosp
from autosp.passes.partitioned.overlap import overlapped_compute
from experiments.models import build_model, vocab_size
from tests.autosp.cases import make_sample
from tests.harness import fake_process_group

A2A_START = torch.ops.autosp_testbed.all_to_all_start.default
A2A_WAIT = torch.ops.autosp_testbed.all_to_all_wait.default
LAYERS = 2


def _graphs(model_name: str):
    model = build_model(model_name, layers=LAYERS, hidden=64)
    with fake_process_group(2, rank=1):
        compiled = autosp.compile(model, sp_size=2, compiler="aot_eager", overlap_communication=True)
        ids, labels = make_sample(32, vocab_size(model), seed=0)
        out = compiled(**autosp.prepare_inputs(ids, labels=labels))
        (out if isinstance(out, torch.Tensor) else out.loss).backward()
    return dict(compiled.report.aot_graphs)


def test_overlap_starts_before_and_waits_after_independent_compute():
    graphs = _graphs("hf-llama")
    for gm in graphs.values():
        nodes = list(gm.graph.nodes)
        for start in (n for n in nodes if n.target is A2A_START):
            (wait,) = start.users  # only the wait reads the in-flight buffer
            assert wait.target is A2A_WAIT and nodes.index(start) < nodes.index(wait)
            # started as soon as its input exists, waited right before its first reader
            assert nodes[nodes.index(start) - 1] in (start.args[0], *[n for n in nodes if n.op == "placeholder"])
            next_reader = next(n for n in nodes[nodes.index(wait) + 1 :] if n.target is not A2A_WAIT)
            assert next_reader in wait.users
    forward_overlap = overlapped_compute(graphs["forward"])
    backward_overlap = overlapped_compute(graphs["backward"])
    assert len(forward_overlap) == len(backward_overlap) == 4 * LAYERS
    # forward: in every layer the q/k all-to-alls travel while later projections and rotary compute
    assert sum(1 for n in forward_overlap if n > 0) >= 2 * LAYERS
    # backward: at least one all-to-all per layer hides behind independent gradient computation
    assert sum(1 for n in backward_overlap if n > 0) >= LAYERS


def test_overlap_exported_schedule_has_matching_start_and_wait():
    from autosp.export import export_workload

    graphs = _graphs("plain-llama")
    workload = export_workload(list(graphs.items()), name="overlap", sp_size=2, parameter_bytes=1)
    ops = workload.ranks[0].ops
    starts = {op.collective.key: op for op in ops if op.kind == "collective_start"}
    waits = {op.collective.key: op for op in ops if op.kind == "collective_wait"}
    assert len(starts) == 8 * LAYERS and starts.keys() == waits.keys()
    for key, start in starts.items():
        wait = waits[key]
        assert start.id in wait.deps and start.id < wait.id
        assert start.collective.kind == "all_to_all" and start.collective.message_bytes > 0
    assert any(waits[k].id - s.id > 1 for k, s in starts.items())  # compute issued in between


def test_overlap_in_a_forward_compiled_without_backward():
    """Under ``no_grad`` AOTAutograd compiles the forward alone, without a partition (its inference path): the
    overlap pass rewrites it there (`autosp.backend.rewrite_inference`), as the pair's rewrites do in training."""
    model = build_model("hf-llama", layers=1, hidden=64)
    with fake_process_group(2, rank=1), torch.no_grad():
        compiled = autosp.compile(model, sp_size=2, compiler="aot_eager", overlap_communication=True)
        ids, labels = make_sample(32, vocab_size(model), seed=0)
        compiled(**autosp.prepare_inputs(ids, labels=labels))
    ((kind, gm),) = compiled.report.aot_graphs
    assert kind == "forward" and compiled.report.joint_graphs == 0
    assert len(overlapped_compute(gm)) == 4  # q, k, v and the output all-to-all of the one layer
