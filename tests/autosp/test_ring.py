"""strategy="ring": zig-zag ring attention in the compiled program equals single-device training, or is refused.

Exactness (fp32 rtol 1e-4 / atol 1e-6, loss and every gradient) against a single-device full-sequence run on
real gloo ranks, one launch per rank count running several cases; the ring's order of transfers and compute
read from the profiler at run time; the zig-zag layout and the option's validation without ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.autosp.cases import loss_of, make_sample, named_grads
from tests.autosp.test_equivalence import FP32_TOL, _check, _run_case
from tests.autosp.test_hybrid import check_hybrid_four_ranks, hybrid_four_rank_cases
from tests.autosp.test_packed import _cases as packed_cases
from tests.autosp.test_ring_export import exported_block_kernels, run_block_kernels
from tests.harness import run_on_ranks

RING = {"strategy": "ring"}

FOUR_RANK_DOCUMENTS = [
    # Packed documents (tests/autosp/test_packed.py) on 64 tokens, the hybrid 2 x 2 (a ring of 2 groups, chunks of
    # 16): Llama (GQA) on documents of 5, 40 and 19 tokens, Qwen2 on 17 documents of 1 to 13 tokens.  (Data
    # parallelism beside the ring is the third case of `_four_rank_cases`; the document ids are per SP group.)
    {"model": "hf-llama", "documents": "three documents", "layers": 1,
     "options": {"strategy": "hybrid", "ulysses_size": 2}},
    {"model": "hf-qwen2", "documents": "seventeen documents", "layers": 1,
     "options": {"strategy": "hybrid", "ulysses_size": 2}},
]

DOCUMENT_ROWS = {
    # 48 tokens: chunks of 12 (2 ranks) or 6 (4 ranks).  One document crossing chunk borders and chunks holding
    # several documents; the second batch's rows differ, so a pair of chunks is skipped only when both rows allow.
    "uneven": [[5, 3, 27, 13]],
    "two rows": [[30, 18], [2, 2, 2, 42]],
}


# --- without ranks ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sp_size", [1, 2, 3, 4])
def test_ring_zigzag_layout_covers_the_padded_sequence_once_and_balances_causal_work(sp_size):
    from autosp.inputs import shard_layout

    layouts = [shard_layout(8 * sp_size - 1, sp_size=sp_size, sp_rank=r, pad_to_multiple=True, zigzag=True)
               for r in range(sp_size)]
    tokens = [[i for begin, end in layout.ranges for i in range(begin, end)] for layout in layouts]
    assert sorted(i for t in tokens for i in t) == list(range(8 * sp_size))  # padded to 2P chunks, once each
    assert all(len(t) == layout.local_seq_len for t, layout in zip(tokens, layouts, strict=True))
    assert len({sum(i + 1 for i in t) for t in tokens}) == 1  # every rank attends over as many causal pairs
    assert all(layout.zigzag == (sp_size > 1) for layout in layouts)


def test_ring_shard_batch_cuts_tokens_positions_and_shifted_labels_by_the_zigzag_layout():
    from autosp.inputs import prepare_inputs, shard_batch, shard_layout

    ids = torch.arange(10)[None] + 100
    batch = prepare_inputs(ids, labels=ids.clone())
    batch.pop("autosp_batch")
    shards = []
    for rank in range(2):
        layout = shard_layout(10, sp_size=2, sp_rank=rank, pad_to_multiple=True, zigzag=True)
        shards.append(shard_batch(batch, layout, ignore_index=-100, pad_token_id=0))
    # 10 tokens padded to 12, chunks of 3: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert shards[0]["position_ids"].tolist() == [[0, 1, 2, 9, 9, 9]]  # padding repeats the last position
    assert shards[1]["position_ids"].tolist() == [[3, 4, 5, 6, 7, 8]]
    assert shards[0]["input_ids"].tolist() == [[100, 101, 102, 109, 0, 0]]
    # Shifted over the whole sequence before the cut: chunk 0's last target is chunk 1's first token.
    assert shards[0]["labels"].tolist() == [[101, 102, 103, -100, -100, -100]]
    assert shards[1]["labels"].tolist() == [[104, 105, 106, 107, 108, 109]]


def test_ring_strategy_option_is_validated_with_the_registry_names():
    from autosp import AutoSPConfig
    from autosp.config import STRATEGIES
    from autosp.errors import AutoSPError
    from simulator.strategies import SEQUENCE_PARALLEL
    from simulator.strategies import STRATEGIES as REGISTRY

    # One spelling: the pass's names are the registry's (the registry's "none" is sp_size=1, not a strategy).
    assert set(STRATEGIES) | {"hybrid", "auto", "none"} == set(SEQUENCE_PARALLEL)
    assert AutoSPConfig(sp_size=2).strategy == "ulysses"
    assert REGISTRY["autosp-ring"].options_for({"strategy"}) == {"strategy": "ring"}
    AutoSPConfig(sp_size=2, strategy="ring", length_bucket=8)
    with pytest.raises(AutoSPError, match="pass plan_seq_len="):
        AutoSPConfig(sp_size=2, strategy="auto")
    with pytest.raises(AutoSPError, match="strategy must be one of"):
        AutoSPConfig(sp_size=2, strategy="ring_attention")
    with pytest.raises(AutoSPError, match="multiple of 2 \\* sp_size = 4"):
        AutoSPConfig(sp_size=2, strategy="ring", length_bucket=6)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ring_schedule_issues_each_transfer_before_its_step_compute(size):
    from autosp.ring_attention import schedule

    events = [(e.kind, e.step) for e in schedule(size)]
    assert sum(kind == "send_recv" for kind, _ in events) == size - 1
    assert [step for kind, step in events if kind == "compute"] == list(range(size))
    for step in range(size - 1):
        assert events.index(("send_recv", step)) < events.index(("compute", step)) < events.index(("wait", step))
        assert events.index(("wait", step)) < events.index(("compute", step + 1))


def test_ring_skips_the_pairs_of_chunks_whose_documents_do_not_meet_and_only_those():
    from autosp.document_attention import document_ids
    from autosp.ring_attention import Documents, blocks, rank_chunks

    def calls(rows, size):
        positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
        documents = Documents(document_ids(positions, None, by_position=True, padding=False), 2 * size)
        per_step = [blocks(rank_chunks("zigzag", size, rank), rank_chunks("zigzag", size, (rank - step) % size),
                           True, documents.reads) for rank in range(size) for step in range(size)]
        pairs = {(rank_chunks("zigzag", size, rank)[i], rank_chunks("zigzag", size, (rank - step) % size)[j])
                 for (rank, step), calls in zip([(r, s) for r in range(size) for s in range(size)], per_step,
                                                strict=True)
                 for rows, cols, _ in calls for i in rows for j in cols}
        pairs = {(a, b) for a, b in pairs if b <= a}  # a causal call over a rank's own chunks covers (a, b > a) too
        return sum(len(c) for c in per_step), pairs, documents

    # One document: every causal pair of the 4 chunks is computed, in the ring's usual calls (2 per rank-step).
    count, pairs, _ = calls([[48]], 2)
    assert pairs == {(a, b) for a in range(4) for b in range(4) if b <= a} and count == 4
    # Documents 0-4, 5-7, 8-34, 35-47 over chunks of 12: chunk 3 (tokens 36-47) reads only chunk 2's last token
    # of earlier chunks, chunk 2 reads chunks 1 and 0 (document 8-34 starts in chunk 0), chunk 1 reads chunk 0.
    count, pairs, documents = calls([[5, 3, 27, 13]], 2)
    assert pairs == {(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 2), (3, 3)}
    assert not documents.reads(3, 0) and not documents.reads(3, 1) and documents.reads(3, 2)
    assert count == 5  # rank 0: its two diagonals apart (3 reads nothing of 0), then (3, 2) alone; rank 1 as before
    # A pair is skipped only when no row of the batch reads it.
    _, pairs, _ = calls([[5, 3, 27, 13], [48]], 2)
    assert pairs == {(a, b) for a in range(4) for b in range(4) if b <= a}
    # Four ranks (chunks of 6), documents no longer than a chunk: only the diagonal and each previous chunk.
    _, pairs, _ = calls([[3, 6, 6, 6, 6, 6, 6, 6, 3]], 4)
    assert pairs == {(a, b) for a in range(8) for b in (a - 1, a) if b >= 0}


# --- the block kernels (Note [Ring block kernels]) ------------------------------------------------------------------

H100, A10, T4 = (9, 0), (8, 6), (7, 5)
ONLY_CUDNN = {"flash": False, "efficient": False}


@pytest.mark.parametrize("device,capability,backends,dtype,head_dim,masked,expected", [
    ("cpu", None, {}, torch.float32, 16, False, "flash_cpu"),
    ("cpu", None, {}, torch.float64, 12, True, "flash_cpu"),  # the CPU kernel takes any head dimension and masks
    ("cpu", None, {}, torch.bfloat16, 64, False, "flash_cpu"),
    ("cuda", H100, {}, torch.bfloat16, 128, False, "flash_cuda"),
    ("cuda", H100, {}, torch.float16, 224, False, "flash_cuda"),
    ("cuda", H100, {}, torch.bfloat16, 128, True, "efficient_cuda"),  # flash takes no mask
    ("cuda", H100, {}, torch.float32, 64, False, "efficient_cuda"),  # flash: fp16/bf16 only
    ("cuda", H100, {}, torch.float32, 12, False, "efficient_cuda"),  # fp32: a multiple of 4 will do
    ("cuda", H100, {}, torch.bfloat16, 288, False, "efficient_cuda"),  # flash: head dimension up to 256
    ("cuda", A10, {}, torch.bfloat16, 224, False, "efficient_cuda"),  # flash's backward on sm86: up to 192
    ("cuda", T4, {}, torch.float16, 64, False, "efficient_cuda"),  # flash needs sm80
    ("cuda", H100, {"flash": False}, torch.bfloat16, 128, False, "efficient_cuda"),  # torch.backends' switches
    ("cuda", H100, ONLY_CUDNN, torch.bfloat16, 128, True, "cudnn_cuda"),
    ("cuda", T4, {}, torch.bfloat16, 64, False, "math"),  # bf16 before sm80: no fused kernel
    ("cuda", H100, {}, torch.float64, 64, False, "math"),  # no fused fp64 kernel on CUDA
    ("cuda", H100, {}, torch.bfloat16, 12, False, "math"),  # fp16/bf16 need a multiple of 8
    ("cuda", H100, ONLY_CUDNN, torch.bfloat16, 256, False, "math"),  # cuDNN: up to 128
    ("mps", None, {}, torch.float32, 64, False, "math"),  # no fused kernel returning the log-sum-exp
])
def test_ring_block_kernel_is_the_fused_kernel_the_device_supports_and_the_math_path_only_where_none_does(
        device, capability, backends, dtype, head_dim, masked, expected):
    import warnings

    from autosp.ring_block_kernels import CudaDevice, MathBlockWarning, block_kernel

    cuda = CudaDevice(capability, **backends) if capability else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel = block_kernel(device, dtype, head_dim, masked=masked, cuda=cuda)
    assert kernel.value == expected and kernel.fused == (expected != "math")
    warned = [str(w.message) for w in caught if issubclass(w.category, MathBlockWarning)]
    if expected == "math":  # the warning names the cost
        (message,) = warned
        assert "[Lq, Lk] scores" in message and "quadratic in the block length" in message, message
    else:
        assert not warned


@pytest.mark.parametrize("kernel,masked", [("flash_cuda", False), ("efficient_cuda", False), ("efficient_cuda", True),
                                           ("cudnn_cuda", False), ("cudnn_cuda", True)])
def test_ring_cuda_block_kernels_call_their_ops_as_the_ops_schemas_take_them(kernel, masked):
    """The CUDA kernels' calls (untried on a GPU) run on meta tensors through each op's meta kernel: arguments as
    the schema takes them, output [B, H, Lq, D], log-sum-exp [B, H, Lq] fp32 (the memory-efficient kernel's rows
    unpadded), gradients of the block's q, k, v."""
    from autosp.ring_block_kernels import BlockKernel, block_backward, block_forward

    meta = {"device": "meta", "dtype": torch.bfloat16}
    q, k, v = torch.empty(2, 4, 48, 64, **meta), torch.empty(2, 4, 80, 64, **meta), torch.empty(2, 4, 80, 64, **meta)
    mask = (torch.empty(2, 1, 48, 80, **meta), torch.empty(2, 1, 48, dtype=torch.bool, device="meta")) if masked else None
    out, lse = block_forward(BlockKernel(kernel), q, k, v, False, 0.125, mask)
    assert (tuple(out.shape), out.dtype, tuple(lse.shape), lse.dtype) == ((2, 4, 48, 64), q.dtype, (2, 4, 48),
                                                                          torch.float32)
    grads = block_backward(BlockKernel(kernel), out, q, k, v, out, lse, False, 0.125, mask)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]


# --- on gloo ranks ------------------------------------------------------------------------------------------------


def _order_and_graphs(rank, world):
    """Compile a 2-layer model with the ring, run a step under the profiler; the ring's events and graph ops."""
    import autosp
    from experiments.models import build_model, vocab_size

    torch.manual_seed(0)
    model = build_model("plain-llama", layers=2)
    compiled = autosp.compile(model, sp_size=world, compiler="aot_eager", strategy="ring")
    ids, labels = make_sample(32, vocab_size(model), seed=7)
    compiled(**autosp.prepare_inputs(ids, labels=labels))  # compile outside the profiled step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_of(compiled(**autosp.prepare_inputs(ids, labels=labels))).backward()
    events = sorted((e.time_range.start, e.name) for e in prof.events() if e.name.startswith("autosp.ring"))
    graphs = {phase: [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
              for phase, gm in compiled.report.aot_graphs}
    return {"events": [name for _, name in events if name.startswith("autosp.ring.")], "graphs": graphs,
            "blocks": run_block_kernels(name for _, name in events)}


def _no_labels_case(rank, world):
    """Called without labels: the logits are gathered back into sequence order from the zig-zag shards."""
    import torch.nn.functional as F

    import autosp
    from experiments.models import build_model, vocab_size

    torch.manual_seed(0)
    reference = build_model("plain-llama")
    candidate = copy.deepcopy(reference)
    ids, labels = make_sample(24, vocab_size(reference), seed=3)

    def loss(logits):
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    ref_logits = reference(input_ids=ids)
    loss(ref_logits).backward()
    compiled = autosp.compile(candidate, sp_size=world, compiler="aot_eager", strategy="ring")
    logits = compiled(**autosp.prepare_inputs(ids))
    loss(logits).backward()
    return {"logits": (logits.detach(), ref_logits.detach()), "grads": named_grads(candidate),
            "ref_grads": named_grads(reference)}


def _masks_case(rank, world):
    """A Hugging Face Llama (GQA) with use_cache=False builds its mask from the position ids: the ring applies it as
    document ids, one program for a row of one sequence and for packed documents of uneven lengths (10 and 22
    tokens: chunks of 8, one holding two documents, one document crossing three chunks, pairs of chunks skipped);
    a padding mask is refused.  (With the default use_cache=True it builds no mask from them, attending across
    documents on one device too.)"""
    import autosp
    from autosp.errors import AutoSPError
    from experiments.models import build_model, vocab_size

    torch.manual_seed(0)
    reference = build_model("hf-llama")
    reference.config.use_cache = False
    ids, labels = make_sample(32, vocab_size(reference), seed=5)
    candidate = copy.deepcopy(reference)
    compiled = autosp.compile(candidate, sp_size=world, compiler="aot_eager", strategy="ring")
    out = {}
    for name, extra in (("plain", {}), ("packed", {"document_lengths": [10, 22]})):
        reference.zero_grad(set_to_none=True)
        candidate.zero_grad(set_to_none=True)
        batch = autosp.prepare_inputs(ids, labels=labels, **extra)
        ref_loss = loss_of(reference(input_ids=ids, labels=labels, position_ids=batch["position_ids"]))
        ref_loss.backward()
        loss = loss_of(compiled(**batch))
        loss.backward()
        out[name] = {"loss": (loss.detach(), ref_loss.detach()), "grads": named_grads(candidate),
                     "ref_grads": named_grads(reference)}
    out["programs"] = len(compiled.programs)
    out["plain_positions"] = compiled.report.requires_plain_positions
    mask = torch.ones_like(ids)
    mask[:, -3:] = 0
    try:
        compiled(**autosp.prepare_inputs(ids, labels=labels, attention_mask=mask))  # a new program (a mask input)
        out["refusal"] = None
    except AutoSPError as err:
        out["refusal"] = str(err)
    return out


def _op_case(rank, world):
    """The op alone, eager, against full-sequence SDPA: causal and not, GQA, zig-zag and contiguous layouts."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from autosp.ring_attention import rank_chunks, ring_attention

    group = dist.group.WORLD
    errors = {}
    for layout in ("zigzag", "contiguous"):
        for causal in (True, False):
            g = torch.Generator().manual_seed(11)
            q, k, v = (torch.randn(2, heads, 24, 8, generator=g, dtype=torch.float64) for heads in (4, 2, 2))
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
            grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
            ref.backward(grad)
            chunks = rank_chunks(layout, world, rank)
            size = 24 // (2 * world if layout == "zigzag" else world)
            index = torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])
            local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
            out, _ = ring_attention(*local, 8 ** -0.5, causal, layout, group.group_name, world)
            out.backward(grad[:, :, index])
            errors[(layout, causal)] = [float((a - b[:, :, index]).abs().max()) for a, b in
                                        [(out, ref)] + [(x.grad, y.grad) for x, y in zip(local, full, strict=True)]]
    errors.update(_documents_op_errors(rank, world))
    return errors


def _documents_op_errors(rank, world):
    """The op over packed documents, eager, against dense causal attention within documents (fp64), on rows that
    skip pairs of chunks and rows that do not; the zig-zag layout."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from autosp.document_attention import document_ids
    from autosp.ring_attention import rank_chunks, ring_attention

    length, chunk = 48, 48 // (2 * world)
    errors = {}
    for name, lengths in DOCUMENT_ROWS.items():
        g = torch.Generator().manual_seed(13)
        positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
        ids = document_ids(positions, None, by_position=True, padding=False)
        q, k, v = (torch.randn(len(lengths), heads, length, 8, generator=g, dtype=torch.float64) for heads in (4, 2, 2))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        allowed = (ids[:, :, None] == ids[:, None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
        ref = F.scaled_dot_product_attention(*full, attn_mask=allowed[:, None], enable_gqa=True)
        grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        ref.backward(grad)
        index = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in rank_chunks("zigzag", world, rank)])
        local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
        out, _ = ring_attention(*local, 8 ** -0.5, True, "zigzag", dist.group.WORLD.group_name, world, ids)
        out.backward(grad[:, :, index])
        errors[("documents", name)] = [float((a.detach() - b[:, :, index]).abs().max()) for a, b in
                                       [(out, ref)] + [(x.grad, y.grad) for x, y in zip(local, full, strict=True)]]
    return errors


def _two_rank_cases(rank, world):
    cases = [
        {"model": "hf-qwen2", "sp_size": 2, "seq_len": 32, "options": RING},  # GQA: 4 heads, 2 kv heads
        {"model": "plain-llama", "sp_size": 2, "seq_len": 30, "overrides": {"heads": 4, "kv_heads": 1},
         "options": {**RING, "checkpointing": "none", "overlap_communication": False}},  # padded to 2P chunks
    ]
    results = [_run_case(rank, world, **case) for case in cases]
    return {"cases": results, "no_labels": _no_labels_case(rank, world), "order": _order_and_graphs(rank, world),
            "masks": _masks_case(rank, world), "op": _op_case(rank, world)}


def test_ring_two_ranks_matches_single_device_and_overlaps_each_transfer_with_compute():
    out = run_on_ranks(_two_rank_cases, 2, timeout_s=600)
    # Each block ran the kernel `block_kernel` names (the CPU flash kernel), and the export of the same program,
    # traced on fake tensors, names the same one for every block of every rank (Note [Ring block kernels]).
    from autosp.export import export_workload
    from autosp.tracing import trace_fake_step
    from experiments.models import build_model, vocab_size

    torch._dynamo.reset()
    model = build_model("plain-llama", layers=2)
    compiled, parameter_bytes = trace_fake_step(lambda: build_model("plain-llama", layers=2), seq_len=32, sp_size=2,
                                                vocab_size=vocab_size(model), dtype=torch.float32, strategy="ring")
    exported = export_workload(compiled.report.aot_graphs, name="ring", sp_size=2, parameter_bytes=parameter_bytes)
    for rank, r in enumerate(out):
        assert len(r["order"]["blocks"]) == 2 * 2 * 2  # 2 layers, forward and backward, 2 steps of one call
        assert {kernel for *_, kernel in r["order"]["blocks"]} == {"flash_cpu"}
        assert exported_block_kernels(exported.ranks[rank]) == r["order"]["blocks"]
    _check([r["cases"] for r in out], FP32_TOL)
    assert out[0]["cases"][0]["sites"] == [(4, 2, 1)] * 2  # kv heads travel unreplicated
    for r in out:
        logits, ref_logits = r["no_labels"]["logits"]
        torch.testing.assert_close(logits, ref_logits, **FP32_TOL)
        for name, grad in r["no_labels"]["grads"].items():
            torch.testing.assert_close(grad, r["no_labels"]["ref_grads"][name], **FP32_TOL)
        # Per attention forward: P - 1 = 1 transfer, issued before the compute of the block it overlaps.
        forward = [name for name in r["order"]["events"] if name.startswith("autosp.ring.forward.")]
        per_attention = ["send_recv.0", "compute.0", "wait.0", "compute.1"]
        assert forward == [f"autosp.ring.forward.{e}" for e in per_attention] * 2, forward
        backward = [name for name in r["order"]["events"] if name.startswith("autosp.ring.backward.")]
        assert sum(".send_recv." in n for n in backward) == 2 and sum(".grad_send_recv." in n for n in backward) == 4
        graphs = r["order"]["graphs"]
        fwd = [t for phase, targets in graphs.items() if phase == "forward" for t in targets]
        bwd = [t for phase, targets in graphs.items() if phase == "backward" for t in targets]
        assert sum("ring_attention.default" in t for t in fwd) == 2 and not any("all_to_all" in t for t in fwd)
        assert sum("ring_attention_backward" in t for t in bwd) == 2
        for case, errors in r["op"].items():  # fp64: exact up to rounding
            assert max(errors) < 1e-12, (case, errors)
        masks = r["masks"]  # Hugging Face Llama, GQA: 8 heads, 2 kv heads
        assert masks["programs"] == 1 and not masks["plain_positions"]  # one program for plain and packed rows
        for kind in ("plain", "packed"):
            torch.testing.assert_close(*masks[kind]["loss"], **FP32_TOL)
            assert masks[kind]["grads"].keys() == masks[kind]["ref_grads"].keys()
            for name, grad in masks[kind]["grads"].items():
                torch.testing.assert_close(grad, masks[kind]["ref_grads"][name], **FP32_TOL)
        assert masks["refusal"] is not None and "a padding mask" in masks["refusal"], masks["refusal"]
        assert "strategy='ulysses'" in masks["refusal"]


def _four_rank_cases(rank, world):
    import autosp
    from autosp.errors import AutoSPError
    from experiments.models import build_model

    cases = [
        {"model": "hf-llama", "sp_size": 4, "seq_len": 32, "options": RING},  # 2 kv heads < 4 ranks
        {"model": "plain-llama", "sp_size": 4, "seq_len": 30, "overrides": {"heads": 2, "kv_heads": 2},
         "options": RING},  # more ranks than heads
        {"model": "plain-llama", "sp_size": 2, "seq_len": 32, "overrides": {"kv_heads": 2},
         "options": RING},  # SP 2 x DP 2
        # packed documents under SP 2 x DP 2 on the ring, each replica its own packing (chunks of 16; the ids
        # and the skipped pairs are per SP group)
        {"model": "hf-llama", "sp_size": 2, "seq_len": 64, "options": RING, "documents": [[5, 40, 19], [30, 34]]},
        # activation offload (tests/autosp/test_activation_offload.py) under SP 2 x DP 2 on the ring
        {"model": "hf-llama", "sp_size": 2, "seq_len": 64, "options": {**RING, "activation_offload": "on"}},
    ]
    results = [_run_case(rank, world, **case) for case in cases]
    try:  # Ulysses cannot run the 2-head model on 4 ranks
        model = build_model("plain-llama", heads=2, kv_heads=2)
        ids = torch.randint(0, 256, (1, 16))
        autosp.compile(model, sp_size=4, compiler="aot_eager")(**autosp.prepare_inputs(ids, labels=ids))
        ulysses = None
    except AutoSPError as err:
        ulysses = str(err)
    # The hybrid's 4-rank cases (tests/autosp/test_hybrid.py) share this launch: one start, one first compile.
    return {"cases": results, "ulysses": ulysses, "hybrid": hybrid_four_rank_cases(rank, world),
            "documents": packed_cases(rank, world, FOUR_RANK_DOCUMENTS)}


@pytest.mark.slow
def test_ring_four_ranks_gqa_more_ranks_than_heads_and_data_parallel_and_the_hybrid_match_single_device():
    out = run_on_ranks(_four_rank_cases, 4, timeout_s=900)
    _check([r["cases"] for r in out], FP32_TOL)
    for r in out:  # only the packed case applies document masks (one per layer), by position
        masks = [c["masks"] for c in r["cases"]]
        assert masks[3] and set(masks[3]) == {(True, False, None)} and not any(masks[:3] + masks[4:])
    assert all("strategy='ring'" in r["ulysses"] for r in out)
    check_hybrid_four_ranks([r["hybrid"] for r in out])
    _check([r["documents"] for r in out], FP32_TOL)
    assert all(r["rules"] == [(True, False, None)] for r in out[0]["documents"])  # documents by position
