"""The export of a strategy="ring" program: the ring's steps and transfers as the pass emits them, simulated.

Traced on fake tensors and a fake group (`autosp.tracing.trace_fake_step`), tiny Hugging Face models with GQA:
every attention's forward passes K/V P-1 times, its backward K/V P-1 times and the dK/dV accumulators P times,
with the bytes of the tensors the op passes, each transfer issued before the compute it overlaps; the workload
simulates.  Compared with the Ulysses trace rewritten to a ring (`simulator.workload_rewrites.ring_workload`),
the one the paper-scale tables use for the hand-written ring: the same transfers and attention FLOPs, and the
K/V bytes of Ulysses' replicated key/value heads where the model has fewer of them than ranks
(Note [Ring attention in the export] in autosp/export_ring.py).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from autosp.costs import attention_flops
from autosp.export import export_workload, module_parameters
from autosp.passes.dynamo.attention import kv_replication_factor
from autosp.tracing import trace_fake_step
from experiments.models import build_model
from simulator import Cluster, simulate
from simulator.strategies import STRATEGIES
from simulator.training_config import TrainingConfig
from simulator.workload import RING_GROUPS
from simulator.workload_rewrites import ring_workload

SEQ, VOCAB = 64, 256
COMPARED = {"checkpointing": "none", "overlap_communication": False}
"""The options the Ulysses trace is rewritten from (blocking all-to-alls); the ring is traced with them too."""
CASES = {  # name: (preset, heads, kv heads, ranks, options of the ring trace)
    "mistral-4h-1kv-p2": ("hf-mistral", 4, 1, 2, COMPARED),
    "llama-8h-2kv-p2": ("hf-llama", 8, 2, 2, COMPARED),
    "mistral-4h-1kv-p4-sac-overlap": ("hf-mistral", 4, 1, 4, {}),
}


@functools.cache
def _traced(case: str, strategy: str):
    """(exported workload, module map, the graphs and their parameter bytes) of ``case`` traced with ``strategy``
    (each traced once per session)."""
    preset, _, _, sp_size, options = CASES[case]
    torch._dynamo.reset()
    compiled, parameter_bytes = trace_fake_step(lambda: build_model(preset, layers=1, vocab=VOCAB), seq_len=SEQ,
                                                sp_size=sp_size, vocab_size=VOCAB, strategy=strategy,
                                                **(options if strategy == "ring" else COMPARED))
    graphs = compiled.report.aot_graphs
    return (export_workload(graphs, name=f"{case}/{strategy}", sp_size=sp_size, parameter_bytes=parameter_bytes),
            module_parameters(graphs, compiled.report.forward_graphs[-1]), (graphs, parameter_bytes))


@pytest.fixture(params=list(CASES))
def ring(request):
    return request.param, _traced(request.param, "ring")[0]


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][3] > 2])
def test_ring_export_prices_each_node_once_for_every_rank_as_each_rank_alone_would(case, monkeypatch):
    """`autosp.export._node_costs` is found once per node and shared by the ranks' emitters (their programs differ
    in the ring's ops only): the workload equals the one whose every rank prices every node itself."""
    from autosp import export
    from autosp.export_program import RankEmitter

    exported, _, (graphs, parameter_bytes) = _traced(case, "ring")
    calls = []
    monkeypatch.setattr(export, "_node_costs", lambda *a, found=export._node_costs: calls.append(a) or found(*a))
    shared = export_workload(graphs, name=f"{case}/ring", sp_size=CASES[case][3], parameter_bytes=parameter_bytes)
    once = len(calls)

    class OwnCosts(RankEmitter):
        def __post_init__(self):
            self.node_costs = None  # a dict of its own
            super().__post_init__()

    monkeypatch.setattr(export, "RankEmitter", OwnCosts)
    alone = export_workload(graphs, name=f"{case}/ring", sp_size=CASES[case][3], parameter_bytes=parameter_bytes)
    assert shared == alone == exported and len(shared.ranks) == CASES[case][3]
    assert len(calls) == once * (1 + CASES[case][3])  # each rank alone prices every node again


def _transfers(program, phase: str, kind: str, tag: str) -> dict[str, list]:
    """Ring node -> its ``kind`` starts (send or recv) of ``tag`` (kv or dkv) in program order."""
    found: dict[str, list] = {}
    for op in program.ops:
        if op.kind == "collective_start" and op.phase == phase and op.collective.kind == kind:
            node, _, step = op.name.partition(".ring.")
            if step.startswith(tag) and step[len(tag)].isdigit():
                found.setdefault(node, []).append(op)
    return found


def test_ring_export_passes_kv_p_minus_1_times_and_dkv_p_times_with_the_ops_bytes_and_neighbours(ring):
    name, workload = ring
    _, heads, kv_heads, p, _ = CASES[name]
    local, d = SEQ // p, 64 // heads
    kv_bytes, dkv_bytes = 2 * kv_heads * local * d * 2, 2 * kv_heads * local * d * 4  # bf16 K/V, fp32 dK/dV
    assert workload.metadata["strategy"] == "ring" and not workload.symmetric and sorted(workload.ranks) == list(
        range(p))
    assert set(RING_GROUPS) <= set(workload.groups)
    for rank, program in workload.ranks.items():
        expect = {("forward", "kv"): (p - 1, kv_bytes), ("backward", "kv"): (p - 1, kv_bytes),
                  ("backward", "dkv"): (p, dkv_bytes)}
        for (phase, tag), (count, nbytes) in expect.items():
            sends, recvs = _transfers(program, phase, "send", tag), _transfers(program, phase, "recv", tag)
            assert len(sends) == len(recvs) == 1  # one layer: one ring node per phase
            for ops, peer, group in ((sends, (rank + 1) % p, RING_GROUPS[0]), (recvs, (rank - 1) % p, RING_GROUPS[1])):
                (node_ops,) = ops.values()
                assert [(o.collective.message_bytes, o.collective.peer, o.collective.group) for o in node_ops] == [
                    (nbytes, peer, group)] * count


def test_ring_export_issues_each_transfer_before_the_compute_it_overlaps_and_waits_after_it(ring):
    name, workload = ring
    p = CASES[name][3]
    for program in workload.ranks.values():
        names = [op.name for op in program.ops]

        def first_call(node: str, s: int, names=names) -> int:  # step s's first call, named after its kernel
            return names.index(f"{node}.ring.step{s}.attention0.flash_cpu")

        for phase in ("forward", "backward"):
            (node,) = {n.partition(".ring.")[0] for n in names if n.startswith(phase) and ".ring." in n}
            for s in range(p - 1):
                send = names.index(f"{node}.ring.kv{s}.send")
                compute = first_call(node, s)
                assert send < compute < names.index(f"{node}.ring.kv{s}.send.wait")
                assert compute < names.index(f"{node}.ring.kv{s}.recv.wait") < first_call(node, s + 1)
            if phase == "backward":  # the dK/dV sum leaves after the step's kernels, before the next step's
                for s in range(p):
                    dkv = names.index(f"{node}.ring.dkv{s}.send")
                    assert first_call(node, s) < dkv
                    assert s == p - 1 or dkv < first_call(node, s + 1)


def test_ring_export_attention_work_is_the_whole_sequences_balanced_over_ranks_and_the_step_simulates(ring):
    name, workload = ring
    _, heads, kv_heads, p, _ = CASES[name]
    local, d = SEQ // p, 64 // heads
    whole = attention_flops((1, heads, local, d), (1, kv_heads, SEQ, d), causal=True, backward=False)
    for program in workload.ranks.values():
        flops = {phase: sum(op.flops for op in program.ops if op.op_class == "attention" and op.phase == phase)
                 for phase in ("forward", "backward")}
        assert flops == {"forward": whole, "backward": int(whole * 2.5)}
    result = simulate(workload, Cluster.from_preset("h100-sxm"))
    assert not result.collapsed and len(result.ranks) == p and result.step_time_s > 0
    assert all(r.oom is None for r in result.ranks)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][4] == COMPARED])
def test_ring_export_against_the_ulysses_rewrite_differs_only_by_replicated_kv_heads(case):
    _, heads, kv_heads, p, _ = CASES[case]
    exported, rewrite = _traced(case, "ring")[0], ring_workload(_traced(case, "ulysses")[0])
    replicate = kv_replication_factor(heads, kv_heads, p) if kv_heads % p else 1

    def per_attention(workload, phase: str) -> list[int]:
        """Bytes rank 0 sends per transfer during ``phase``'s attention, in order."""
        return [op.collective.message_bytes for op in workload.ranks[0].ops
                if op.kind == "collective_start" and op.phase == phase and op.collective.kind == "send"]

    for phase in ("forward", "backward"):
        mine, theirs = per_attention(exported, phase), per_attention(rewrite, phase)
        assert len(mine) == len(theirs) == (p - 1 if phase == "forward" else 2 * p - 1)
        assert [b * replicate for b in mine] == theirs  # Ulysses all-to-alls kv heads replicated to the ranks
        flops = [sum(op.flops for op in w.ranks[0].ops if op.op_class == "attention" and op.phase == phase)
                 for w in (exported, rewrite)]
        assert flops[0] == flops[1]
    cluster = Cluster.from_preset("h100-sxm")
    assert simulate(exported, cluster).step_time_s > 0 and simulate(rewrite, cluster).step_time_s > 0


def test_ring_export_is_what_the_registrys_autosp_ring_builds_its_whole_step_from(ring):
    """``autosp-ring`` (no rewrite): the exported ring plus DeepSpeed's gradient reduction and optimizer step."""
    name, workload = ring
    p = CASES[name][3]
    modules = _traced(name, "ring")[1]
    numels = tuple(m.parameter_bytes // 2 for m in modules)
    step = STRATEGIES["autosp-ring"].workload.build(workload, modules, TrainingConfig(parameter_numels=numels,
                                                                                       dp_world_size=p))
    assert sorted(step.ranks) == list(range(p)) and not step.symmetric
    assert all(any(op.phase == "optimizer" for op in program.ops) for program in step.ranks.values())
    cluster = Cluster.from_preset("h100-sxm")
    assert simulate(step, cluster).step_time_s > simulate(workload, cluster).step_time_s


def _hf_llama_packed():
    model = build_model("hf-llama", layers=1, vocab=VOCAB, heads=8, kv_heads=2)
    model.config.use_cache = False  # it builds its packed-sequence mask from the position ids
    return model


def _packed_ring_trace(document_lengths: list[int]):
    """HF Llama traced over 2 ranks under the ring, on one sample packed from documents of ``document_lengths``:
    (the compiled step, the parameter bytes)."""
    torch._dynamo.reset()
    return trace_fake_step(_hf_llama_packed, seq_len=SEQ, sp_size=2, vocab_size=VOCAB, strategy="ring",
                           document_lengths=document_lengths, **COMPARED)


@pytest.mark.parametrize("document_lengths,read_blocks", [
    ([16, 16, 16, 16], 4),  # every chunk its own document: only the 4 diagonal blocks are read
    ([32, 32], 6),          # two documents of two chunks: 4 diagonal blocks and 2 below them
])
def test_ring_export_over_packed_documents_leaves_out_the_chunk_pairs_the_op_skips(document_lengths, read_blocks):
    """Note [Ring attention in the export]: HF Llama (its packed-sequence mask) over 2 ranks, 4 chunks of 16
    tokens; the ring's attention work summed over the ranks is the causal blocks the documents read, no more."""
    compiled, parameter_bytes = _packed_ring_trace(document_lengths)
    report = compiled.report
    assert report.document_ids is not None and tuple(report.document_ids.shape) == (1, SEQ)
    chunk, d = SEQ // 4, 64 // 8
    shapes = (1, 8, chunk, d), (1, 2, chunk, d)
    off_diagonal = read_blocks - 4  # whole (non-causal) blocks below the diagonal

    def expected(backward: bool) -> int:
        return (4 * attention_flops(*shapes, causal=True, backward=backward)
                + off_diagonal * attention_flops(*shapes, causal=False, backward=backward))

    def attention(workload, phase):
        return sum(op.flops for program in workload.ranks.values() for op in program.ops
                   if op.op_class == "attention" and op.phase == phase)

    skipped = export_workload(report.aot_graphs, name="documents", sp_size=2, parameter_bytes=parameter_bytes,
                              document_ids=report.document_ids)
    dense = export_workload(report.aot_graphs, name="causal", sp_size=2, parameter_bytes=parameter_bytes)
    assert attention(skipped, "forward") == expected(False)
    assert attention(skipped, "backward") == expected(True)
    # without the ids: the plain causal ring, 16 causal blocks' worth of scores (8 whole blocks)
    assert attention(dense, "forward") == 16 * attention_flops(*shapes, causal=True, backward=False)
    assert simulate(skipped, Cluster.from_preset("h100-sxm")).step_time_s > 0
    with pytest.raises(Exception, match="document_ids cover"):
        export_workload(report.aot_graphs, name="x", sp_size=2, parameter_bytes=parameter_bytes,
                        document_ids=report.document_ids[:, :32])


# --- the kernel each block runs, and no quadratic tensor (Note [Ring block kernels]) -------------------------------

LONG = 2048
"""Tokens of the quadratic-tensor traces: chunks of 512 for the ring of 2 and for the hybrid's ring of 2 (P = 4,
U = 2), above every dimension of the models (hidden 64, MLP 128, vocabulary 256), so a tensor with two dimensions
that long is quadratic in the sequence."""
LONG_CASES = {  # name: (preset, options)
    "ring": ("plain-llama", {"sp_size": 2, "strategy": "ring"}),
    "hybrid": ("hf-qwen2", {"sp_size": 4, "strategy": "hybrid", "ulysses_size": 2}),  # GQA: 2 heads, 1 kv head a rank
}
_BLOCK = re.compile(r"^(forward|backward)\..*\.ring\.step(\d+)\.attention(\d+)\.(\w+)$")


def exported_block_kernels(program) -> list[tuple[str, int, int, str]]:
    """(phase, step, call index, kernel) of every ring attention call of a rank's exported program, in order."""
    return [(m[1], int(m[2]), int(m[3]), m[4]) for op in program.ops if (m := _BLOCK.match(op.name))]


def run_block_kernels(range_names) -> list[tuple[str, int, int, str]]:
    """The same, from the profiler ranges the op runs each call under (``autosp.ring_block.<phase>.<step>.<index>.
    <kernel>``, in the order they started)."""
    from autosp.ring_attention import BLOCK_RANGE

    found = []
    for name in range_names:
        if name.startswith(BLOCK_RANGE + "."):
            phase, step, index, kernel = name[len(BLOCK_RANGE) + 1:].split(".")
            found.append((phase, int(step), int(index), kernel))
    return found


@functools.cache
def _long_trace(case: str):
    torch._dynamo.reset()
    preset, options = LONG_CASES[case]
    compiled, parameter_bytes = trace_fake_step(lambda: build_model(preset, layers=1, vocab=VOCAB), seq_len=LONG,
                                                vocab_size=VOCAB, **options)
    return compiled.report.aot_graphs, parameter_bytes


def _ring_node(graphs):
    """The one (forward) ring attention node of a one-layer program."""
    from autosp.ring_attention import ring_attention

    (node,) = [n for _, gm in graphs for n in gm.graph.nodes
               if n.op == "call_function" and n.target is ring_attention._opoverload]
    return node


def _quadratic(shape, length: int) -> bool:
    """Two or more dimensions of at least ``length`` (the ring's chunk): a tensor quadratic in the sequence."""
    return sum(int(n) >= length for n in shape) >= 2


def _run_ring_node(node, *, documents=None, ranks=None):
    """Run ``node``'s ring attention forward and backward as each ring rank runs it (``ranks``: all), on real
    tensors of the traced shapes and dtypes over a fake group of the ring's size (the transfers move nothing; the
    kernels run): per ring rank, the calls' kernels (`run_block_kernels`) and the shape of every tensor an aten op
    made inside the op (a dispatch mode sees the op's insides, which the compiled graphs hold as one node)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from autosp.costs import schema_arg
    from autosp.ring_attention import _documents, _Ring, _ring_backward, _ring_forward
    from tests.harness import fake_process_group

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen += [(str(func), tuple(t.shape)) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            return out

    size, layout = int(schema_arg(node, "group_size")), str(schema_arg(node, "layout"))
    scale, causal = float(schema_arg(node, "scale")), bool(schema_arg(node, "causal"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(a.meta["val"].shape, generator=g).to(a.meta["val"].dtype) for a in node.args[:3])
    found = {}
    for rank in range(size) if ranks is None else ranks:
        with fake_process_group(size, rank) as group:
            ring, docs = _Ring(group.group_name, size, layout), _documents(documents, layout, size)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, Shapes() as seen:
                out, lse = _ring_forward(q, k, v, ring, scale, causal, docs)
                _ring_backward(torch.ones_like(out), q, k, v, out, lse, ring, scale, causal, docs)
        events = sorted((e.time_range.start, e.name) for e in prof.events())
        found[rank] = (run_block_kernels(name for _, name in events), seen.seen)
    return found


@pytest.mark.parametrize("case", list(LONG_CASES))
def test_ring_and_hybrid_hold_no_quadratic_tensor_in_their_graphs_nor_in_the_ops_blocks(case, monkeypatch):
    """No tensor with two dimensions of a chunk's length (512 tokens) or more in any compiled graph of the ring or
    the hybrid, nor among the tensors the ring op makes inside (its blocks' kernels, every rank); the check fails
    on the math path, forced here, whose [B, H, Lq, Lk] scores it finds."""
    from autosp import ring_attention
    from autosp.costs import tensors_of
    from autosp.ring_block_kernels import BlockKernel

    graphs, _ = _long_trace(case)
    node = _ring_node(graphs)
    chunk = node.args[0].meta["val"].shape[2] // 2  # zig-zag: two chunks a rank
    assert chunk == 512
    for phase, gm in graphs:
        for n in gm.graph.nodes:
            shapes = [tuple(t.shape) for t in tensors_of(n.meta.get("val"))]
            assert not any(_quadratic(s, chunk) for s in shapes), (case, phase, n.name, shapes)
    ran = _run_ring_node(node)
    for kernels, seen in ran.values():
        assert kernels and {k for *_, k in kernels} == {"flash_cpu"}
        assert any("flash_attention_for_cpu" in op for op, _ in seen)  # the mode sees the kernels' outputs
        assert not [(op, s) for op, s in seen if _quadratic(s, chunk)]

    monkeypatch.setattr(ring_attention, "block_kernel", lambda *a, **k: BlockKernel.MATH)  # the ring's choice
    ((kernels, seen),) = _run_ring_node(node, ranks=[0]).values()
    assert {k for *_, k in kernels} == {"math"}
    assert any(_quadratic(s, chunk) for _, s in seen)  # the math path's scores: the check can fail


@pytest.mark.parametrize("case", list(LONG_CASES))
def test_ring_and_hybrid_export_names_the_kernel_every_block_runs(case):
    """Every rank's exported program names, for every attention call of the ring, the kernel the op runs there
    (the hybrid's rank p runs ring rank p // U: Note [Hybrid attention in the export])."""
    graphs, parameter_bytes = _long_trace(case)
    options = LONG_CASES[case][1]
    workload = export_workload(graphs, name=case, sp_size=options["sp_size"], parameter_bytes=parameter_bytes)
    ran = _run_ring_node(_ring_node(graphs))
    u = options.get("ulysses_size", 1)
    for rank, program in workload.ranks.items():
        assert exported_block_kernels(program) == ran[rank // u][0], (case, rank)


def test_ring_export_and_run_agree_on_the_kernel_of_masked_and_unmasked_calls(monkeypatch):
    """Over packed documents a call whose chunks hold more than one document carries a mask (a CUDA device then
    runs memory-efficient attention instead of flash): with a choice that tells the two apart (masked: the math
    path) the export, asking the traced batch's ids, names what the op chose at run time for every call."""
    from autosp import export_ring, ring_attention
    from autosp.ring_block_kernels import MATH_SCORE_BUFFERS, BlockKernel

    def choose(device, dtype, head_dim, *, masked=False, cuda=None):
        return BlockKernel.MATH if masked else BlockKernel.FLASH_CPU

    compiled, parameter_bytes = _packed_ring_trace([5, 40, 19])
    report = compiled.report
    monkeypatch.setattr(ring_attention, "block_kernel", choose)
    monkeypatch.setattr(export_ring, "block_kernel", choose)
    workload = export_workload(report.aot_graphs, name="documents", sp_size=2, parameter_bytes=parameter_bytes,
                               document_ids=report.document_ids)
    ran = _run_ring_node(_ring_node(report.aot_graphs), documents=report.document_ids)
    for rank, program in workload.ranks.items():
        assert exported_block_kernels(program) == ran[rank][0]
    assert {k for r in ran.values() for *_, k in r[0]} == {"math", "flash_cpu"}  # both kinds of call occur
    # Priced as what they run: the math path computes every score and holds its score buffers while it runs
    # (a scratch tensor the call allocates and frees itself); a fused kernel keeps none.
    for program in workload.ranks.values():
        for op in program.ops:
            if _BLOCK.match(op.name):
                scratch = [program.tensors[t] for t in set(op.allocates) & set(op.frees)]
                backward = op.phase == "backward"
                scores = op.attention_scores / (2.5 if backward else 1)  # the block's, all of them if math
                assert scratch == ([MATH_SCORE_BUFFERS[backward] * 4 * scores]
                                   if op.name.endswith(".math") else []), op.name
