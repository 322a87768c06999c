"""Export a ring attention node, forward or backward, as the steps, transfers and block kernels it runs on one rank.

autosp/export.py calls `emit_ring` for every ring attention node of the graphs it exports (strategy="ring" and
the ring of strategy="hybrid"), once per rank; what it writes is Note [Ring attention in the export].

Note [Ring attention in the export]
A ring attention node (strategy="ring", Note [Ring attention] in autosp/ring_attention.py) is one op to
AOTAutograd; the export writes out what the op runs, step by step as ``ring_attention.schedule`` orders it and
with the fused calls ``ring_attention.blocks`` cuts each step into, for each rank of the group (its chunks and
neighbours differ, so a ring program has one program per rank).  Forward: a ``stack`` of k and v into the block
that travels (and the zero-filled fp32 accumulators); per step s < P-1 a ``send`` of the block in hand to rank r+1
and a ``recv`` of rank r-1's into a new buffer (groups ``simulator.workload.RING_GROUPS``, both issued after the
compute before them, as NCCL's stream joins the issuing one), the step's attention calls (FLOPs and scores of
their real shapes; each ``step<s>.attention<j>.<kernel>``, the kernel `ring_block_kernels.block_kernel` names for
the traced device and dtype, the one the op runs there: Note [Ring block kernels] in autosp/ring_block_kernels.py;
a fused kernel is priced as the attention of its pairs, the math path as every score of the block plus the traffic
and memory of its [B, H, Lq, Lk] buffers) each followed by its online-softmax ``merge``, then the waits (the block
sent is freed); a ``finalize`` casts the output.  Backward: the K/V block travels the same way (P-1 transfers);
per step a zero-filled fp32 dK/dV buffer, the calls' backward kernels each followed by an ``accumulate``, then
(from the second step) the wait for the accumulator arriving from rank r-1 and its addition, and the
``send``/``recv`` of the sum onward (P transfers: after the last one each rank holds its own tokens' dK/dV).
Message bytes are the tensors the op passes: 2·B·Hkv·L·D elements in the activation dtype for K/V, in the
accumulator dtype (fp32) for dK/dV.  The copies a call's concatenated chunks and GQA-expanded heads make are
counted as its bytes and a temporary, freed by the merge or accumulation after it.  Over packed documents
(``document_ids``, the traced batch's) a (query chunk, key chunk) pair no query reads is left out, as the op skips
it at run time; the calls that remain are priced as the kernel they run (causal within one document, the masked
dense block otherwise).
"""

from __future__ import annotations

import torch
from torch import fx

from autosp.costs import RING_ATTENTION, attention_flops, attention_scores, packet_name, schema_arg
from autosp.errors import AutoSPError
from autosp.export_program import RankEmitter
from autosp.ring_attention import Documents, blocks, rank_chunks, schedule
from autosp.ring_block_kernels import MATH_SCORE_BUFFERS, MATH_SCORE_TRAFFIC, accumulator_dtype, block_kernel
from simulator.workload import RING_GROUPS, Collective, Op


def emit_ring(node: fx.Node, phase: str, em: RankEmitter, deps: tuple[int, ...], output: tuple[int, ...]) -> int:
    """Append the steps of one ring attention node (forward or backward) as rank ``em.rank`` runs them; returns
    the id of its last op, which stands for the node (Note [Ring attention in the export])."""
    backward = packet_name(node.target) == RING_ATTENTION[1]
    q, k = (node.args[1], node.args[2]) if backward else (node.args[0], node.args[1])
    qv, kv_meta = q.meta["val"], k.meta["val"]
    b, h, length, d = (int(x) for x in qv.shape)
    hkv = int(kv_meta.shape[1])
    e = qv.element_size()
    acc = torch.empty((), dtype=accumulator_dtype(qv.dtype)).element_size()
    size, layout = int(schema_arg(node, "group_size")), str(schema_arg(node, "layout"))
    causal = bool(schema_arg(node, "causal"))
    rank, ranks = em.rank, em.sp_layout  # the rank layout (the ring's chunk layout is ``layout``)
    if ranks is None or ranks.ring_size != size:
        raise AutoSPError(f"{node.name} runs a ring of {size} ranks, and the export's layout is {ranks}; this is a "
                          "bug in the export")
    ring_rank, _ = ranks.coordinates(rank)  # Note [Hybrid attention in the export]
    mine = rank_chunks(layout, size, ring_rank)
    chunk = length // len(mine)
    documents = None  # packed documents: the chunk pairs no query reads are skipped, as the op skips them
    if em.document_ids is not None:
        if em.document_ids.shape[-1] != length * size:
            raise AutoSPError(f"document_ids cover {em.document_ids.shape[-1]} tokens but {node.name} runs over "
                              f"{length * size}; pass the CompileReport.document_ids of the traced batch")
        documents = Documents(em.document_ids, size * len(mine))
    prv, nxt = ranks.ring_neighbours(rank)
    kv_bytes = 2 * b * hkv * length * d * e  # k and v stacked: what travels forward (and backward again)
    dkv_elements = 2 * b * hkv * length * d  # the dK/dV accumulators travelling backward, in the accumulator dtype
    out_elements = b * h * length * d
    prefix = f"{phase}.{node.name}.ring"

    def add(name: str, kind: str = "compute", op_class: str = "other", *, flops=0, read=0, written=0, scores=0,
            after=(), allocates=(), frees=(), collective=None) -> int:
        op_id = len(em.ops)
        em.ops.append(Op(id=op_id, name=f"{prefix}.{name}", kind=kind, op_class=op_class, phase=phase,
                         flops=int(flops), bytes_read=int(read), bytes_written=int(written),
                         attention_scores=int(scores), deps=tuple(sorted(set(after))), allocates=tuple(allocates),
                         frees=tuple(frees), collective=collective))
        return op_id

    def tensor(nbytes: int) -> int:
        return em.new_tensor(nbytes)

    def shift(tag: str, step: int, nbytes: int, after: int) -> tuple[int, int, int]:
        """``batch_isend_irecv``: send the block in hand to the next rank, receive the previous rank's into a new
        buffer; both wait for the compute stream up to ``after`` (NCCL's stream joins the issuing stream)."""
        received = tensor(nbytes)
        em.collectives += 2
        key = f"{prefix}.{tag}{step}"
        send = add(f"{tag}{step}.send", "collective_start", after=(after,), collective=Collective(
            kind="send", group=RING_GROUPS[0], message_bytes=nbytes, key=f"{key}.{rank}>{nxt}", peer=nxt))
        recv = add(f"{tag}{step}.recv", "collective_start", after=(after,), allocates=(received,),
                   collective=Collective(kind="recv", group=RING_GROUPS[1], message_bytes=nbytes,
                                         key=f"{key}.{prv}>{rank}", peer=prv))
        return send, recv, received

    def wait(start: int, frees=()) -> int:
        op = em.ops[start]
        return add(f"{op.name[len(prefix) + 1:]}.wait", "collective_wait", after=(start,), frees=frees,
                   collective=op.collective)

    def block_bytes(rows, cols) -> tuple[int, int, tuple, tuple, int]:
        """(query rows, key rows, q shape, k shape) of one fused call, and the bytes ``_take``'s concatenations
        and the GQA expansion of k, v copy for it."""
        lq, lk = len(rows) * chunk, len(cols) * chunk
        row_tensors = b * h * lq * ((3 * d * e + acc) if backward else d * e)  # q (backward: dout, q, out, lse)
        copies = (row_tensors if len(rows) > 1 else 0) + (2 * b * hkv * lk * d * e if len(cols) > 1 else 0)
        copies += 2 * b * h * lk * d * e if h != hkv else 0
        return lq, lk, (b, h, lq, d), (b, hkv, lk, d), copies

    def block_cost(j: int, q_shape, k_shape, block_causal: bool, masked: bool):
        """(op name, FLOPs and scores, (read, written) bytes beyond the block's operands, scratch tensors) of one
        call's kernel: the one `block_kernel` names for the traced device and dtype, as the op chooses it at run
        time (Note [Ring block kernels] in autosp/ring_block_kernels.py).  A fused kernel: the attention of its pairs
        (causal halved), no score block.  The math path: every score computed (the causal triangle masked
        afterwards), its [B, H, Lq, Lk] buffers in the accumulator dtype read and written as
        ``MATH_SCORE_TRAFFIC`` counts and held as ``MATH_SCORE_BUFFERS`` counts, for the kernel's duration."""
        kernel = block_kernel(qv.device, qv.dtype, d, masked=masked)
        name = f"attention{j}.{kernel.value}"
        if kernel.fused:
            return name, dict(flops=attention_flops(q_shape, k_shape, causal=block_causal, backward=backward),
                              scores=attention_scores(q_shape, k_shape, causal=block_causal, backward=backward)
                              ), (0, 0), ()
        block = b * h * q_shape[2] * k_shape[2] * acc  # one [B, H, Lq, Lk] buffer
        reads, writes = MATH_SCORE_TRAFFIC[backward]
        extra = int(block_causal) + int(masked)
        return name, dict(flops=attention_flops(q_shape, k_shape, causal=False, backward=backward),
                          scores=attention_scores(q_shape, k_shape, causal=False, backward=backward)), (
            (reads + extra) * block, (writes + extra) * block), (tensor(MATH_SCORE_BUFFERS[backward] * block),)

    held = tensor(kv_bytes)
    accumulator = tensor(out_elements * acc)  # the merged output (forward) or dq (backward), zero-filled
    lse = 0 if backward else b * h * length * acc  # forward: the log-sum-exp accumulator is the node's output
    cursor = add("stack", op_class="memory", read=kv_bytes, written=kv_bytes + out_elements * acc + lse, after=deps,
                 allocates=(held, accumulator) + (() if backward else output))
    pending = None  # the K/V transfer in flight: (send, recv, received buffer)
    in_flight = None  # backward: the dK/dV transfer in flight: (send, recv, received buffer, sent buffer)
    finished = None  # backward: the buffer holding this rank's finished dK/dV
    for event in schedule(size):
        s = event.step
        if event.kind == "send_recv":
            pending = shift("kv", s, kv_bytes, cursor)
            continue
        if event.kind == "wait":
            send, recv, received = pending
            wait(send, frees=(held,))
            cursor = wait(recv)
            held = received
            continue
        theirs = rank_chunks(layout, size, (ring_rank - s) % size)
        if backward:
            dkv = tensor(dkv_elements * acc)
            cursor = add(f"step{s}.zeros", op_class="memory", written=dkv_elements * acc, after=(cursor,),
                         allocates=(dkv,))
        for j, (rows, cols, block_causal) in enumerate(blocks(mine, theirs, causal, documents and documents.reads)):
            lq, lk, q_shape, k_shape, copies = block_bytes(rows, cols)
            q_el, kv_el = b * h * lq * d, 2 * b * hkv * lk * d
            masked = documents is not None and not documents.one_document([mine[i] for i in rows],
                                                                          [theirs[i] for i in cols])
            name, kernel, (score_read, score_written), scratch = block_cost(j, q_shape, k_shape, block_causal,
                                                                            masked)
            if not backward:  # the kernel's output and log-sum-exp, merged online into the fp32 accumulators
                temp = tensor(q_el * e + b * h * lq * acc + copies)
                kernel_op = add(f"step{s}.{name}", op_class="attention", **kernel, after=(cursor,),
                                read=q_el * e + kv_el * e + copies + score_read,
                                written=q_el * e + b * h * lq * acc + copies + score_written,
                                allocates=(temp, *scratch), frees=scratch)
                rows_lse = b * h * lq
                cursor = add(f"step{s}.merge{j}", op_class="elementwise", flops=4 * q_el + 6 * rows_lse,
                             read=q_el * (acc + e) + 2 * rows_lse * acc, written=(q_el + rows_lse) * acc,
                             after=(kernel_op,), frees=(temp,))
            else:  # dq, dk, dv of the block (k, v heads expanded under GQA), added into the fp32 sums
                grads = q_el * e + 2 * b * h * lk * d * e
                temp = tensor(grads + copies)
                kernel_op = add(f"step{s}.{name}", op_class="attention", **kernel, after=(cursor,),
                                read=3 * q_el * e + b * h * lq * acc + kv_el * e + copies + score_read,
                                written=grads + copies + score_written, allocates=(temp, *scratch),
                                frees=scratch)
                summed = q_el + kv_el
                cursor = add(f"step{s}.accumulate{j}", op_class="elementwise",
                             flops=summed + (2 * b * h * lk * d if h != hkv else 0),
                             read=grads + summed * acc, written=summed * acc, after=(kernel_op,), frees=(temp,))
        if backward:
            if in_flight is not None:  # the accumulator of this block from the previous rank: ours added to it
                send, recv, arrived, sent = in_flight
                wait(send, frees=(sent,))
                cursor = add(f"step{s}.add_arrived", op_class="elementwise", flops=dkv_elements,
                             read=2 * dkv_elements * acc, written=dkv_elements * acc,
                             after=(cursor, wait(recv)), frees=(arrived,))
            if size > 1:  # on to the next rank, overlapping the next step's compute
                in_flight = (*shift("dkv", s, dkv_elements * acc, cursor), dkv)
            else:
                finished = dkv
    if in_flight is not None:
        send, recv, finished, sent = in_flight
        wait(send, frees=(sent,))
        cursor = wait(recv)
    # Cast the fp32 accumulators to the outputs: out (forward); dq and the finished dk, dv (backward).
    elements = out_elements + (dkv_elements if backward else 0)
    return add("finalize", op_class="elementwise", flops=elements, read=elements * acc, written=elements * e,
               after=(cursor,), allocates=output if backward else (),
               frees=(accumulator, held) + ((finished,) if backward else ()))
