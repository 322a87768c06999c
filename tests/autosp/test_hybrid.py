"""strategy="hybrid": Ulysses all-to-alls inside groups of ``ulysses_size`` consecutive ranks around zig-zag ring
attention across the groups (Note [Hybrid attention] in autosp/passes/dynamo/attention.py) equals single-device
training, or is refused.

Exactness (fp32 rtol 1e-4 / atol 1e-6, loss and every gradient) against a single-device full-sequence run on 4
real gloo ranks (hybrid 2 x 2, SAC and overlap on: Llama with GQA; Qwen2 with 2 heads, 1 kv head replicated, over 4
ranks): `hybrid_four_rank_cases`, run in the ring's 4-rank launch (tests/autosp/test_ring.py), which pays the
processes' start and first compile once for both; the layout and the option's validation without ranks; the export
of a hybrid program traced on a fake group (Note [Hybrid attention in the export] in autosp/export.py), simulated.
"""

from __future__ import annotations

import pytest
import torch

from tests.autosp.test_equivalence import FP32_TOL, _check, _run_case

# --- without ranks ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("sp_size", "ulysses_size"), [(4, 2), (6, 3), (6, 2), (4, 4), (4, 1), (8, 4)])
def test_hybrid_layout_hands_each_ulysses_group_its_ring_chunks_in_rank_order(sp_size, ulysses_size):
    from autosp.inputs import shard_layout

    ring = sp_size // ulysses_size
    length = 4 * sp_size
    layouts = [shard_layout(length - 3, sp_size=sp_size, sp_rank=r, pad_to_multiple=True, zigzag=True,
                            ulysses_size=ulysses_size) for r in range(sp_size)]
    tokens = [[i for begin, end in layout.ranges for i in range(begin, end)] for layout in layouts]
    assert sorted(i for t in tokens for i in t) == list(range(length))  # padded to 2P pieces, each token once
    assert all(len(t) == layout.local_seq_len and layout.every_rank == layouts[0].every_rank
               for t, layout in zip(tokens, layouts, strict=True))
    for j in range(ring):  # what the Ulysses all-to-all gathers (rank order) is the ring's zig-zag shard of rank j
        gathered = [i for r in range(j * ulysses_size, (j + 1) * ulysses_size) for i in tokens[r]]
        ring_layout = shard_layout(length, sp_size=ring, sp_rank=j, pad_to_multiple=True, zigzag=True)
        assert gathered == [i for begin, end in ring_layout.ranges for i in range(begin, end)]
    if ulysses_size == 1:  # the ring's own layout: chunks r and 2P-1-r of 2P
        chunk = length // (2 * sp_size)
        assert [la.ranges for la in layouts] == [((r * chunk, (r + 1) * chunk), ((2 * sp_size - 1 - r) * chunk,
                                                  (2 * sp_size - r) * chunk)) for r in range(sp_size)]


def test_hybrid_options_are_validated_with_what_to_change():
    from autosp import AutoSPConfig
    from autosp.errors import AutoSPError
    from simulator.strategies import STRATEGIES

    config = AutoSPConfig(sp_size=4, strategy="hybrid", ulysses_size=2)
    assert (config.ulysses_size, config.ring_size, config.zigzag) == (2, 2, True)
    assert AutoSPConfig(sp_size=8, strategy="hybrid", ring_size=2).ulysses_size == 4
    fields = set(AutoSPConfig.__dataclass_fields__)
    options = STRATEGIES["autosp-hybrid-2x4"].options_for(fields)  # the registry's spelling runs as it is
    assert AutoSPConfig(sp_size=8, **options).ulysses_size == 2
    refusals = [
        ({"sp_size": 4, "strategy": "hybrid"}, "pass ulysses_size= a divisor of sp_size=4"),
        ({"sp_size": 4, "strategy": "hybrid", "ulysses_size": 3}, "ulysses_size=3 does not divide sp_size=4"),
        ({"sp_size": 4, "strategy": "hybrid", "ulysses_size": 0}, "ulysses_size=0 does not divide"),
        ({"sp_size": 4, "strategy": "hybrid", "ulysses_size": 2, "ring_size": 4}, "pass ring_size=2"),
        ({"sp_size": 4, "strategy": "ring", "ulysses_size": 2}, "only with strategy='hybrid'"),
        ({"sp_size": 4, "ring_size": 2}, "only with strategy='hybrid'"),
        ({"sp_size": 4, "strategy": "hybrid", "ulysses_size": 2, "length_bucket": 12},
         "multiple of 2 \\* sp_size = 8 under strategy='hybrid'"),
    ]
    for options, message in refusals:
        with pytest.raises(AutoSPError, match=message):
            AutoSPConfig(**options)


def test_hybrid_export_puts_all_to_alls_on_ulysses_groups_and_the_ring_on_ranks_u_apart():
    from autosp.costs import attention_flops
    from autosp.export import export_workload
    from autosp.tracing import trace_fake_step
    from experiments.models import build_model
    from simulator import Cluster, simulate
    from simulator.strategies import STRATEGIES
    from simulator.workload import RING_GROUPS

    seq, sp, u, heads, kv_heads, d = 64, 4, 2, 4, 1, 16
    torch._dynamo.reset()
    compiled, parameter_bytes = trace_fake_step(lambda: build_model("hf-mistral", layers=1, vocab=256), seq_len=seq,
                                                sp_size=sp, vocab_size=256,
                                                **STRATEGIES["autosp-hybrid-2x2"].compile_options)
    workload = export_workload(compiled.report.aot_graphs, name="hybrid", sp_size=sp, parameter_bytes=parameter_bytes)
    assert workload.metadata["strategy"] == "hybrid" and workload.metadata["ulysses_size"] == u
    assert workload.groups["ulysses"] == ((0, 1), (2, 3)) and not workload.symmetric
    assert all(workload.groups[g] == ((0, 2), (1, 3)) for g in RING_GROUPS)
    # After the all-to-all a rank holds heads / u query heads (and the kv head copied for it) over 2 chunks.
    local_heads, group_tokens = heads // u, seq // (sp // u)
    kv_bytes = 2 * (kv_heads * 2 // u) * group_tokens * d * 2  # bf16 K/V; the kv head replicated x2, split over u
    whole = attention_flops((1, local_heads, group_tokens, d), (1, 1, seq, d), causal=True, backward=False)
    for rank, program in workload.ranks.items():
        starts = [op.collective for op in program.ops if op.kind in ("collective", "collective_start")]
        assert {c.group for c in starts if c.kind == "all_to_all"} == {"ulysses"}
        assert {c.group for c in starts if c.kind == "all_reduce"} == {"sp"}  # the loss: over the whole SP group
        sends = [(op.phase, c.message_bytes, c.peer, c.group) for op in program.ops
                 if op.kind == "collective_start" and (c := op.collective).kind == "send" and ".ring.kv" in op.name]
        assert sends == [("forward", kv_bytes, (rank + u) % sp, RING_GROUPS[0]),
                         ("backward", kv_bytes, (rank + u) % sp, RING_GROUPS[0])]  # R - 1 = 1 per pass
        assert sum(".ring.dkv" in op.name and op.kind == "collective_start" and op.collective.kind == "recv"
                   for op in program.ops) == sp // u  # R dK/dV transfers
        flops = sum(op.flops for op in program.ops if op.op_class == "attention" and op.phase == "forward")
        assert flops == whole  # the group's queries over the whole sequence, balanced by the zig-zag
    result = simulate(workload, Cluster.from_preset("h100-sxm"))
    assert len(result.ranks) == sp and result.step_time_s > 0 and all(r.oom is None for r in result.ranks)


# --- on gloo ranks ------------------------------------------------------------------------------------------------

HYBRID = {"strategy": "hybrid", "ulysses_size": 2}


def _gather_case(rank, world):
    """Outputs gathered back to sequence order from the hybrid's pieces (a call without labels), and the backward."""
    import torch.distributed as dist

    from autosp.config import AutoSPConfig
    from autosp.context import TraceContext
    from autosp.guards import _gather_output
    from autosp.inputs import shard_layout
    from autosp.passes.dynamo.placements import Shard

    config = AutoSPConfig(sp_size=world, **HYBRID)
    layout = shard_layout(13, sp_size=world, sp_rank=rank, pad_to_multiple=True, zigzag=True,
                          ulysses_size=config.ulysses_size)
    ctx = TraceContext(sp_size=world, sp_rank=rank, group_name=dist.group.WORLD.group_name, ignore_index=-100,
                       strategy="hybrid", layout=layout)
    mine = torch.tensor([float(i) for begin, end in layout.ranges for i in range(begin, end)])[None].requires_grad_()
    full = _gather_output(mine, Shard(1), ctx)
    full.backward(torch.arange(full.shape[1], dtype=torch.float32)[None] * 10)
    return {"full": full.detach(), "grad": mine.grad, "mine": mine.detach()}


def hybrid_four_rank_cases(rank, world):
    """On each of 4 gloo ranks: the hybrid's exactness cases, a refusal and the gather (`check_hybrid_four_ranks`)."""
    import autosp
    from autosp.errors import AutoSPError
    from experiments.models import build_model

    cases = [
        {"model": "hf-llama", "sp_size": 4, "seq_len": 32, "overrides": {"layers": 1},
         "options": HYBRID},  # 8 heads, 2 kv heads: 4 and 1 a rank
        {"model": "hf-qwen2", "sp_size": 4, "seq_len": 30, "overrides": {"layers": 1, "heads": 2, "kv_heads": 1},
         "options": HYBRID},  # more ranks than heads; the kv head replicated for the 2 Ulysses ranks; padded
        # every memory technique the planner may choose for the hybrid at once (it plans the hybrid as the other
        # kinds): SAC, the tiled loss and MLP in several chunks, activation offload
        {"model": "hf-llama", "sp_size": 4, "seq_len": 64, "overrides": {"layers": 2}, "options": {
            **HYBRID, "memory_plan": "off", "checkpointing": "sac", "tiled_loss": "on", "return_logits": False,
            "loss_chunk_tokens": 6, "tiled_mlp": "on", "mlp_chunk_tokens": 6, "activation_offload": "on"}},
    ]
    results = [_run_case(rank, world, **case) for case in cases]
    try:  # 2 heads cannot be split over a Ulysses group of 4
        model = build_model("plain-llama", heads=2, kv_heads=2, layers=1)
        ids = torch.randint(0, 256, (1, 16))
        compiled = autosp.compile(model, sp_size=4, compiler="aot_eager", strategy="hybrid", ulysses_size=4)
        compiled(**autosp.prepare_inputs(ids, labels=ids))
        refused = None
    except AutoSPError as err:
        refused = str(err)
    return {"cases": results, "refused": refused, "gather": _gather_case(rank, world)}


def check_hybrid_four_ranks(out: list[dict]) -> None:
    """The assertions on every rank's `hybrid_four_rank_cases`."""
    _check([r["cases"] for r in out], FP32_TOL)
    assert out[0]["cases"][0]["sites"] == [(8, 2, 1)]  # 2 kv heads over 2 Ulysses ranks: none replicated
    assert out[0]["cases"][1]["sites"] == [(2, 1, 2)]  # 1 kv head copied for the 2 Ulysses ranks
    assert out[0]["cases"][2]["sites"] == [(8, 2, 1)] * 2  # the memory techniques' case: both layers sequence-parallel
    for r in out:
        assert "not divisible by ulysses_size=4" in r["refused"] and "one of [1, 2]" in r["refused"], r["refused"]
        gather = r["gather"]
        torch.testing.assert_close(gather["full"], torch.arange(13, dtype=torch.float32)[None], rtol=0, atol=0)
        expected = torch.where(gather["mine"] < 13, gather["mine"] * 10, 0.0)  # padding: no gradient
        torch.testing.assert_close(gather["grad"], expected, rtol=0, atol=0)
