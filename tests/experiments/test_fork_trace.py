"""What the authors' AutoSP fork ran, traced on a fake group (Note [The traced workloads of the AutoSP research fork]
in experiments/paper_scale/fork.py): its checkpointing rule, transformers 4.50.3's K/V repetition and the math
attention kernel of its Ulysses baseline.  One-layer Llamas (8 query heads, 2 K/V heads) on 2 fake ranks."""

from __future__ import annotations

import pytest
import torch

from autosp.costs import classify
from autosp.passes.joint.checkpointing import LONG_CONTEXT_MIN_DIM
from autosp.tracing import trace_fake_step
from experiments.models import PaperModel
from experiments.paper_scale.config import PaperConfig
from experiments.paper_scale.fork import (
    FORK_TRACE,
    REPEAT_KV_ATTENTION,
    ForkTrace,
    build_llama,
    sdpa_backends,
    ulysses_kernel,
)
from simulator import Cluster

P = 2
MODEL = PaperModel(name="tiny-gqa", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8, num_kv_heads=2,
                   vocab_size=256)


def _trace(seq_len: int, *, attention: str = "sdpa", kernel: str = "fused", **options):
    torch._dynamo.reset()
    with sdpa_backends(kernel):
        compiled, _ = trace_fake_step(lambda: build_llama(MODEL.hf_config(num_layers=1), attention),
                                      seq_len=seq_len, sp_size=P, vocab_size=MODEL.vocab_size, **options)
    return compiled.report


def _graph(report, kind: str):
    (graph,) = [g for k, g in report.aot_graphs if k == kind]
    return graph


def _dim1(node) -> int | None:
    val = node.meta.get("val")
    return val.shape[1] if isinstance(val, torch.Tensor) and val.dim() >= 2 else None


@pytest.mark.parametrize("seq_len", [LONG_CONTEXT_MIN_DIM * P // 2, LONG_CONTEXT_MIN_DIM * P])
def test_fork_rule_recomputes_exactly_the_tensors_read_by_backward_with_dim1_at_least_4096(seq_len):
    report = _trace(seq_len, checkpointing="long-context", overlap_communication=False)  # graphs keep the names
    (plan,) = report.checkpoint_plans
    forward = {n.name: n for n in _graph(report, "forward").graph.nodes}
    decided = set(plan.saved) | set(plan.recomputed)
    ruled, matmuls = {}, []
    for name in plan.read_by_backward:
        node = forward[name]
        op_class = classify(node)[0]
        if op_class == "attention":  # random (dropout): never tagged, and the partitioner never recomputes it
            assert name not in decided, name
        elif name in plan.kept_across_attention or getattr(node.target, "namespace", None) == "autosp_testbed":
            assert name in plan.saved, name  # kept whatever their size
        elif op_class == "matmul":
            matmuls.append(name)  # outside torch's recomputable allowlist: never banned by the fork
        else:
            assert name in decided, name
            ruled[name] = _dim1(node)
    assert matmuls and set(matmuls) <= set(plan.recomputed)
    recomputed = {name for name in ruled if name in plan.recomputed}
    assert recomputed == {name for name, d in ruled.items() if d is not None and d >= LONG_CONTEXT_MIN_DIM}
    # the threshold matters at these lengths: sequence-sharded tensors (dim 1 = S/P) on either side of it
    shard = seq_len // P
    assert any(d == shard for d in ruled.values())
    assert bool(recomputed) == (shard >= LONG_CONTEXT_MIN_DIM)


def _attention_key_bytes(report) -> tuple[int, int]:
    """(K/V heads, bytes) of the key the attention's backward reads."""
    backward = _graph(report, "backward")
    (node,) = [n for n in backward.graph.nodes if "attention" in str(n.target) and "backward" in str(n.target)]
    key = node.args[2].meta["val"]
    return key.shape[1], key.numel() * key.element_size()


def test_repeated_kv_saved_for_backward_scales_with_query_heads():
    plain = _attention_key_bytes(_trace(64, checkpointing="long-context"))
    repeated = _attention_key_bytes(_trace(64, attention=REPEAT_KV_ATTENTION, checkpointing="long-context"))
    assert plain[0] == MODEL.num_kv_heads // P and repeated[0] == MODEL.num_heads // P
    assert repeated[1] == plain[1] * MODEL.num_heads // MODEL.num_kv_heads


def test_ulysses_kernel_follows_the_forks_enable_gqa():
    assert ulysses_kernel(FORK_TRACE, heads=24, kv_heads=8, sp_size=8) == "math"  # one K/V head per rank
    assert ulysses_kernel(FORK_TRACE, heads=24, kv_heads=8, sp_size=4) == "fused"  # does not run at fd542b4
    assert ulysses_kernel(FORK_TRACE, heads=40, kv_heads=40, sp_size=8) == "fused"  # no GQA: fused kernel
    assert ulysses_kernel(ForkTrace(), heads=24, kv_heads=8, sp_size=8) == "fused"
    assert ulysses_kernel(ForkTrace(ulysses_enable_gqa=True), heads=24, kv_heads=8, sp_size=8) == "fused"


def test_math_kernel_baseline_holds_the_fp32_score_matrix():
    from experiments.paper_scale.simulate import simulate_dynamic, step_workload

    seq_len, cluster = 256, Cluster.from_preset("a100-80gb-sxm")
    fused_config = PaperConfig(world_size=P, sp_size=P)
    math_config = PaperConfig(world_size=P, sp_size=P, fork=FORK_TRACE)
    assert ulysses_kernel(math_config.fork, heads=MODEL.num_heads, kv_heads=MODEL.num_kv_heads, sp_size=P) == "math"
    fused = step_workload("ulysses", MODEL, seq_len, 1, ranks=P, config=fused_config)
    math = step_workload("ulysses", MODEL, seq_len, 1, ranks=P, config=math_config)
    scores = MODEL.num_heads // P * seq_len * seq_len * 4  # [B, H/P, S, S] fp32 (the kernel upcasts bf16)
    (fused_rank,), (math_rank,) = fused.ranks.values(), math.ranks.values()
    assert scores in math_rank.tensors.values() and scores not in fused_rank.tensors.values()
    (_, fused_peak), (_, math_peak) = simulate_dynamic(fused, cluster), simulate_dynamic(math, cluster)
    assert math_peak - fused_peak >= scores  # the softmax kept for the backward, at least
