"""The ALST breakdown table builds on a small model and its rows agree with each other (not its numbers at scale)."""

from __future__ import annotations

from dataclasses import replace

from experiments.models import PaperModel
from experiments.paper_scale import alst
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
    everything = replace(alst.ALST_ROWS[5], published_tokens=8192)
    search = alst.Search(granularity=1024, start=8192, high=8192, max_probes=2)  # everything fits: one probe
    rows = alst.alst_rows(rows=[everything], model=SMALL, cache=TraceCache(interpolate_lengths=True),
                          searches={everything.name: search})
    (row,) = rows
    assert row["row"] == everything.name and row["system"] == "alst"
    assert row["simulated_tokens"] == 8192 and row["stopped"] == "ceiling"
    assert row["error_pct"] == 0.0 and row["within_tolerance"] is True
    assert row["simulated_step_s"] > 0 and row["simulated_tflops"] > 0
    assert row["simulated_step_at_published_s"] == row["simulated_step_s"]  # the same simulated step
    assert 0 < row["peak_at_published_gib"] < 80
    assert row["host_peak_gib"] > 0  # optimizer state and the offloaded layer inputs
    assert "depth-extrapolated" in row["items"].split() and set(row["items"].split()) <= set(alst.ITEMS)
    lines = alst.footer(rows)
    assert lines[0].startswith("ALST's configuration reproduced within +-20% on 1 of 1")
    assert not any(line.startswith("- miss: ") for line in lines)
    assert alst.footer([{**row, "error_pct": 50.0, "within_tolerance": False}])[1].startswith("- miss: everything:")
