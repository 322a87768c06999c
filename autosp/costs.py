"""What one aten node costs: its op class, FLOPs and bytes (shared by SAC and the schedule export).

FLOPs: matmuls 2·M·N·K; attention counted here (torch's FLOP counter misses the
CPU kernels): forward 4·B·H·Sq·Sk·D, backward 2.5× forward (five matmuls to
two), halved under causal masking, scaled by the kept fraction of the scores under
a document mask (flex_attention, Note [Document masks]); the tiled logits and loss as the matmuls they run
(Note [Tiled logits and loss]) and the tiled MLP likewise (Note [Tiled MLP]), with the scratch of one chunk
(`workspace_bytes`); reductions one FLOP per
input element; elementwise ops one FLOP per output element; views and data movement none.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch
from torch import fx

from autosp import ring_attention, tiled_ops  # noqa: F401 - registers the ring, tiled loss and tiled MLP ops priced below

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}
VIEWS = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
    "squeeze", "alias", "as_strided", "detach", "split", "unbind", "chunk", "split_with_sizes", "diagonal",
    "_reshape_alias", "view_as_real", "view_as_complex", "unflatten", "flatten", "getitem",
}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "_log_softmax", "_softmax", "nll_loss_forward",
               "nll_loss_backward", "_log_softmax_backward_data", "var_mean", "native_layer_norm"}
_MEMORY = {"clone", "copy", "_to_copy", "cat", "stack", "constant_pad_nd", "index", "embedding",
           "embedding_dense_backward", "new_zeros", "zeros", "full", "empty", "scatter", "gather", "repeat_interleave",
           "index_put", "slice_scatter", "select_scatter", "arange", "ones", "zeros_like", "full_like", "empty_like"}


def packet_name(target) -> str:
    """The op's overload packet name: aten.mm.default -> \"mm\"."""
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def tensors_of(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def nbytes_of(value) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(value))


def schema_arg(node: fx.Node, name: str, default=None):
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return default
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name, default)
    return default


def attention_scores(q_shape, k_shape, *, causal: bool, backward: bool, kept: float | None = None) -> int:
    """Query-key scores of scaled-dot-product attention for q [B, H, Sq, D] and k [B, Hk, Sk, D].

    B·H·Sq·Sk, halved under causal masking, or times ``kept`` (the fraction of the Sq·Sk scores a mask keeps)
    when given; the backward counts 2.5x like its FLOPs (it recomputes the probabilities and forms their
    gradient: measured on CPU, its time per score is 2.5-2.7x the forward's at every head dimension).
    """
    *batch, s_q, _ = q_shape
    scores = math.prod(batch) * s_q * k_shape[-2]
    if kept is not None:
        scores = int(scores * kept)
    elif causal:
        scores //= 2
    return int(scores * 2.5) if backward else scores


def attention_flops(q_shape, k_shape, *, causal: bool, backward: bool, kept: float | None = None) -> int:
    """FLOPs of scaled-dot-product attention for q [B, H, Sq, D] and k [B, Hk, Sk, D]: 4·D per score."""
    return 4 * q_shape[-1] * attention_scores(q_shape, k_shape, causal=causal, backward=backward, kept=kept)


FLEX_ATTENTION = ("flex_attention", "flex_attention_backward")
"""Packets of the flex_attention higher-order ops (document-masked attention)."""


RING_ATTENTION = ("ring_attention", "ring_attention_backward")
"""Packets of AutoSP's ring attention (autosp/ring_attention.py): priced as attention of this rank's queries over
the whole sequence's keys (group_size times the local ones)."""


RNG_WRAPPERS = {"run_and_save_rng_state": 0, "run_with_rng_state": 1}
"""Higher-order ops that run one op under a saved RNG state (per-layer checkpointing's attention, forward and
recomputed) -> the position of that op among their arguments (its own arguments follow it)."""


def _wrapped(node: fx.Node):
    """The call an RNG wrapper runs, as a node-like (target, args, kwargs) that `schema_arg` reads; else ``node``."""
    index = RNG_WRAPPERS.get(packet_name(node.target)) if node.op == "call_function" else None
    if index is None or len(node.args) <= index:
        return node
    return SimpleNamespace(op="call_function", target=node.args[index], args=node.args[index + 1:],
                           kwargs=node.kwargs)


def _attention_shapes(node: fx.Node):
    """(q shape, k shape, causal, backward, flex) of an attention node (or an RNG wrapper running one), None for
    any other node."""
    node = _wrapped(node)
    packet = packet_name(node.target)
    if packet in RING_ATTENTION and getattr(node.target, "namespace", None) == "autosp_testbed":
        backward = packet == RING_ATTENTION[1]
        q, k = node.args[1:3] if backward else node.args[0:2]
        k_shape = list(k.meta["val"].shape)
        k_shape[-2] *= int(schema_arg(node, "group_size"))
        return q.meta["val"].shape, tuple(k_shape), bool(schema_arg(node, "causal")), backward, False
    flex = packet in FLEX_ATTENTION
    if not (flex or "scaled_dot_product" in packet or "flash_attention" in packet or "efficient_attention" in packet):
        return None
    backward = "backward" in packet
    q, k = node.args[1:3] if backward and not flex else node.args[0:2]
    causal = flex or bool(schema_arg(node, "is_causal", False))
    return q.meta["val"].shape, k.meta["val"].shape, causal, backward, flex


def attention_scores_of(node: fx.Node, *, masked_fraction: float | None = None) -> int:
    """Query-key scores an attention node evaluates (see `attention_scores`); 0 for any other node.
    ``masked_fraction``: the fraction of the scores a document mask keeps (flex_attention nodes; None: priced
    as causal)."""
    shapes = _attention_shapes(node)
    if shapes is None:
        return 0
    q, k, causal, backward, flex = shapes
    return attention_scores(q, k, causal=causal, backward=backward, kept=masked_fraction if flex else None)


ACTIVATION_OFFLOAD = ("offload_to_host", "reload_from_host", "reload_wait")
"""Packets of activation offload's ops (autosp/ops.py): a copy to host memory, the copy back and the wait for it.
The export writes them as device<->host copies, not kernels (Note [Activation offload in the export] in
autosp/export.py); they cost no FLOPs."""


TILED_LOSS = (torch.ops.autosp_testbed.linear_cross_entropy.default,
              torch.ops.autosp_testbed.linear_cross_entropy_backward.default)
"""The tiled logits and loss, forward and backward (Note [Tiled logits and loss] in autosp/tiled_ops.py)."""


def _tiled_loss_dims(node: fx.Node) -> tuple[int, int, int, int]:
    """(rows N, hidden size H, vocabulary V, tokens per chunk) of a tiled-loss node."""
    rows, width = schema_arg(node, "hidden").meta["val"].shape
    vocab = schema_arg(node, "weight").meta["val"].shape[0]
    return int(rows), int(width), int(vocab), int(schema_arg(node, "chunk_tokens"))


def tiled_loss_flops(node: fx.Node) -> int:
    """The logits matmul forward (2·N·H·V); backward its recomputation and the gradient of the hidden states,
    plus the weight's gradient when it is computed (2 or 3 × 2·N·H·V).  The softmax's few FLOPs per logit are
    left out, as for an untiled matmul."""
    rows, width, vocab, _ = _tiled_loss_dims(node)
    backward = node.target is TILED_LOSS[1]
    matmuls = (3 if schema_arg(node, "weight_grad") else 2) if backward else 1
    return matmuls * 2 * rows * width * vocab


TILED_MLP = (torch.ops.autosp_testbed.tiled_mlp.default, torch.ops.autosp_testbed.tiled_mlp_backward.default)
"""The tiled MLP, forward and backward (Note [Tiled MLP] in autosp/tiled_ops.py)."""
_MLP_PARAMS = ("w_in0", "b_in0", "w_in1", "b_in1", "w_out", "b_out")


def _tiled_mlp_dims(node: fx.Node) -> tuple[int, int, int, int, int, int]:
    """(rows N, width H, intermediate I, output width O, input projections k, tokens per chunk) of a tiled-MLP
    node."""
    rows, width = schema_arg(node, "x").meta["val"].shape
    intermediate = schema_arg(node, "w_in0").meta["val"].shape[0]
    projections = 1 if schema_arg(node, "w_in1") is None else 2
    out = schema_arg(node, "w_out").meta["val"].shape[0]
    return int(rows), int(width), int(intermediate), int(out), projections, int(schema_arg(node, "chunk_tokens"))


def tiled_mlp_flops(node: fx.Node) -> int:
    """Forward: the projections' matmuls, 2·N·I·(k·H + O).  Backward: their recomputation (k·2·N·H·I), the
    gradient of the activation (2·N·O·I) and, for each gradient computed, its matmul (the input's k·2·N·H·I,
    each weight's 2·N·H·I or 2·N·O·I).  The elementwise ops' few FLOPs per value are left out, as for an
    untiled matmul."""
    rows, width, inner, out, k, _ = _tiled_mlp_dims(node)
    if node.target is TILED_MLP[0]:
        return 2 * rows * inner * (k * width + out)
    needs = schema_arg(node, "needs")
    matmuls = k * width + out + (k * width if needs[0] else 0)
    matmuls += sum(width for i in range(k) if needs[1 + 2 * i]) + (out if needs[5] else 0)
    return 2 * rows * inner * matmuls


def _tiled_mlp_scratch(node: fx.Node) -> int:
    """One chunk's intermediates: forward the k projections' outputs and the activation's result and one
    temporary; backward also f's saved values (one per expression step), the activation's gradient and the k
    projections' gradients; plus, backward, the fp32 accumulators of parameters that are not fp32."""
    rows, _, inner, _, k, chunk = _tiled_mlp_dims(node)
    itemsize = schema_arg(node, "x").meta["val"].element_size()
    if node.target is TILED_MLP[0]:
        return (k + 2) * min(rows, chunk) * inner * itemsize
    steps = len(json.loads(schema_arg(node, "expression"))["steps"])
    scratch = (2 * k + 2 + steps) * min(rows, chunk) * inner * itemsize
    for name, need in zip(_MLP_PARAMS, schema_arg(node, "needs")[1:], strict=True):
        param = schema_arg(node, name)
        if need and param is not None and param.meta["val"].dtype != torch.float32:
            scratch += param.meta["val"].numel() * 4
    return scratch


LOSS_SCRATCH_ROWS = 2
"""fp32 [chunk, vocab] buffers one chunk of the tiled loss allocates (`workspace_bytes`; the planner's chunk rule,
autosp/plan/auto.py, reads it)."""


def workspace_bytes(node: fx.Node) -> int:
    """Bytes an op allocates and frees while it runs, beyond its outputs.  The tiled loss: two fp32
    [chunk, vocab] buffers (the chunk's logits and the softmax's temporary in forward; the probabilities and
    the logits' gradient in backward), and in backward, for a weight that is not fp32, the fp32 accumulator of
    min(tokens, vocab) x hidden values (Note [Tiled logits and loss]).  The tiled MLP: one chunk's
    intermediates (`_tiled_mlp_scratch`).  No other op has any."""
    if node.target in TILED_MLP:
        return _tiled_mlp_scratch(node)
    if node.target not in TILED_LOSS:
        return 0
    rows, width, vocab, chunk = _tiled_loss_dims(node)
    scratch = LOSS_SCRATCH_ROWS * min(rows, chunk) * vocab * 4
    if node.target is TILED_LOSS[1] and schema_arg(node, "weight").meta["val"].dtype != torch.float32 and (
            schema_arg(node, "weight_grad")):
        scratch += min(rows, vocab) * width * 4
    return scratch


def classify(node: fx.Node, *, masked_fraction: float | None = None) -> tuple[str, int]:
    """(op_class, flops) of a compute node (``masked_fraction``: see `attention_scores_of`)."""
    target, packet = node.target, packet_name(node.target)
    shapes = _attention_shapes(node)
    if shapes is not None:
        q, k, causal, backward, flex = shapes
        return "attention", attention_flops(q, k, causal=causal, backward=backward,
                                            kept=masked_fraction if flex else None)
    if target in TILED_LOSS:
        return "matmul", tiled_loss_flops(node)
    if target in TILED_MLP:
        return "matmul", tiled_mlp_flops(node)
    if target in MATMULS:
        a, b = (node.args[1], node.args[2]) if target in (aten.addmm.default, aten.baddbmm.default) else node.args[:2]
        sa, sb = a.meta["val"].shape, b.meta["val"].shape
        return "matmul", 2 * math.prod(sa) * sb[-1]
    outputs = tensors_of(node.meta.get("val"))
    elements = sum(t.numel() for t in outputs)
    if packet in _REDUCTIONS:
        return "reduction", sum(t.numel() for a in node.all_input_nodes for t in tensors_of(a.meta.get("val")))
    if packet in _MEMORY:
        return "memory", 0
    return "elementwise", elements
