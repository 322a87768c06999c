"""Synthetic Ulysses (DeepSpeed sequence parallel) training-step workloads for Llama-style decoders.

:func:`llama_ulysses_workload` writes, without torch, the kind of schedule the exporter produces for a
Llama-like model trained with Ulysses SP and ZeRO-3 over the same ranks: per layer, a parameter all-gather, RMSNorm
and RoPE as chains of elementwise kernels, q/k/v/o and MLP matmuls, all-to-alls turning sequence-sharded q/k/v
into head-sharded full-sequence tensors and back around causal attention, and the mirrored backward with a
gradient reduce-scatter; then an Adam step on the local shard. Zero-cost view ops pad each layer to the op
counts of a real compiled graph (Llama-3.1-8B at 32 layers: about 9,000 ops per rank). FLOPs and bytes follow
the usual formulas (a multiply-add is 2 FLOPs; causal attention does half of ``4 S^2 d`` per head forward and
2.5 times that backward). It is a stand-in for tests, benchmarks and what-if sweeps, not a replacement for an
exported graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.builder import ProgramBuilder
from simulator.workload import StaticMemory, Workload


@dataclass(frozen=True, kw_only=True)
class LlamaShape:
    """Dimensions of a Llama-style decoder."""

    layers: int = 32
    """Transformer blocks."""
    hidden: int = 4096
    """Model width."""
    heads: int = 32
    """Query heads."""
    kv_heads: int = 8
    """Key/value heads (GQA)."""
    ffn_hidden: int = 14336
    """MLP inner width."""
    vocab: int = 128256
    """Vocabulary size."""
    head_dim: int | None = None
    """Width of one head where the model sets one (Qwen3, Gemma); None: ``hidden // heads``."""

    @property
    def effective_head_dim(self) -> int:
        """Width of one head: `head_dim`, else ``hidden // heads``."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """Parameters of one block (attention, MLP, two norms)."""
        q, kv = self.heads * self.effective_head_dim, self.kv_heads * self.effective_head_dim
        return 2 * self.hidden * q + 2 * self.hidden * kv + 3 * self.hidden * self.ffn_hidden + 2 * self.hidden

    @property
    def params(self) -> int:
        """All parameters (untied embedding and head)."""
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden + self.hidden


LLAMA_3_1_8B = LlamaShape()
"""Llama-3.1-8B."""


class _Emitter:
    """Tracks temporaries (freed by the next kernel) and per-layer saved activations (freed after its backward)."""

    def __init__(self, views_pad: tuple[int, int]) -> None:
        self.b = ProgramBuilder()
        self.temp: list[int] = []
        self.saved: dict[int, list[int]] = {}
        self.views_pad = views_pad

    def kernel(self, name: str, op_class: str, phase: str, *, flops: int = 0, read: int = 0, write: int = 0,
               save_for: int | None = None, deps=(), frees=(), allocates=()) -> int:
        out = self.b.tensor(write) if write else None
        frees = [*self.temp, *frees]
        self.temp = []
        if out is not None:
            (self.saved.setdefault(save_for, []) if save_for is not None else self.temp).append(out)
        allocs = [*allocates] if out is None else [out, *allocates]
        return self.b.compute(name, op_class=op_class, phase=phase, flops=flops, bytes_read=read,
                              bytes_written=write, deps=deps, allocates=allocs, frees=frees)

    def views(self, prefix: str, phase: str, count: int) -> None:
        for i in range(count):
            self.b.compute(f"{prefix}.view{i}", phase=phase)

    def pad_to(self, prefix: str, phase: str, first_op: int, target: int) -> None:
        self.views(prefix, phase, max(0, target - (self.b.num_ops - first_op)))


def llama_ulysses_workload(*, seq_len: int, sp_degree: int = 8, shape: LlamaShape = LLAMA_3_1_8B,
                           dtype_bytes: int = 2, overlap: bool = True, ops_per_layer: tuple[int, int] = (100, 180),
                           other_static_bytes: int = 2 * 2**30, symmetric: bool = True) -> Workload:
    """One Ulysses SP + ZeRO-3 training step on ``sp_degree`` ranks at ``seq_len`` tokens.

    ``overlap`` issues each all-to-all as start/wait so the next projection hides it (AutoSP-style); otherwise
    all-to-alls block. ``ops_per_layer`` pads (forward, backward) ops per layer with views. ``symmetric=False``
    writes one (shared) program object per rank instead of a symmetric workload.
    """
    p, s = sp_degree, seq_len
    if s % p or shape.heads % p:
        raise ValueError(f"seq_len ({s}) and heads ({shape.heads}) must be divisible by sp_degree ({p})")
    b, h, f, hd = dtype_bytes, shape.hidden, shape.ffn_hidden, shape.effective_head_dim
    s_l = s // p  # local tokens                                             # x: [S/P, h]
    qw = shape.heads * hd  # query (and attention output) width: h unless the model sets its head_dim
    kv = max(shape.kv_heads, p) * hd  # GQA kv heads are replicated up to P
    act, q_act, kv_act = s_l * h * b, s_l * qw * b, s_l * kv * b
    heads_l = shape.heads // p
    attn_flops = 4 * s * s * heads_l * hd // 2  # causal: half of QK^T and PV
    layer_bytes = shape.layer_params * b
    e = _Emitter(ops_per_layer)
    g = e.b
    fwd, bwd = "forward", "backward"

    def a2a(name: str, nbytes: int, phase: str, deps, save_for: int | None):
        out = g.tensor(nbytes)
        (e.saved.setdefault(save_for, []) if save_for is not None else e.temp).append(out)
        if overlap:
            return g.start(name, kind="all_to_all", group="sp", message_bytes=nbytes, phase=phase, deps=deps,
                           allocates=[out])
        g.collective(name, kind="all_to_all", group="sp", message_bytes=nbytes, phase=phase, deps=deps,
                     allocates=[out])
        return None

    def wait(handle) -> None:
        if handle is not None:
            g.wait(handle)

    def norm(prefix: str, phase: str, layer: int | None, scale: int = 1) -> None:
        for i, (op, cls) in enumerate([("pow", "elementwise"), ("mean", "reduction"), ("add", "elementwise"),
                                       ("rsqrt", "elementwise"), ("mul", "elementwise"), ("mul_w", "elementwise")]):
            write = act if i in (0, 4, 5) else s_l * b
            e.kernel(f"{prefix}.{op}", cls, phase, flops=scale * s_l * h, read=scale * act, write=scale * write,
                     save_for=layer if (phase == fwd and i == 5) else None)

    def rope(prefix: str, phase: str, width: int, layer: int | None) -> None:
        for op in ("slice_cos", "slice_sin", "mul_cos", "slice_a", "slice_b", "neg", "cat", "mul_sin", "add"):
            nbytes = s_l * width * b
            e.kernel(f"{prefix}.{op}", "elementwise", phase, flops=s_l * width, read=nbytes, write=nbytes,
                     save_for=layer if (phase == fwd and op == "add") else None)

    def matmul(name: str, phase: str, m: int, k: int, n: int, save_for: int | None = None, deps=()) -> int:
        return e.kernel(name, "matmul", phase, flops=2 * m * k * n, read=(m * k + k * n) * b, write=m * n * b,
                        save_for=save_for, deps=deps)

    def gather(layer: int, phase: str, after: int) -> tuple[int, int]:
        """ZeRO-3 all-gather of one layer's parameters, issued once op ``after`` is done (one-layer prefetch)."""
        params = g.tensor(layer_bytes)
        name = f"L{layer}{'.bwd' if phase == bwd else ''}.allgather_params"
        return g.start(name, kind="all_gather", group="zero", message_bytes=layer_bytes // p, phase=phase,
                       deps=[after], allocates=[params]), params

    # Embedding and forward blocks.
    prefetched = gather(0, fwd, e.kernel("embed", "memory", fwd, read=act, write=act, save_for=-1))
    for layer in range(shape.layers):
        first, pre = g.num_ops, f"L{layer}"
        ag, params = prefetched
        norm(f"{pre}.norm1", fwd, layer)
        arrived = g.wait(ag)
        if layer + 1 < shape.layers:
            prefetched = gather(layer + 1, fwd, arrived)
        q = matmul(f"{pre}.q_proj", fwd, s_l, h, qw)
        rope(f"{pre}.rope_q", fwd, qw, None)
        hq = a2a(f"{pre}.a2a_q", q_act, fwd, [g.num_ops - 1], layer)
        matmul(f"{pre}.k_proj", fwd, s_l, h, kv, deps=[q])
        rope(f"{pre}.rope_k", fwd, kv, None)
        hk = a2a(f"{pre}.a2a_k", kv_act, fwd, [g.num_ops - 1], layer)
        matmul(f"{pre}.v_proj", fwd, s_l, h, kv)
        hv = a2a(f"{pre}.a2a_v", kv_act, fwd, [g.num_ops - 1], layer)
        for handle in (hq, hk, hv):
            wait(handle)
        e.kernel(f"{pre}.attention", "attention", fwd, flops=attn_flops, read=(q_act + 2 * kv_act), write=q_act,
                 save_for=layer)
        ho = a2a(f"{pre}.a2a_out", q_act, fwd, [g.num_ops - 1], layer)
        wait(ho)
        matmul(f"{pre}.o_proj", fwd, s_l, qw, h)
        e.kernel(f"{pre}.residual1", "elementwise", fwd, flops=s_l * h, read=2 * act, write=act, save_for=layer)
        norm(f"{pre}.norm2", fwd, layer)
        matmul(f"{pre}.gate_proj", fwd, s_l, h, f, save_for=layer)
        matmul(f"{pre}.up_proj", fwd, s_l, h, f, save_for=layer)
        e.kernel(f"{pre}.silu", "elementwise", fwd, flops=4 * s_l * f, read=s_l * f * b, write=s_l * f * b,
                 save_for=layer)
        e.kernel(f"{pre}.mul", "elementwise", fwd, flops=s_l * f, read=2 * s_l * f * b, write=s_l * f * b,
                 save_for=layer)
        matmul(f"{pre}.down_proj", fwd, s_l, f, h)
        e.kernel(f"{pre}.residual2", "elementwise", fwd, flops=s_l * h, read=2 * act, write=act, save_for=layer,
                 frees=[params])
        e.pad_to(pre, fwd, first, ops_per_layer[0])
    # Head and loss (logits in fp32).
    norm("final_norm", fwd, -1)
    logits = s_l * shape.vocab * 4
    e.kernel("lm_head", "matmul", fwd, flops=2 * s_l * h * shape.vocab, read=act + shape.vocab * h * b,
             write=logits, save_for=-1)
    e.kernel("cross_entropy", "reduction", fwd, flops=4 * s_l * shape.vocab, read=logits, write=s_l * 4)
    g.collective("loss_all_reduce", kind="all_reduce", group="sp", message_bytes=4)
    ce_bwd = e.kernel("cross_entropy_bwd", "elementwise", bwd, flops=4 * s_l * shape.vocab, read=logits,
                      write=logits)
    prefetched = gather(shape.layers - 1, bwd, ce_bwd)
    e.kernel("lm_head_dgrad", "matmul", bwd, flops=2 * s_l * h * shape.vocab, read=logits, write=act)
    e.kernel("lm_head_wgrad", "matmul", bwd, flops=2 * s_l * h * shape.vocab, read=logits + act,
             write=shape.vocab * h * b, frees=e.saved.pop(-1, []))
    # Backward blocks, last layer first.
    for layer in reversed(range(shape.layers)):
        first, pre = g.num_ops, f"L{layer}.bwd"
        (ag, params), grads = prefetched, g.tensor(layer_bytes)
        arrived = g.wait(ag)
        if layer > 0:
            prefetched = gather(layer - 1, bwd, arrived)
        for name, k, n in (("down", f, h), ("up", h, f), ("gate", h, f)):
            matmul(f"{pre}.{name}_dgrad", bwd, s_l, n, k)
            e.kernel(f"{pre}.{name}_wgrad", "matmul", bwd, flops=2 * s_l * k * n, read=(s_l * k + s_l * n) * b,
                     write=k * n * b, allocates=[grads] if name == "down" else ())
            if name == "down":
                for op in ("mul_bwd_a", "mul_bwd_b", "silu_bwd_sig", "silu_bwd_mul", "silu_bwd_add"):
                    e.kernel(f"{pre}.{op}", "elementwise", bwd, flops=s_l * f, read=2 * s_l * f * b,
                             write=s_l * f * b)
        norm(f"{pre}.norm2", bwd, None, scale=2)
        matmul(f"{pre}.o_dgrad", bwd, s_l, h, qw)
        e.kernel(f"{pre}.o_wgrad", "matmul", bwd, flops=2 * s_l * h * qw, read=act + q_act, write=h * qw * b)
        wait(a2a(f"{pre}.a2a_dout", q_act, bwd, [g.num_ops - 1], None))
        e.kernel(f"{pre}.attention_bwd", "attention", bwd, flops=5 * attn_flops // 2, read=4 * q_act + 2 * kv_act,
                 write=q_act + 2 * kv_act)
        handles = [a2a(f"{pre}.a2a_d{x}", nbytes, bwd, [g.num_ops - 1], None)
                   for x, nbytes in (("q", q_act), ("k", kv_act), ("v", kv_act))]
        for x, width, handle in (("q", qw, handles[0]), ("k", kv, handles[1]), ("v", kv, handles[2])):
            wait(handle)
            if x != "v":
                rope(f"{pre}.rope_{x}", bwd, width, None)
            matmul(f"{pre}.{x}_dgrad", bwd, s_l, width, h)
            e.kernel(f"{pre}.{x}_wgrad", "matmul", bwd, flops=2 * s_l * h * width, read=act + s_l * width * b,
                     write=h * width * b)
        norm(f"{pre}.norm1", bwd, None, scale=2)
        last = e.kernel(f"{pre}.residual_grad", "elementwise", bwd, flops=s_l * h, read=2 * act, write=act,
                        frees=[params, *e.saved.pop(layer, [])])
        rs = g.start(f"{pre}.reduce_scatter_grads", kind="reduce_scatter", group="zero", message_bytes=layer_bytes,
                     phase=bwd, deps=[last])
        e.pad_to(pre, bwd, first, ops_per_layer[1] - 1)
        g.wait(rs, frees=[grads])
    e.kernel("embed_bwd", "memory", bwd, read=act, write=shape.vocab * h * b // p, frees=e.saved.pop(-1, []))
    # Adam on the local fp32 shard: read/write param, grad, m, v (memory bound).
    shard = shape.params // p
    for i, op in enumerate(("grad_scale", "m_update", "v_update", "denom", "param_update", "cast_bf16")):
        e.kernel(f"adam.{op}", "elementwise", "optimizer", flops=4 * shard, read=12 * shard, write=8 * shard // 2
                 if i == 5 else 4 * shard)
    g.compute("step_end", phase="optimizer", frees=e.temp)
    static = StaticMemory(parameter_bytes=shape.params * b // p, gradient_bytes=shape.params * b // p,
                          optimizer_bytes=12 * shape.params // p, other_bytes=other_static_bytes)
    program = g.build(static)
    ranks = {0: program} if symmetric else dict.fromkeys(range(p), program)
    return Workload(name=f"synthetic-llama-{shape.layers}L/ulysses-sp{p}/S={s}", world_size=p,
                    groups={"sp": [list(range(p))], "zero": [list(range(p))]}, ranks=ranks, symmetric=symmetric,
                    metadata={"generator": "simulator.synthetic", "seq_len": s, "sp_degree": p, "overlap": overlap,
                              "params": shape.params})
