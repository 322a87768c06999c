"""The export of a strategy="ring" program: the ring's steps and transfers as the pass emits them, simulated.

Traced on fake tensors and a fake group (`autosp.export.trace_fake_step`), tiny Hugging Face models with GQA:
every attention's forward passes K/V P-1 times, its backward K/V P-1 times and the dK/dV accumulators P times,
with the bytes of the tensors the op passes, each transfer issued before the compute it overlaps; the workload
simulates.  Compared with the Ulysses trace rewritten to a ring (`simulator.workload_rewrites.ring_workload`),
the one the paper-scale tables use for the hand-written ring: the same transfers and attention FLOPs, and the
K/V bytes of Ulysses' replicated key/value heads where the model has fewer of them than ranks
(Note [Ring attention in the export] in autosp/export.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from autosp.costs import attention_flops
from autosp.export import export_workload, module_parameters, trace_fake_step
from autosp.passes.dynamo.attention import kv_replication_factor
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

    exported, _, (graphs, parameter_bytes) = _traced(case, "ring")
    calls = []
    monkeypatch.setattr(export, "_node_costs", lambda *a, found=export._node_costs: calls.append(a) or found(*a))
    shared = export_workload(graphs, name=f"{case}/ring", sp_size=CASES[case][3], parameter_bytes=parameter_bytes)
    once = len(calls)

    class OwnCosts(export._Emitter):
        def __post_init__(self):
            self.node_costs = None  # a dict of its own
            super().__post_init__()

    monkeypatch.setattr(export, "_Emitter", OwnCosts)
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
        for phase in ("forward", "backward"):
            (node,) = {n.partition(".ring.")[0] for n in names if n.startswith(phase) and ".ring." in n}
            for s in range(p - 1):
                send = names.index(f"{node}.ring.kv{s}.send")
                compute = names.index(f"{node}.ring.step{s}.attention0")
                assert send < compute < names.index(f"{node}.ring.kv{s}.send.wait")
                assert compute < names.index(f"{node}.ring.kv{s}.recv.wait") < names.index(
                    f"{node}.ring.step{s + 1}.attention0")
            if phase == "backward":  # the dK/dV sum leaves after the step's kernels, before the next step's
                for s in range(p):
                    dkv = names.index(f"{node}.ring.dkv{s}.send")
                    assert names.index(f"{node}.ring.step{s}.attention0") < dkv
                    assert s == p - 1 or dkv < names.index(f"{node}.ring.step{s + 1}.attention0")


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


@pytest.mark.parametrize("document_lengths,read_blocks", [
    ([16, 16, 16, 16], 4),  # every chunk its own document: only the 4 diagonal blocks are read
    ([32, 32], 6),          # two documents of two chunks: 4 diagonal blocks and 2 below them
])
def test_ring_export_over_packed_documents_leaves_out_the_chunk_pairs_the_op_skips(document_lengths, read_blocks):
    """Note [Ring attention in the export]: HF Llama (its packed-sequence mask) over 2 ranks, 4 chunks of 16
    tokens; the ring's attention work summed over the ranks is the causal blocks the documents read, no more."""
    def build():
        model = build_model("hf-llama", layers=1, vocab=VOCAB, heads=8, kv_heads=2)
        model.config.use_cache = False
        return model

    torch._dynamo.reset()
    compiled, parameter_bytes = trace_fake_step(build, seq_len=SEQ, sp_size=2, vocab_size=VOCAB, strategy="ring",
                                                document_lengths=document_lengths, **COMPARED)
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
