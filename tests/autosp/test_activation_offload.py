"""Activation offload (Note [Activation offload] in autosp/passes/partitioned/offload.py): exact against a
single-device run of the full sequence (loss and every gradient, fp32 rtol 1e-4 / atol 1e-6) on two gloo ranks, for
Llama, Qwen2 and GPT-2 with SAC and overlap on, with the tiled loss and MLP, packed documents and Inductor; the graphs
it rewrites; and the device peak it lowers (experiments/cpu/peak_memory.py's two pools).  The 4-rank DP x SP case
shares the launch of tests/autosp/test_ring.py."""

from __future__ import annotations

import copy

import pytest
import torch

import autosp
from autosp import AutoSPError
from autosp.costs import VIEWS, packet_name
from autosp.passes.joint.checkpointing import attention_segments
from tests.autosp.cases import loss_of, make_sample, named_grads
from tests.autosp.test_equivalence import FP32_TOL, _check
from tests.harness import fake_process_group, run_on_ranks

OFFLOAD = torch.ops.autosp_testbed.offload_to_host.default
RELOAD = torch.ops.autosp_testbed.reload_from_host.default
RELOAD_WAIT = torch.ops.autosp_testbed.reload_wait.default
A2A_WAIT = torch.ops.autosp_testbed.all_to_all_wait.default
ON = {"activation_offload": "on"}  # SAC and overlap are on by default
TILED = {**ON, "tiled_loss": "on", "tiled_mlp": "on", "return_logits": False, "loss_chunk_tokens": 8,
         "mlp_chunk_tokens": 8}
CASES = [
    {"model": "hf-llama", "options": ON},
    {"model": "hf-qwen2", "options": TILED},
    {"model": "hf-gpt2", "options": ON},
    {"model": "hf-llama", "options": ON, "documents": [5, 40, 19]},  # packed: document attention (flex, aot_eager)
]
INDUCTOR = {"model": "hf-llama", "options": ON, "compiler": "inductor"}
SEQ_LEN = 64  # 32 tokens per rank: every offloaded activation of these models is at least OFFLOAD_MIN_BYTES
PEAK_SEQ_LEN, PEAK_LAYERS = 1024, 4
"""The peak check's length and depth: with every saved tensor freed at its last reader (Note [Boxed graphs free
their inputs] in autosp/backend.py) a short sequence peaks at the end of the backward, among the parameters'
gradients, where no activation is left to offload; at 512 tokens per rank the activations make the peak, inside the
last layer's backward, where the earlier layers' are on the host (measured: 6.16 MB -> 3.79 MB)."""


def _case(rank, world, *, model, options, compiler="aot_eager", documents=None):
    from experiments.models import build_model, vocab_size

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = build_model(model)  # 2 layers: the first layer's activations are offloaded
    reference.config.use_cache = False
    candidate = copy.deepcopy(reference)
    ids, labels = make_sample(SEQ_LEN, vocab_size(reference), seed=21)
    extra = {}
    if documents:
        extra["position_ids"] = torch.cat([torch.arange(n) for n in documents]).expand(ids.shape[0], -1).clone()
    ref_loss = loss_of(reference(input_ids=ids, labels=labels, **extra))
    ref_loss.backward()
    compiled = autosp.compile(candidate, sp_size=world, compiler=compiler, **options)
    loss = loss_of(compiled(**autosp.prepare_inputs(ids, labels=labels, **extra)))
    loss.backward()
    plans = compiled.report.offload_plans
    return {"loss": loss.detach(), "ref_loss": ref_loss.detach(), "grads": named_grads(candidate),
            "ref_grads": named_grads(reference), "offloaded": plans[-1].count if plans else 0,
            "compiler": compiled.programs[-1].compiler}


def _peaks(rank, world):
    """Device and host peaks of one (second, compiled) step of a `PEAK_LAYERS`-layer model with the offload off
    and on."""
    from experiments.cpu.peak_memory import PeakMemory
    from experiments.models import build_model

    peaks = {}
    for offload in ("off", "on"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model("hf-llama", layers=PEAK_LAYERS)
        compiled = autosp.compile(model, sp_size=world, compiler="aot_eager", activation_offload=offload)
        ids = torch.randint(0, 256, (1, PEAK_SEQ_LEN), generator=torch.Generator().manual_seed(1))
        inputs = autosp.prepare_inputs(ids, labels=ids)
        loss_of(compiled(**inputs)).backward()
        model.zero_grad(set_to_none=True)
        with PeakMemory(static=list(model.parameters())) as pm:
            loss_of(compiled(**inputs)).backward()
        peaks[offload] = (pm.peak_bytes, pm.host_peak_bytes, pm.breakdown()["host_peak_bytes"])
    return peaks


def _on_rank(rank, world):
    return {"cases": [_case(rank, world, **case) for case in CASES], "peaks": _peaks(rank, world),
            "views": _views_on_rank(rank, world)}


def test_activation_offload_exact_on_two_ranks_and_lowers_the_device_peak():
    out = run_on_ranks(_on_rank, 2, timeout_s=600)
    _check([r["cases"] for r in out], FP32_TOL)
    _check([r["views"] for r in out], FP32_TOL)  # one storage, several saved views: see below
    assert all(case["views"] and min(case["views"]) >= 2 for r in out for case in r["views"]), \
        [[case["views"] for case in r["views"]] for r in out]
    for r in out:
        assert all(case["offloaded"] > 0 for case in r["cases"]), [c["offloaded"] for c in r["cases"]]
        (off, off_host, _), (on, on_host, on_host_breakdown) = r["peaks"]["off"], r["peaks"]["on"]
        assert off_host == 0 and on_host == on_host_breakdown > 0
        assert on < off, (on, off)


def _inductor_case(rank, world):
    return [_case(rank, world, **INDUCTOR)]


@pytest.mark.slow
@pytest.mark.inductor
def test_activation_offload_exact_under_inductor():
    out = run_on_ranks(_inductor_case, 2, timeout_s=600)
    _check(out, FP32_TOL)
    assert all(r[0]["offloaded"] > 0 and r[0]["compiler"] == "inductor" for r in out)


def _graphs():
    from experiments.models import build_model, vocab_size

    model = build_model("hf-llama", layers=2)
    with fake_process_group(2, rank=1):
        compiled = autosp.compile(model, sp_size=2, compiler="aot_eager", **ON)
        ids, labels = make_sample(SEQ_LEN, vocab_size(model), seed=0)
        loss_of(compiled(**autosp.prepare_inputs(ids, labels=labels))).backward()
    return dict(compiled.report.aot_graphs), compiled.report.offload_plans[-1]


def test_activation_offload_forward_saves_host_copies_and_backward_waits_before_each_first_use():
    graphs, plan = _graphs()
    forward, backward = list(graphs["forward"].graph.nodes), list(graphs["backward"].graph.nodes)
    offloads = [n for n in forward if n.target is OFFLOAD]
    assert plan.count == len(offloads) > 0 and plan.offloaded_bytes > 0 and plan.segments == 3
    saved = forward[-1].args[0]
    calls = [n for n in forward if n.op == "call_function"]
    cut = attention_segments(calls)  # the cut the pass makes in backward, here in forward: after each attention
    last_attention = max(forward.index(a) for a, b in zip(calls, calls[1:], strict=False) if cut[b] > cut[a])
    for host in offloads:
        (x,) = host.args
        assert host in saved and x not in saved  # the copy is saved in place of x, which dies in forward
        assert all(forward.index(u) < forward.index(host) for u in x.users if u is not host)  # after the last use
        # in the first layer (the second's are read before the backward's first attention and stay): no view made
        # only to be saved, such as the partitioner's trailing detach, holds a storage to the forward's end
        assert forward.index(host) < last_attention, (x.name, forward.index(host), last_attention)
    reloads = [n for n in backward if n.target is RELOAD]
    assert len(reloads) == len(offloads)
    segments = attention_segments([n for n in backward if n.op == "call_function"])
    for reload in reloads:
        (wait,) = [u for u in reload.users if u.target is RELOAD_WAIT]
        readers = [u for u in reload.users if u is not wait]
        first = min(readers, key=backward.index)
        assert backward.index(wait) < backward.index(first)  # waited before the first reader
        # right before it: only other waits (of reloads, of the overlap pass's all-to-alls) and the views replayed on
        # other reloaded storages in between
        assert all(n.target in (RELOAD_WAIT, A2A_WAIT) or packet_name(n.target) in VIEWS
                   for n in backward[backward.index(wait) + 1:backward.index(first)])
        assert segments[reload] == segments[first] - 1  # issued one attention segment ahead
        assert reload.args[0].op == "placeholder"


def test_activation_offload_auto_needs_the_planner():
    with pytest.raises(AutoSPError, match="memory_plan='auto'"):
        autosp.AutoSPConfig(sp_size=2, activation_offload="auto", memory_plan="off")
    # with the default memory_plan, a compile that cannot be planned (no memory size on CPU) is refused
    with pytest.raises(AutoSPError, match=r"activation_offload='auto' ask\(s\) for a memory plan"):
        autosp.compile(torch.nn.Linear(2, 2), sp_size=2, activation_offload="auto")
    with pytest.raises(AutoSPError, match="activation_offload must be one of"):
        autosp.AutoSPConfig(sp_size=2, activation_offload="yes")


def test_peak_memory_counts_offload_copies_in_the_host_pool():
    from experiments.cpu.peak_memory import PeakMemory

    x = torch.randn(1000)
    with PeakMemory() as pm:
        a = x * 2  # device: 4000
        host = OFFLOAD(a)  # host: 4000
        del a  # dies in forward
        back = RELOAD(host, torch.device("cpu"))  # device: 4000 again
        del host
        RELOAD_WAIT(back)
        del back
    assert (pm.peak_live_bytes, pm.host_peak_bytes, pm.live_bytes, pm.host_live_bytes) == (4000, 4000, 0, 0)
    assert pm.breakdown()["host_peak_bytes"] == 4000 and pm.breakdown()["by_op"] == {"mul": 4000}


# --- one storage, several saved views (Note [Activation offload]: offloaded once, every view replayed) ---------

VIEWS_VOCAB, VIEWS_HIDDEN = 128, 32


class _ViewsBlock(torch.nn.Module):
    """Causal attention, then a gate over three views of one projection's output (``spelling``: ``"slice"`` cuts
    them by indexing, ``"chunk"`` by ``Tensor.chunk``, a multi-output view op read through ``getitem``): the
    products save every view, so the forward saves several views of one storage."""

    def __init__(self, spelling: str, hidden: int = VIEWS_HIDDEN, heads: int = 4):
        super().__init__()
        self.spelling, self.heads = spelling, heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)
        self.proj = torch.nn.Linear(hidden, 3 * hidden)
        self.down = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, h))
        p = self.proj(x)
        if self.spelling == "chunk":
            gate, up, extra = p.chunk(3, dim=-1)
        else:
            gate, up, extra = p[..., :h], p[..., h:2 * h], p[..., 2 * h:]
        return x + self.down(torch.tanh(gate) * up * extra.transpose(0, 1).transpose(0, 1))


class SavedViewsLM(torch.nn.Module):
    """Two `_ViewsBlock` layers and a causal-LM loss from unshifted labels, computed in forward: the first layer's
    saved views are offloaded (the last layer's are read before the backward's first attention and stay)."""

    def __init__(self, spelling: str):
        super().__init__()
        self.embed = torch.nn.Embedding(VIEWS_VOCAB, VIEWS_HIDDEN)
        self.layers = torch.nn.ModuleList(_ViewsBlock(spelling) for _ in range(2))
        self.head = torch.nn.Linear(VIEWS_HIDDEN, VIEWS_VOCAB, bias=False)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        return torch.nn.functional.cross_entropy(self.head(x).reshape(-1, VIEWS_VOCAB), shifted.reshape(-1),
                                                 ignore_index=-100)


VIEWS_CASES = [{"spelling": "slice", "options": {**ON, "checkpointing": "none"}},
               {"spelling": "chunk", "options": {**ON, "checkpointing": "none"}},
               {"spelling": "slice", "options": ON}]  # SAC on: it recomputes the products from the saved views


def _views_case(rank, world, *, spelling, options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = SavedViewsLM(spelling)
    candidate = copy.deepcopy(reference)
    ids, labels = make_sample(SEQ_LEN, VIEWS_VOCAB, seed=5)
    ref_loss = reference(input_ids=ids, labels=labels)
    ref_loss.backward()
    compiled = autosp.compile(candidate, sp_size=world, compiler="aot_eager", **options)
    loss = compiled(**autosp.prepare_inputs(ids, labels=labels))
    loss.backward()
    return {"loss": loss.detach(), "ref_loss": ref_loss.detach(), "grads": named_grads(candidate),
            "ref_grads": named_grads(reference), "views": _replayed_views(compiled.report)}


def _replayed_views(report) -> list[int]:
    """For each offloaded storage with more than one saved alias: how many saved slots its one host copy fills,
    checked against the backward (one reload, every alias rebuilt from it by view ops, the received copies of the
    other slots unread)."""
    graphs = dict(report.aot_graphs)
    forward, backward = list(graphs["forward"].graph.nodes), list(graphs["backward"].graph.nodes)
    outputs = list(forward[-1].args[0])
    received_saved = [n for n in backward if n.op == "placeholder" and not n.name.startswith("tangents")]
    saved = outputs[len(outputs) - len(received_saved):]  # the saved tensors follow the user outputs, in order
    shared = []
    for host in (n for n in forward if n.target is OFFLOAD):
        slots = [i for i, s in enumerate(saved) if s is host]
        if len(slots) < 2:
            continue
        shared.append(len(slots))
        received = [received_saved[i] for i in slots]
        readers = [p for p in received if p.users]
        assert len(readers) == 1, [p.name for p in received]
        (reload,) = [u for u in readers[0].users if u.target is RELOAD]
        rebuilt = [u for u in reload.users if u.target is not RELOAD_WAIT]
        assert rebuilt and all(packet_name(u.target) in VIEWS for u in rebuilt)
    return shared


def _views_on_rank(rank, world):
    return [_views_case(rank, world, **case) for case in VIEWS_CASES]
