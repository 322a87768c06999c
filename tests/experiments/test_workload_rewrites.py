"""The ZeRO-3 and ring-attention workload rewrites (simulator.workload_rewrites) and the module map they use."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from autosp.export import ModuleParameters
from simulator import Cluster, simulate, validate_workload
from simulator.workload import Collective, Op, RankProgram, StaticMemory, Workload
from simulator.workload_rewrites import kv_chunk_bytes, ring_workload, zero3_workload

P = 4
Q_BYTES, KV_BYTES, OUT_BYTES = 4096, 1024, 4096  # per rank: q has 4x the heads of k and v (GQA)
ATTENTION_FLOPS = 10_000_003  # not a multiple of P: the remainder must not be lost


def _ulysses_toy(layers: int = 2, *, blocking: bool = True) -> Workload:
    """A Ulysses-shaped step: per layer q/k/v projections, all-to-alls, attention, all-to-all back; and the
    backward mirror image.  Every op allocates its output; attention frees its inputs in backward."""
    ops: list[Op] = []
    tensors: dict[int, int] = {}

    def op(name, phase, *, deps=(), op_class="other", flops=0, size=0, frees=(), a2a=None):
        tid = None
        if size:
            tid = len(tensors)
            tensors[tid] = size
        kind = "compute"
        collective = None
        if a2a is not None:
            kind = "collective" if blocking else "collective_start"
            collective = Collective(kind="all_to_all", group="sp", message_bytes=a2a, key=f"{phase}.{name}")
        scores = flops // (4 * 16) if op_class == "attention" else 0  # head dim 16: 4·16 FLOPs per score
        ops.append(Op(id=len(ops), name=f"{phase}.{name}", kind=kind, op_class=op_class, phase=phase, flops=flops,
                      attention_scores=scores, bytes_read=size, bytes_written=size, deps=tuple(deps),
                      allocates=(tid,) if tid is not None else (),
                      frees=tuple(frees), collective=collective))
        if not blocking and a2a is not None:
            ops.append(Op(id=len(ops), name=f"{phase}.{name}.wait", kind="collective_wait", phase=phase,
                          collective=collective))
        return len(ops) - 1 if blocking or a2a is None else len(ops) - 2, tid

    saved = []
    for layer in range(layers):
        proj = [op(f"proj{layer}_{x}", "forward", op_class="matmul", flops=1000, size=s)
                for x, s in (("q", Q_BYTES), ("k", KV_BYTES), ("v", KV_BYTES))]
        a2as = [op(f"a2a{layer}_{x}", "forward", deps=(p[0],), size=p_size, a2a=p_size, frees=(p[1],))
                for (x, p_size), p in zip((("q", Q_BYTES), ("k", KV_BYTES), ("v", KV_BYTES)), proj, strict=True)]
        attention = op(f"attention{layer}", "forward", deps=[a[0] for a in a2as], op_class="attention",
                       flops=ATTENTION_FLOPS, size=OUT_BYTES)
        op(f"a2a{layer}_out", "forward", deps=(attention[0],), size=OUT_BYTES, a2a=OUT_BYTES)
        saved.append([a[1] for a in a2as] + [attention[1]])
    for layer in reversed(range(layers)):
        grad = op(f"a2a{layer}_grad", "backward", size=OUT_BYTES, a2a=OUT_BYTES)
        attention = op(f"attention{layer}_backward", "backward", deps=(grad[0],), op_class="attention",
                       flops=int(2.5 * ATTENTION_FLOPS), size=Q_BYTES + 2 * KV_BYTES, frees=saved[layer] + [grad[1]])
        for x in ("q", "k", "v"):
            op(f"a2a{layer}_d{x}", "backward", deps=(attention[0],), size=KV_BYTES, a2a=KV_BYTES)
    program = RankProgram(ops=tuple(ops), tensors=tensors, static_memory=StaticMemory(parameter_bytes=1 << 20))
    return Workload(name="toy-ulysses", world_size=P, groups={"sp": [list(range(P))]}, ranks={0: program},
                    symmetric=True)


def _attention_flops(program: RankProgram) -> Counter:
    """(phase, "flops" | "scores") -> total over the program's attention ops."""
    attention = [op for op in program.ops if op.op_class == "attention"]
    return Counter({(phase, what): sum(getattr(op, field) for op in attention if op.phase == phase)
                    for phase in ("forward", "backward")
                    for what, field in (("flops", "flops"), ("scores", "attention_scores"))})


def test_ring_rewrite_preserves_every_attention_flop_and_splits_each_attention_in_p_chunks():
    source = _ulysses_toy()
    ring = ring_workload(source)
    for rank in range(P):
        program = ring.program(rank)
        assert _attention_flops(program) == _attention_flops(source.program(0))
        chunks = Counter(op.name.rsplit(".chunk", 1)[0] for op in program.ops if ".chunk" in op.name)
        assert set(chunks.values()) == {P} and len(chunks) == 4  # two layers, forward and backward


def test_ring_rewrite_sends_p_minus_one_kv_chunks_per_attention_to_the_next_rank():
    ring = ring_workload(_ulysses_toy(layers=2))
    for rank in range(P):
        starts = [op for op in ring.program(rank).ops if op.kind == "collective_start"]
        assert not any(op.collective.kind == "all_to_all" for op in ring.program(rank).ops if op.collective)
        kv = Counter((op.phase, op.collective.kind) for op in starts if ".kv" in op.name)
        dkv = Counter((op.phase, op.collective.kind) for op in starts if ".dkv" in op.name)
        # two attentions per phase: P-1 K,V transfers each; backward also P dK,dV transfers each
        assert kv == {("forward", "send"): 2 * (P - 1), ("forward", "recv"): 2 * (P - 1),
                      ("backward", "send"): 2 * (P - 1), ("backward", "recv"): 2 * (P - 1)}
        assert dkv == {("backward", "send"): 2 * P, ("backward", "recv"): 2 * P}
        for op in starts:
            expected = (rank + 1) % P if op.collective.kind == "send" else (rank - 1) % P
            assert op.collective.peer == expected
            assert op.collective.message_bytes == (2 * KV_BYTES if ".kv" in op.name else 4 * KV_BYTES)


def test_ring_rewrite_validates_simulates_and_keeps_the_receive_buffers_in_memory():
    source = _ulysses_toy()
    ring = ring_workload(source)
    validate_workload(ring)
    assert kv_chunk_bytes(source) == [2 * KV_BYTES, 2 * KV_BYTES]
    extra = sum(ring.program(0).tensors.values()) - sum(source.program(0).tensors.values())
    accumulator = 4 * (Q_BYTES // 2)  # fp32 output (forward) or dQ (backward) accumulator, bf16 elements
    per_forward = 2 * (2 * KV_BYTES) + accumulator
    per_backward = 2 * (2 * KV_BYTES) + 2 * (4 * KV_BYTES) + accumulator
    assert extra == 2 * (per_forward + per_backward)
    cluster = Cluster.from_preset("a100-80gb-sxm")
    result = simulate(ring, cluster)
    assert len(result.ranks) == P and math.isfinite(result.step_time_s) and result.step_time_s > 0
    assert not result.collapsed  # peers are absolute ranks: every rank simulated


def test_ring_rewrite_models_the_online_softmax_merge_and_the_gradient_sums():
    source = _ulysses_toy()
    ring = ring_workload(source)
    ulysses_s = simulate(source, Cluster.from_preset("a100-80gb-sxm")).step_time_s
    for rank in range(P):
        ops = ring.program(rank).ops
        kinds = Counter((op.phase, op.name.rsplit(".", 1)[-1].rstrip("0123456789")) for op in ops
                        if op.op_class == "elementwise")
        # per attention: P-1 merges and a final cast forward; P accumulations and a final cast backward
        assert kinds == {("forward", "merge"): 2 * (P - 1), ("forward", "finalize"): 2,
                         ("backward", "accumulate"): 2 * P, ("backward", "finalize"): 2}
        merge = next(op for op in ops if op.name.endswith(".merge1"))
        assert merge.bytes_written == 4 * (Q_BYTES // 2) and merge.flops > 0
        by_id = {op.id: op for op in ops}
        for op in ops:  # every dK,dV send waits for its chunk's accumulation
            if op.kind == "collective_start" and ".dkv" in op.name and op.collective.kind == "send":
                assert any(by_id[d].name.rsplit(".", 1)[-1].startswith("accumulate") for d in op.deps)
    assert simulate(ring, Cluster.from_preset("a100-80gb-sxm")).step_time_s > 0 and ulysses_s > 0


def test_ring_rewrite_refuses_split_all_to_alls():
    with pytest.raises(ValueError, match="overlap_communication=False"):
        ring_workload(_ulysses_toy(blocking=False))


# --- ZeRO-3 ---------------------------------------------------------------------------------------------------


def _single_device_toy() -> tuple[Workload, list[ModuleParameters]]:
    """embedding -> two layers (two matmuls each) -> head; backward in reverse, one gradient per module."""
    ops, tensors = [], {}

    def op(name, phase, deps=(), flops=100, size=64):
        tid = len(tensors)
        tensors[tid] = size
        ops.append(Op(id=len(ops), name=f"{phase}.{name}", kind="compute", op_class="matmul", phase=phase,
                      flops=flops, bytes_read=size, bytes_written=size, deps=tuple(deps), allocates=(tid,)))
        return len(ops) - 1

    previous = op("embedding", "forward")
    for layer in range(2):
        previous = op(f"mm{layer}a", "forward", (previous,))
        previous = op(f"mm{layer}b", "forward", (previous,))
    previous = op("head", "forward", (previous,))
    previous = op("head_grad", "backward", (previous,))
    for layer in reversed(range(2)):
        previous = op(f"mm{layer}b_input_grad", "backward", (previous,))
        op(f"mm{layer}_weight_grad", "backward", (previous,), size=1000)
        previous = op(f"mm{layer}a_input_grad", "backward", (previous,))
    op("embedding_grad", "backward", (previous,), size=2000)
    program = RankProgram(ops=tuple(ops), tensors=tensors,
                          static_memory=StaticMemory(parameter_bytes=8000, gradient_bytes=8000, optimizer_bytes=48000))
    workload = Workload(name="toy-single", world_size=1, groups={"sp": [[0]]}, ranks={0: program}, symmetric=True)
    modules = [ModuleParameters(module="model.embed_tokens", parameter_bytes=2000, forward_reads=("forward.embedding",),
                                backward_reads=(), gradients=("backward.embedding_grad",))]
    modules += [ModuleParameters(module=f"model.layers.{i}", parameter_bytes=1000,
                                 forward_reads=(f"forward.mm{i}a", f"forward.mm{i}b"),
                                 backward_reads=(f"backward.mm{i}b_input_grad", f"backward.mm{i}a_input_grad"),
                                 gradients=(f"backward.mm{i}_weight_grad",)) for i in range(2)]
    modules.append(ModuleParameters(module="lm_head", parameter_bytes=4000, forward_reads=("forward.head",),
                                    backward_reads=("backward.head_grad",), gradients=()))
    return workload, modules


def test_zero3_rewrite_gathers_each_module_per_phase_and_reduce_scatters_its_gradients():
    source, modules = _single_device_toy()
    zero3 = zero3_workload(source, modules, world_size=8)
    validate_workload(zero3)
    ops = zero3.program(0).ops
    starts = [op for op in ops if op.kind == "collective_start"]
    gathers = Counter((op.phase, op.name.rsplit(".", 1)[-1]) for op in starts if op.collective.kind == "all_gather")
    assert set(gathers) == {("forward", "embed_tokens"), ("forward", "0"), ("forward", "1"), ("forward", "lm_head"),
                            ("backward", "0"), ("backward", "1"), ("backward", "lm_head")}
    assert set(gathers.values()) == {1}
    sizes = {m.module: m.parameter_bytes for m in modules}
    for op in starts:
        module = op.collective.key.split(".", 2)[-1]
        if op.collective.kind == "all_gather":
            assert op.collective.message_bytes == sizes[module] // 8  # the local shard
            assert [zero3.program(0).tensors[t] for t in op.allocates] == [sizes[module]]  # the full copy
    reductions = {op.collective.key: op.collective.message_bytes for op in starts
                  if op.collective.kind == "reduce_scatter"}
    assert reductions == {"backward.reduce_scatter.model.layers.1": 1000, "backward.reduce_scatter.model.layers.0": 1000,
                          "backward.reduce_scatter.model.embed_tokens": 2000}
    # a module's gather is waited for right before its first read; every start is waited for
    position = {op.name: i for i, op in enumerate(ops)}
    for m in modules:
        assert position[f"forward.all_gather.{m.module}.wait"] < position[m.forward_reads[0]]
    assert {op.collective.key for op in ops if op.kind == "collective_wait"} == {op.collective.key for op in starts}
    assert zero3.program(0).static_memory == StaticMemory(parameter_bytes=1000, gradient_bytes=1000,
                                                          optimizer_bytes=6000)


def test_zero3_rewrite_without_prefetch_gathers_each_module_when_compute_reaches_its_first_read():
    """AutoSP's sharded parameters (``prefetch=False``): a gather depends on the op before its module's first read,
    so no two modules' gathered copies are in flight at once, and the step is no faster than with prefetch."""
    source, modules = _single_device_toy()
    program = zero3_workload(source, modules, world_size=8, prefetch=False).program(0)
    position = {op.id: i for i, op in enumerate(program.ops)}
    by_name = {op.name: op for op in program.ops}
    for phase in ("forward", "backward"):
        starts = [op for op in program.ops if op.kind == "collective_start" and op.phase == phase
                  and op.collective.kind == "all_gather"]
        for start in starts:
            module = start.collective.key.split(".", 2)[-1]
            reads = next(getattr(m, f"{phase}_reads") for m in modules if m.module == module)
            first = position[by_name[reads[0]].id]
            # it waits for the compute op before the read (the first op of the program waits for nothing)
            at_start = reads[0] == source.program(0).ops[0].name
            assert [program.ops[position[d]].kind for d in start.deps] == ([] if at_start else ["compute"])
            wait = position[by_name[f"{start.name}.wait"].id]
            assert position[start.id] < wait < first  # issued and waited for right before the first read
            between = program.ops[position[start.id] + 1:wait]
            assert not [op for op in between if op.kind == "collective_start"]  # one gather in flight at a time
    cluster = Cluster.from_preset("a100-80gb-sxm")
    eager = simulate(zero3_workload(source, modules, world_size=8, prefetch=False), cluster)
    ahead = simulate(zero3_workload(source, modules, world_size=8), cluster)
    assert eager.step_time_s >= ahead.step_time_s


def test_zero3_rewrite_frees_gathered_parameters_and_full_gradients():
    source, modules = _single_device_toy()
    program = zero3_workload(source, modules, world_size=8).program(0)
    allocated = {t for op in program.ops for t in op.allocates}
    freed = {t for op in program.ops for t in op.frees}
    gradients = {t for op in source.program(0).ops if op.name.endswith(("weight_grad", "embedding_grad"))
                 for t in op.allocates}
    added = allocated - {t for op in source.program(0).ops for t in op.allocates}
    assert gradients <= freed and added <= freed  # unfreed before: the full gradients; added: gathered copies
    result = simulate(zero3_workload(source, modules, world_size=8), Cluster.from_preset("a100-80gb-sxm"))
    assert result.step_time_s > simulate(source, Cluster.from_preset("a100-80gb-sxm")).step_time_s


def test_zero3_rewrite_refuses_a_trace_with_collectives_or_foreign_op_names():
    source, modules = _single_device_toy()
    with pytest.raises(ValueError, match="sp_size=1"):
        zero3_workload(_ulysses_toy(), modules, world_size=8)
    stray = [ModuleParameters(module="x", parameter_bytes=1, forward_reads=("forward.nope",), backward_reads=(),
                              gradients=())]
    with pytest.raises(ValueError, match="same compiled graphs"):
        zero3_workload(source, stray, world_size=8)


def test_zero3_rewrite_of_a_sequence_parallel_trace_over_its_own_ranks_keeps_the_all_to_alls():
    # ALST's configuration: Ulysses over every rank, ZeRO 3 partitioning over the same ranks.
    source = _ulysses_toy()
    modules = [ModuleParameters(module=f"model.layers.{i}", parameter_bytes=1000,
                                forward_reads=(f"forward.proj{i}_q", f"forward.proj{i}_v"),
                                backward_reads=(f"backward.attention{i}_backward",), gradients=())
               for i in range(2)]
    zero3 = zero3_workload(source, modules, world_size=P)
    validate_workload(zero3)
    kinds = Counter(op.collective.kind for op in zero3.program(0).ops if op.kind in ("collective", "collective_start"))
    a2a = sum(1 for op in source.program(0).ops if op.collective is not None)
    assert kinds == {"all_to_all": a2a, "all_gather": 4}  # two modules, forward and backward; no gradients here
    assert zero3.groups["sp"] == source.groups["sp"] and zero3.groups["dp_gather"] == (tuple(range(P)),)
    cluster = Cluster.from_preset("h100-sxm")
    assert simulate(zero3, cluster).step_time_s > simulate(source, cluster).step_time_s


# --- on real traces -------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:autosp.compile with sp_size=1")
def test_module_parameters_and_both_rewrites_on_a_traced_llama():
    import torch

    from autosp.export import export_workload, module_parameters
    from autosp.tracing import trace_fake_step
    from experiments.models import build_model

    torch._dynamo.reset()
    compiled, parameter_bytes = trace_fake_step(lambda: build_model("hf-llama", layers=2, kv_heads=4), seq_len=256,
                                                sp_size=1, vocab_size=256, dtype=torch.float32, checkpointing="none")
    modules = module_parameters(compiled.report.aot_graphs, compiled.report.forward_graphs[-1])
    assert [m.module for m in modules] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm",
                                           "lm_head"]
    assert sum(m.parameter_bytes for m in modules) == parameter_bytes
    assert all(m.forward_reads and m.gradients for m in modules)
    single = export_workload(compiled.report.aot_graphs, name="single", sp_size=1, parameter_bytes=parameter_bytes)
    zero3 = zero3_workload(single, modules, world_size=8)
    validate_workload(zero3)
    cluster = Cluster.from_preset("a100-80gb-sxm")
    assert simulate(zero3, cluster).step_time_s > 0

    torch._dynamo.reset()
    compiled, parameter_bytes = trace_fake_step(lambda: build_model("hf-llama", layers=2, kv_heads=4), seq_len=256,
                                                sp_size=4, vocab_size=256, dtype=torch.float32, checkpointing="none",
                                                overlap_communication=False)
    ulysses = export_workload(compiled.report.aot_graphs, name="ulysses", sp_size=4, parameter_bytes=parameter_bytes)
    ring = ring_workload(ulysses)
    assert _attention_flops(ring.program(3)) == _attention_flops(ulysses.program(0))
    result = simulate(ring, cluster)
    assert math.isfinite(result.step_time_s) and len(result.ranks) == 4
