"""Packed documents at scale, on a fake process group: no [S, S] tensor, and attention priced by what it keeps.

Hugging Face Llama with ``use_cache=False`` (its packed-sequence mask), one layer, traced with the real
passes on fake tensors (autosp.tracing.trace_fake_step) with a real document layout."""

from __future__ import annotations

import pytest
import torch

from autosp.costs import tensors_of


def _trace(seq_len: int, sp_size: int, document_lengths: list[int]):
    from autosp.tracing import trace_fake_step
    from experiments.models import build_model

    def build():
        model = build_model("hf-llama", layers=1, hidden=128, heads=16, kv_heads=4)
        model.config.use_cache = False
        return model

    torch._dynamo.reset()
    compiled, parameter_bytes = trace_fake_step(build, seq_len=seq_len, sp_size=sp_size, vocab_size=256,
                                                dtype=torch.float32, checkpointing="none",
                                                overlap_communication=False, document_lengths=document_lengths)
    return compiled, parameter_bytes


def test_no_sequence_by_sequence_tensor_per_rank_at_64k():
    seq_len, sp_size = 65536, 8
    compiled, _ = _trace(seq_len, sp_size, [seq_len // 4] * 4)
    assert [(m.by_position, m.padding) for m in compiled.report.document_masks] == [(True, False)]
    local = seq_len // sp_size
    graphs = [("dynamo", compiled.report.forward_graphs[-1]), *compiled.report.aot_graphs]
    checked = 0
    for name, gm in graphs:
        for module in gm.modules():  # nested bodies (flex_attention's mask and score graphs) included
            for node in getattr(module, "graph", None).nodes if hasattr(module, "graph") else ():
                value = node.meta.get("val", node.meta.get("example_value"))
                for t in tensors_of(value):
                    checked += 1
                    long_dims = [d for d in t.shape if isinstance(d, int) and d >= local]
                    assert len(long_dims) < 2, f"{name} graph: {node.name} has shape {tuple(t.shape)}"
    assert checked > 100


def _attention_flops(workload) -> int:
    return sum(op.flops for op in workload.program(0).ops if op.op_class == "attention")


@pytest.mark.slow
def test_attention_of_a_packed_batch_is_priced_by_the_scores_its_mask_keeps():
    from autosp.export import export_workload

    seq_len, sp_size = 131072, 16
    flops = {}
    for documents in (1, 8):
        compiled, parameter_bytes = _trace(seq_len, sp_size, [seq_len // documents] * documents)
        kept = compiled.report.attention_kept_fraction
        n = seq_len // documents  # documents·n(n+1)/2 causal pairs of S² in all
        if documents == 1:  # plain positions: causal SDPA (Note [Document program] in autosp/model.py), no mask
            assert kept is None and compiled.report.requires_plain_positions
        else:
            assert kept == pytest.approx(documents * n * (n + 1) / 2 / seq_len**2, rel=1e-9)
        workload = export_workload(compiled.report.aot_graphs, name=f"{documents} documents", sp_size=sp_size,
                                   parameter_bytes=parameter_bytes, attention_kept_fraction=kept)
        flops[documents] = _attention_flops(workload)
    assert flops[8] / flops[1] == pytest.approx(1 / 8, rel=1e-3)


def test_inductor_compiles_a_packed_batch_with_aot_eager_and_says_why(caplog):
    """Note [Document program] in autosp/model.py, on a shape-only trace: the packed batch's program is the document
    program's (aot_eager), with its document mask, and the warning names the reason."""
    from experiments.models import build_model

    def build():
        model = build_model("hf-llama", layers=1)
        model.config.use_cache = False
        return model

    torch._dynamo.reset()
    from autosp.tracing import trace_fake_step

    with caplog.at_level("WARNING", logger="autosp.api"):
        compiled, _ = trace_fake_step(build, seq_len=256, sp_size=2, vocab_size=256, dtype=torch.float32,
                                      compiler="inductor", document_lengths=[100, 156])
    (program,) = compiled.programs
    assert program.compiler == "aot_eager" and program.documents and "flex_attention" in program.why_documents
    assert [(m.by_position, m.padding) for m in compiled.report.document_masks] == [(True, False)]
    assert "document program (aot_eager) instead of its inductor program" in caplog.text
    assert "packed documents" in caplog.text
