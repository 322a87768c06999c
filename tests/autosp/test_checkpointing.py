"""Sequence-aware activation checkpointing: the pure decision, and what the real joint graph saves and recomputes."""

from __future__ import annotations

import pytest
import torch

import autosp
from autosp.costs import VIEWS, classify, nbytes_of, packet_name
from autosp.passes.joint.checkpointing import Candidate, choose_recomputation
from experiments.models import build_model, vocab_size
from tests.autosp.cases import make_sample
from tests.harness import fake_process_group

A2A = torch.ops.autosp_testbed.all_to_all.default

# ---- the decision on plain data -------------------------------------------------------------------------------

CHEAP = Candidate("norm", "cheap", flops=10, nbytes=400)
MM_SMALL_K = Candidate("up_proj", "matmul", flops=1_000, nbytes=400)  # 2.5 FLOPs per byte
MM_LARGE_K = Candidate("down_proj", "matmul", flops=4_000, nbytes=400)  # 10 FLOPs per byte


@pytest.mark.parametrize(
    ("forward_flops", "limit", "budget", "expected"),
    [
        (100_000, 0.0, None, {"norm"}),  # cheap ops always; no matmul within a zero FLOP limit
        (100_000, 0.01, None, {"norm", "up_proj"}),  # 1 % of forward: the cheaper-per-byte matmul only
        (100_000, 0.05, None, {"norm", "up_proj", "down_proj"}),  # long sequence: attention makes both affordable
        (5_000, 0.1, None, {"norm"}),  # short sequence: matmuls dominate, none qualifies
        (5_000, 0.1, 0.5, {"norm", "up_proj"}),  # budget: keep at most half the bytes -> one matmul more
        (5_000, 0.0, 0.0, {"norm", "up_proj", "down_proj"}),  # zero budget: recompute everything recomputable
    ],
)
def test_checkpointing_choice_recomputes_cheap_ops_and_matmuls_within_the_limits(forward_flops, limit, budget,
                                                                                 expected):
    chosen = choose_recomputation([MM_LARGE_K, CHEAP, MM_SMALL_K], forward_flops=forward_flops,
                                  recompute_limit=limit, memory_budget=budget)
    assert chosen == expected


# ---- the real joint graph of a small model ---------------------------------------------------------------------


def _graphs(setting: str, **options):
    model = build_model("hf-llama", layers=2, hidden=64)
    with fake_process_group(2, rank=0):
        compiled = autosp.compile(model, sp_size=2, compiler="aot_eager", checkpointing=setting,
                                  overlap_communication=False, **options)
        ids, labels = make_sample(64, vocab_size(model), seed=0)
        compiled(**autosp.prepare_inputs(ids, labels=labels)).loss.backward()
    graphs = dict(compiled.report.aot_graphs)
    return graphs["forward"], graphs["backward"], compiled.report.checkpoint_plans[-1]


def _compute_nodes(gm) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes if n.op == "call_function" and packet_name(n.target) not in VIEWS}


def _base(node: torch.fx.Node) -> torch.fx.Node:
    while packet_name(node.target) in VIEWS - {"getitem"} and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _saved(forward, backward) -> dict[str, torch.fx.Node]:
    """Forward tensors the backward reads, resolved through views (AOTAutograd names the backward placeholder
    after the forward node; a view of a tensor keeps that tensor alive)."""
    placeholders = {n.name for n in backward.graph.nodes if n.op == "placeholder"}
    bases = (_base(n) for n in forward.graph.nodes if n.op == "call_function" and n.name in placeholders)
    return {n.name: n for n in bases}


def _recomputed(forward, backward) -> dict[str, torch.fx.Node]:
    fw = _compute_nodes(forward)
    return {name: n for name, n in _compute_nodes(backward).items() if name in fw}


def _saved_bytes(forward, backward) -> int:
    return sum(nbytes_of(n.meta.get("val")) for n in _saved(forward, backward).values())


def _is_attention(node) -> bool:
    return classify(node)[0] == "attention"


def test_checkpointing_sac_saves_attention_outputs_and_recomputes_sequence_activations():
    forward, backward, plan = _graphs("sac", sac_memory_budget=0.0)
    saved, recomputed = _saved(forward, backward), _recomputed(forward, backward)
    attention = [n for n in _compute_nodes(forward).values() if _is_attention(n)]
    assert len(attention) == 2
    for node in attention:  # the attention output and its log-sum-exp are read by backward, not recomputed
        outputs = [u.name for u in node.users]
        assert outputs and all(name in saved for name in outputs[:2])
        assert node.name not in recomputed
    # O(S) activations recomputed: at least one matmul and one elementwise op over the local [B, S/P, ...] tokens
    local_tokens = (32, 2 * 32)  # 64 tokens over 2 ranks: [B, S/P, ...] or, flattened for a matmul, [B * S/P, ...]
    sequence_shaped = [n for n in recomputed.values() if isinstance(n.meta["val"], torch.Tensor)
                       and any(d in local_tokens for d in n.meta["val"].shape)]
    assert any(classify(n)[0] == "matmul" for n in sequence_shaped)
    assert any(classify(n)[0] == "elementwise" for n in sequence_shaped)
    # No collective is recomputed: the backward's all-to-alls are only the forward ones' gradients.
    assert not any(n.target is A2A for n in recomputed.values())
    assert sum(1 for n in backward.graph.nodes if n.target is A2A) == 4 * 2
    assert plan.recomputed and plan.recompute_flops > 0


def test_checkpointing_layer_recomputes_the_all_to_alls_and_keeps_only_the_residual_stream():
    forward, backward, plan = _graphs("layer")
    recomputed = _recomputed(forward, backward)
    # Per-layer checkpointing as torch.utils.checkpoint runs it: the forward all-to-alls (q, k, v, output of both
    # layers) run again in backward, beside their gradients'.
    assert sum(1 for n in recomputed.values() if n.target is A2A) == 4 * 2
    assert sum(1 for n in backward.graph.nodes if n.target is A2A) == 2 * 4 * 2
    saved = _saved(forward, backward)
    assert not any(n.target is A2A for n in saved.values())
    assert "_log_softmax" in saved  # outside the decoder layers (the loss) kept, as autograd keeps it
    # The last layer's output, read by the final norm outside the layers, is kept (Note [The last layer's output]):
    # its backward does not recompute the last layer first (whose down projection its own backward never reads).
    final_norm_input = _base([n for n in forward.graph.nodes if packet_name(n.target) == "pow"][-1].args[0])
    assert final_norm_input.name in saved and final_norm_input.name not in recomputed
    assert _saved_bytes(forward, backward) < _saved_bytes(*_graphs("full")[:2])
    assert plan.kept_across_attention and plan.recomputed


def test_checkpointing_settings_order_the_saved_bytes():
    none = _saved_bytes(*_graphs("none")[:2])
    forward, backward, _ = _graphs("none")
    assert _recomputed(forward, backward) == {}  # "none" recomputes nothing
    sac_auto = _saved_bytes(*_graphs("sac")[:2])
    sac_zero_budget = _saved_bytes(*_graphs("sac", sac_memory_budget=0.0)[:2])
    full = _saved_bytes(*_graphs("full")[:2])
    assert none > sac_auto >= sac_zero_budget >= full
    assert sac_zero_budget < 0.7 * none


def test_aot_eager_graphs_free_each_input_at_its_last_reader():
    """Note [Boxed graphs free their inputs] (autosp/backend.py): a saved tensor dies at its last reader in the
    backward, not when the backward returns (as it did with the graph called on the list still held)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    from autosp.backend import _boxed_runner

    def f(a, b):
        s = a.sum()  # the last reader of a
        return (b * s,)

    graph = torch.fx.symbolic_trace(f)

    def a_alive_at_mul(run) -> bool:
        args = [torch.ones(1024), torch.ones(8)]
        a, seen = weakref.ref(args[0]), []

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten.mul.Tensor:
                    seen.append(a() is not None)
                return func(*args, **(kwargs or {}))

        with Watch():
            out = run(args)
        assert torch.equal(out[0], torch.full((8,), 1024.0))
        return seen == [True]

    assert not a_alive_at_mul(_boxed_runner(graph))
    assert a_alive_at_mul(lambda args: graph.forward(*args))  # the list held through the call
