"""The ALST breakdown table builds on a small model and its rows agree with each other (not its numbers at scale)."""

from __future__ import annotations

from dataclasses import replace

from experiments.models import PaperModel
from experiments.paper_scale import alst, alst_breakdown, alst_longest, alst_planner, alst_table
from experiments.paper_scale.simulate import TraceCache

# Llama-shaped, 3 layers (depth extrapolated from 1 and 2), heads divisible by the 8 ranks of ALST's node.
SMALL = PaperModel(name="alst-test-llama", hidden_size=64, intermediate_size=160, num_layers=3, num_heads=8,
                   num_kv_heads=8, vocab_size=512)


def test_liger_and_tiled_mlp_chunks_follow_their_published_rules():
    # Llama-3.1-8B at 160K tokens on one rank: ceil(128256 / 4096) = 32, ceil(160000 / 32) = 5000 -> 8192
    assert alst.liger_chunk_tokens(160_000, 4096, 128_256) == 8192
    assert alst.liger_chunk_tokens(100, 4096, 128_256) == 4  # ceil(100 / 32) = 4
    # ArcticTraining's TiledMLP: ceil(S / hidden) shards; 256,000 tokens -> 63 shards (ALST section 3.1.1)
    assert -(-256_000 // alst.tiled_mlp_chunk_tokens(256_000, 4096)) == 63
    assert alst.tiled_mlp_chunk_tokens(1000, 4096) == 1000


def test_alst_table_builds_and_its_rows_are_consistent():
    # ALST's last row (Ulysses over 8 ranks, ZeRO 3 with optimizer offload, every technique, host pools) at a small
    # length, published where the search lands so that one length is traced (at depths 1 and 2); the single-device
    # ZeRO-3 path of the SP 1 rows is tests/experiments/test_workload_rewrites.py's.
    everything = replace(alst_breakdown.ALST_ROWS[5], published_tokens=8192)
    search = alst_longest.Search(granularity=1024, start=8192, high=8192, max_probes=2)  # everything fits: one probe
    cache = TraceCache(interpolate_lengths=True)
    rows = alst_table.alst_rows(rows=[everything], model=SMALL, cache=cache, searches={everything.name: search})
    (row,) = rows
    assert row["row"] == everything.name and row["system"] == "alst"
    assert row["simulated_tokens"] == 8192 and row["stopped"] == "ceiling"
    assert row["error_pct"] == 0.0 and row["within_tolerance"] is True
    assert row["simulated_step_s"] > 0 and row["simulated_tflops"] > 0
    assert row["simulated_step_at_published_s"] == row["simulated_step_s"]  # the same simulated step
    assert 0 < row["peak_at_published_gib"] < 80
    assert row["host_peak_gib"] > 0  # optimizer state and the offloaded layer inputs
    assert "depth-extrapolated" in row["items"].split() and set(row["items"].split()) <= set(alst_breakdown.ITEMS)
    lines = alst_table.footer(rows)
    assert lines[0].startswith("ALST's configuration reproduced within +-20% on 1 of 1")
    assert not any(line.startswith("- miss: ") for line in lines)
    assert alst_table.footer([{**row, "error_pct": 50.0, "within_tolerance": False}])[1].startswith("- miss: everything:")
    # Found short of the published length: the miss_item column sizes what is left (the unfused bound included).
    (short,) = alst_table.alst_rows(rows=[everything], model=SMALL, cache=cache, searches={
        everything.name: alst_longest.Search(granularity=1024, start=4096, high=4096, max_probes=1)})
    assert short["simulated_tokens"] == 4096 and short["error_pct"] == -50.0
    assert short["miss_item"].split(":")[0] in {"fragmentation", "published-is-a-run", "none sized"}


def test_liger_rms_norm_matches_llama_rms_norm_and_keeps_no_fp32_copy():
    # Liger's RMSNorm as traced (Note [Liger's RMSNorm in a trace]): the same values and gradients as transformers'
    # LlamaRMSNorm (fp32), and in bf16 autograd keeps no fp32 [tokens, hidden] tensor, which LlamaRMSNorm does.
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from experiments.paper_scale.liger import liger_rms_norm

    torch.manual_seed(0)
    ref = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 16, 64, requires_grad=True)
    weight = ref.weight.detach().clone().requires_grad_(True)
    grad = torch.randn(2, 16, 64)
    (ref(x) * grad).sum().backward()
    expected = (x.grad.clone(), ref.weight.grad.clone())
    x.grad = None
    out = liger_rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, ref(x), rtol=1e-4, atol=1e-6)
    (out * grad).sum().backward()
    torch.testing.assert_close(x.grad, expected[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad, expected[1], rtol=1e-4, atol=1e-6)

    def saved_fp32_activations(norm) -> int:
        found = []
        xb = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: found.append(t) or t, lambda t: t):
            norm(xb)
        return sum(1 for t in found if t.dtype == torch.float32 and t.shape == xb.shape)

    bf16 = LlamaRMSNorm(64).to(torch.bfloat16)
    assert saved_fp32_activations(bf16) > 0
    assert saved_fp32_activations(lambda h: liger_rms_norm(h, bf16.weight, 1e-5)) == 0


def test_liger_loss_workload_holds_liger_buffers():
    # A program with AutoSP's tiled loss (forward workspace, a recomputed forward, the backward's workspace and the
    # gradients it returns) becomes Liger's: one bf16 [chunk, vocab] block in the forward, the returned gradients
    # allocated there and freed where they were, no workspace in backward.
    from simulator.workload import Op, RankProgram, Workload

    ops = (Op(id=0, name="forward.linear_cross_entropy", kind="compute", allocates=(0, 1), frees=(1,)),
           Op(id=1, name="forward.other", kind="compute", deps=(0,)),
           Op(id=2, name="backward.linear_cross_entropy", kind="compute", deps=(1,), allocates=(2, 3), frees=(3,)),
           Op(id=3, name="backward.linear_cross_entropy_backward", kind="compute", deps=(2,), allocates=(4, 5),
              frees=(0, 2, 5)),
           Op(id=4, name="backward.norm", kind="compute", deps=(3,), frees=(4,)))
    program = RankProgram(ops=ops, tensors={0: 40, 1: 8000, 2: 40, 3: 8000, 4: 300, 5: 9000})
    out = alst.liger_loss_workload(Workload(name="w", world_size=1, groups={}, ranks={0: program}),
                                   chunk_tokens=10, vocab=100).program(0)
    assert out.tensors[1] == 2 * 10 * 100 and out.tensors[3] == 0 and out.tensors[5] == 0
    assert out.ops[0].allocates == (0, 1, 4) and out.ops[3].allocates == (5,) and out.ops[4].frees == (4,)


def test_miss_item_names_what_moves_the_length_towards_the_published_one():
    row = replace(alst_breakdown.ALST_ROWS[3], published_tokens=1000)
    items = [("fragmentation", 2**30, 100), ("attention-kernel", -2**30, -50), ("published-is-a-run", 2**31, 300)]
    short = alst_longest.miss_item(row, items, 800)  # 20 % short: what would lengthen it
    assert short.startswith("fragmentation: +1.0 GiB") and short.endswith("error after it -10.0 %")
    assert alst_longest.miss_item(row, items, 1500).startswith("attention-kernel: -1.0 GiB")  # a modelling item first
    assert alst_longest.miss_item(row, items[::2], 1500).startswith(
        "published-is-a-run: the published length fits with 2.0")
    assert alst_longest.miss_item(row, items[1:2], 800) == "none sized"


def test_planner_row_plans_on_alsts_machine_with_both_objectives():
    """The planner row runs `autosp.plan.plan_job` (objective fastest at the given length, the DeepSpeed setup
    chosen too) and then `plan_memory` (longest from there, under that setup) on ALST's node, and fills the table's
    columns from their choices.  A small model fits under the first setup, ZeRO 1 without offload."""
    from autosp.plan import candidate_plans

    plans = candidate_plans(checkpointing=("layer", "sac"), tiled_loss=("on",), tiled_mlp=("on",),
                            activation_offload=("off", "on"))
    row = alst_planner.planner_row(model=SMALL, plans=plans, seq_len=4096, narrow_to=3,
                                   search=alst_longest.Search(granularity=1024, start=4096, high=8192, max_probes=3))
    assert set(row) == set(alst_longest.COLUMNS) and row["system"] == "autosp" and row["zero_stage"] == 1
    assert row["simulated_tokens"] == 8192 and row["stopped"] == "ceiling"  # a small model fits to the ceiling
    assert row["simulated_step_s"] > row["simulated_step_at_published_s"] > 0 and 0 < row["peak_at_published_gib"] < 80
    assert row["checkpointing"] in ("layer", "sac") and row["tiled_loss"] is True and row["tiled_mlp"] is True
    assert "objective fastest at 4,096 tokens chose " in row["source"]
    # Four fit at 4,096 tokens, more than narrow_to: a fastest decision at 8,192 narrows them (all fit there too,
    # and 16,384 is past the search's ceiling), and the longest search starts there (Note [Narrowing the longest
    # search]).
    assert ("(4 fit) under ZeRO 1; objective longest (over the 4 of those that fit at 8,192 tokens (Note "
            "[Narrowing the longest search])) chose ") in row["source"]
    assert row["published_iteration_s"] == alst_breakdown.ALST_ROWS[-1].published_iteration_s
    (line,) = [ln for ln in alst_table.footer([row]) if ln.startswith("The planner")]
    assert line.endswith("; longest 8,192 tokens, 0.00x the published 3,700,000.") and row["error_pct"] == ""
