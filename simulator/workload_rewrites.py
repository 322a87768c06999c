"""Workload rewrites of the strategies traced as another's program: ZeRO-3 and ring attention (torch-free).

Each rewrite takes a workload exported from a real trace (`autosp.export`) and returns
the workload of a system that computes the same model differently: the same kernels
(same FLOPs and bytes, same activations), different communication.  Which strategy uses
which rewrite is its :class:`simulator.strategies.WorkloadRecipe`.  See
Note [ZeRO-3 as a rewrite of the single-device trace] and
Note [Ring attention as a rewrite of the Ulysses trace].

Note [ZeRO-3 as a rewrite of the single-device trace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DeepSpeed ZeRO-3 is data parallelism with every model state sharded: each of the
P ranks runs its own full sequence through the whole model (no sequence
parallelism, here no activation checkpointing) and holds 1/P of the bf16
parameters, of their gradients and of the Adam state.  Its program is the
single-device training step (`autosp.compile` with ``sp_size=1``, exported on one
rank) plus, per module (a decoder layer, the embedding, the final norm, the output
head; `autosp.export.module_parameters` says which ops read which module's
parameters):

- forward: an ``all_gather`` of the module's parameters (message: the local shard,
  1/P of its bytes) before the first op reading them; the gathered copy is a
  tensor of the module's full bytes, freed after the module's last forward read;
- backward: the same gather again before the module's first backward read, freed
  after its last one;
- a ``reduce_scatter`` of the module's gradients (message: their full bytes) issued
  when its last gradient is produced; the full gradients are freed when it
  completes, the shard that remains is static memory (``gradient_bytes / P``).

Gathers are prefetched one module ahead (module k+1's gather is issued when the
compute stream reaches module k and its parameters have arrived), as DeepSpeed's
trace-based prefetch does at its default bucket size of about one layer; they run
on a ``dp_gather`` stream and the reduce-scatters on a ``dp_reduce`` stream, both
over all P ranks, so gathers, reductions and compute overlap.  Static memory is the
traced parameters, gradients and optimizer state divided by P.

A sequence-parallel trace over the whole ZeRO-3 world (ALST: Ulysses and ZeRO 3 over one node) keeps its
all-to-alls on their groups, the gathers and reduce-scatters beside them (experiments/paper_scale/alst.py).

Not modelled: DeepSpeed's parameter-persistence threshold (small parameters kept
whole), ``stage3_max_live_parameters``/``max_reuse_distance`` (a module used again
soon keeps its gathered copy), a tied embedding gathered once per use (here one
gather spans both uses), fp32 gradient accumulation buffers, the flat-buffer copies
around each collective and allocator fragmentation; the optimizer step itself is
not part of the step (as for every system here).

Note [Ring attention as a rewrite of the Ulysses trace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Hand-written ring attention (causal, load-balanced zigzag layout) shards tokens as
Ulysses does (each of the P ranks keeps S/P tokens) but never re-shards them: every
rank keeps all heads, and each attention runs in P steps.  At step i a rank computes
the attention of its local queries against the K,V chunk in hand (its own at step
0) while it sends that chunk to rank r+1 and receives the next from rank r-1
(P-1 transfers).  The backward circulates K,V the same way and, after each step,
sends the partial dK,dV of the chunk in hand onward (P transfers: after the last
one each chunk's gradients are home).  So its workload is the Ulysses workload
(``checkpointing="none"``, blocking all-to-alls) with:

- every all-to-all replaced by a local, zero-time relayout: the tensor it produced
  stays (the same bytes, now in ring's layout), nothing crosses the network;
- every attention op (forward and backward) split into P chunk ops of 1/P of its
  FLOPs and bytes (the zigzag layout balances the causal work), interleaved with
  ``send``/``recv`` pairs to the ring neighbours: chunk i+1 waits for the receive
  of step i; the next send waits for the chunk to arrive; a dK,dV send waits for its
  chunk's compute and for the partial sum received before it;
- the K,V chunk is what Ulysses all-to-alls for k and v (the two smaller of the
  three inputs of each attention; kv heads are replicated to P if fewer, none for the
  paper models); the extra memory is two K,V receive buffers during each attention
  (the chunk being received and the one in use, beside the local K,V) and, in
  backward, two fp32 dK,dV buffers as well.

Sends run on a ``ring_send`` stream and receives on ``ring_recv``
(``simulator.workload.RING_GROUPS``, as ``batch_isend_irecv`` does), so a rank sends
and receives at once.  Peers name absolute ranks, so the workload has one program per rank (the simulator then
simulates every rank).

The online-softmax merge is modelled, as real ring implementations (ring_flash_attn,
and `experiments.baselines.ring` on CPU) run it: each forward attention keeps an
fp32 output accumulator of [B, H, S/P, D] (the q tensor's elements at 4 bytes)
from its first chunk to its end; after every chunk but the first, an elementwise
``merge`` op reads the accumulator and the chunk's output and writes the
accumulator (a few FLOPs per element); a final ``finalize`` op casts it to the
output.  In backward, each chunk's dQ, dK, dV are added into fp32 accumulators
(the dQ accumulator is a new tensor; dK, dV accumulate in the travelling fp32
buffers above) by an ``accumulate`` op per chunk, and a ``finalize`` op casts
them back; the next dK,dV send waits for the accumulation.  The activation
element size is taken as ``element_bytes`` (2: bf16, what the paper-scale traces
use).  Under zig-zag every step computes the same number of (query, key) pairs
(step 0 one causal call over the rank's two chunks, every later step one
non-causal call of half the size), so the even 1/P split of FLOPs and scores is
what the real kernel calls do.

Not modelled: the efficiency lost by P smaller attention calls.  The cost model
prices a kernel by op class alone (one FLOP and byte efficiency per class, plus a
time per attention score), with no dependence on the kernel's size, so each chunk
pays only its own launch overhead; at paper scale (chunks of several thousand
tokens) flash attention runs near its full-length efficiency anyway, but at short
sequences this makes ring optimistic.  Also not modelled: the row-wise
log-sum-exp tensors ([B, H, S/P], D times smaller than the accumulators), the
replication of key/value heads for grouped-query kernels without native support,
and the kernel-internal recomputation of Delta = rowsum(dO * O) per chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Protocol

from simulator.workload import RING_GROUPS, Collective, Op, RankProgram, StaticMemory, Workload


class ModuleParameters(Protocol):
    """One module's parameters in a traced workload, by op name (``autosp.export.ModuleParameters``)."""

    module: str
    parameter_bytes: int
    forward_reads: tuple[str, ...]
    backward_reads: tuple[str, ...]
    gradients: tuple[str, ...]


class _Program:
    """A rank program under construction: ops as mutable field dicts, fresh op and tensor ids."""

    def __init__(self, tensors: dict[int, int], host_tensors: frozenset[int] = frozenset()):
        self.ops: list[dict] = []
        self.tensors, self.host_tensors = dict(tensors), host_tensors  # same ids (simulator/workload.py)
        self.new_id: dict[int, int] = {}  # source op id -> id of the op standing for it here

    def tensor(self, nbytes: int) -> int:
        tid = max(self.tensors, default=-1) + 1
        self.tensors[tid] = int(nbytes)
        return tid

    def add(self, **fields) -> int:
        op_id = len(self.ops)
        self.ops.append({"deps": (), "allocates": (), "frees": (), **fields, "id": op_id})
        return op_id

    def copy(self, op: Op, **changes) -> int:
        fields = {f.name: getattr(op, f.name) for f in dataclasses.fields(Op)}
        fields["deps"] = tuple(self.new_id[d] for d in op.deps)
        fields.update(changes)
        del fields["id"]
        new = self.add(**fields)
        self.new_id[op.id] = new
        return new

    def free_at(self, op_id: int, tids: Iterable[int]) -> None:
        self.ops[op_id]["frees"] = tuple(self.ops[op_id]["frees"]) + tuple(tids)

    def start(self, name: str, phase: str, collective: Collective, deps: Sequence[int] = (),
              allocates: Sequence[int] = ()) -> int:
        return self.add(name=name, kind="collective_start", phase=phase, collective=collective, deps=tuple(deps),
                        allocates=tuple(allocates))

    def wait(self, start: int) -> int:
        op = self.ops[start]
        return self.add(name=f"{op['name']}.wait", kind="collective_wait", phase=op["phase"],
                        collective=op["collective"])

    def build(self, static: StaticMemory) -> RankProgram:
        ops = tuple(Op(**{**f, "deps": tuple(sorted(set(f["deps"]))), "frees": tuple(sorted(set(f["frees"])))})
                    for f in self.ops)
        return RankProgram(ops=ops, tensors=self.tensors, static_memory=static, host_tensors=self.host_tensors)


# --- ZeRO-3 --------------------------------------------------------------------------------------------------


def zero3_workload(workload: Workload, modules: Sequence[ModuleParameters], *, world_size: int,
                   name: str | None = None, prefetch: bool = True) -> Workload:
    """The ZeRO-3 step of ``workload`` (one rank's single-device step, or a symmetric sequence-parallel step over
    exactly ``world_size`` ranks) on ``world_size`` ranks that ZeRO partitions over.  ``modules``:
    `autosp.export.module_parameters`; ``prefetch=False``: each gathered at its first read, not one module ahead
    (AutoSP's ``shard_parameters=True``).  Note [ZeRO-3 as a rewrite of the single-device trace]."""
    source = workload.program(0)
    if any(op.collective is not None for op in source.ops) and (workload.world_size != world_size
                                                                 or not workload.symmetric):
        raise ValueError(f"zero3_workload expects a single-device trace without collectives (autosp.compile with "
                         f"sp_size=1), or a symmetric sequence-parallel trace over all {world_size} ranks; "
                         f"{workload.name!r} has collectives over {workload.world_size} ranks")
    index = {op.name: i for i, op in enumerate(source.ops)}
    missing = sorted({n for m in modules for n in m.forward_reads + m.backward_reads + m.gradients} - set(index))
    if missing:
        raise ValueError(f"ops {missing[:3]} of the module map are not in workload {workload.name!r}; export both "
                         "from the same compiled graphs")
    p = world_size
    before: dict[int, list] = {}  # source position -> insertion callbacks run before copying that op
    after: dict[int, list] = {}
    frees_after: dict[int, list[int]] = {}

    out = _Program(source.tensors, source.host_tensors)

    def gather_chain(phase: str, reads: dict[str, tuple[str, ...]]) -> None:
        """Per module (ordered by first read): gather before its first read, prefetch the next one."""
        order = sorted(((index[r[0]], m) for m, r in reads.items() if r), key=lambda x: x[0])
        handles: dict[str, tuple[int, int]] = {}  # module -> (start op, gathered tensor)

        def issue(module: str, deps: Sequence[int]) -> None:
            tid = out.tensor(nbytes := sizes[module])
            coll = Collective(kind="all_gather", group="dp_gather", message_bytes=-(-nbytes // p),
                              key=f"{phase}.gather.{module}")
            handles[module] = (out.start(f"{phase}.all_gather.{module}", phase, coll, deps, (tid,)), tid)

        for k, (position, module) in enumerate(order):
            def at_first_read(k=k, module=module, position=position):
                if not prefetch or k == 0:  # without prefetch: when compute reaches the op before the read
                    issue(module, (out.new_id[source.ops[position - 1].id],) if position and not prefetch else ())
                wait = out.wait(handles[module][0])
                if prefetch and k + 1 < len(order):
                    issue(order[k + 1][1], (wait,))

            before.setdefault(position, []).append(at_first_read)
            last = index[reads[module][-1]]
            frees_after.setdefault(last, []).append(lambda module=module: handles[module][1])

    sizes = {m.module: m.parameter_bytes for m in modules}
    gather_chain("forward", {m.module: m.forward_reads for m in modules})
    gather_chain("backward", {m.module: m.backward_reads for m in modules})
    reductions: list[int] = []
    freed_in_source = {t for op in source.ops for t in op.frees}
    for m in modules:
        if not m.gradients:
            continue
        grads = [index[g] for g in m.gradients]
        tids = [t for g in grads for t in source.ops[g].allocates if t not in freed_in_source]

        def reduce(m=m, grads=grads, tids=tids):
            nbytes = sum(source.tensors[t] for t in tids)
            coll = Collective(kind="reduce_scatter", group="dp_reduce", message_bytes=nbytes,
                              key=f"backward.reduce_scatter.{m.module}")
            start = out.start(f"backward.reduce_scatter.{m.module}", "backward", coll,
                              [out.new_id[source.ops[g].id] for g in grads])
            out.free_at(start, tids)
            reductions.append(start)

        after.setdefault(max(grads), []).append(reduce)
    for position, op in enumerate(source.ops):
        for callback in before.get(position, ()):
            callback()
        new = out.copy(op)
        for freed in frees_after.get(position, ()):
            out.free_at(new, [freed()])
        for callback in after.get(position, ()):
            callback()
    for start in reductions:
        out.wait(start)
    static = source.static_memory
    zero3_static = StaticMemory(parameter_bytes=-(-static.parameter_bytes // p),
                                gradient_bytes=-(-static.gradient_bytes // p),
                                optimizer_bytes=-(-static.optimizer_bytes // p), other_bytes=static.other_bytes)
    everyone = [list(range(p))]
    own = {g: [list(m) for m in inst] for g, inst in workload.groups.items()} if workload.world_size == p else {}
    return Workload(name=name or f"{workload.name}/zero3", world_size=p,
                    groups={**own, "dp_gather": everyone, "dp_reduce": everyone}, ranks={0: out.build(zero3_static)},
                    symmetric=True, metadata={**workload.metadata, "system": "zero3", "dp_size": p})


# --- ring attention ------------------------------------------------------------------------------------------


def _zero_cost(op: Op) -> bool:
    return op.kind == "compute" and op.flops == 0 and op.bytes_read == 0 and op.bytes_written == 0


def _all_to_all_inputs(ops: Sequence[Op], position: int, by_id: dict[int, int]) -> list[Op]:
    """The all-to-alls an op reads, directly or through zero-cost ops (views)."""
    found, todo, seen = [], list(ops[position].deps), set()
    while todo:
        dep = ops[by_id[todo.pop()]]
        if dep.id in seen:
            continue
        seen.add(dep.id)
        if dep.collective is not None and dep.collective.kind == "all_to_all":
            found.append(dep)
        elif _zero_cost(dep):
            todo.extend(dep.deps)
    return found


def kv_chunk_bytes(workload: Workload) -> list[int]:
    """Per forward attention op (in program order): bytes of its K and V as Ulysses all-to-alls them."""
    return [kv for kv, _ in attention_input_bytes(workload)]


def attention_input_bytes(workload: Workload) -> list[tuple[int, int]]:
    """Per forward attention op (in program order): (bytes of its K and V, bytes of its Q) as Ulysses
    all-to-alls them (per rank; Q is the largest of the three)."""
    ops = workload.program(0).ops
    by_id = {op.id: i for i, op in enumerate(ops)}
    chunks = []
    for i, op in enumerate(ops):
        if op.op_class == "attention" and op.phase == "forward":
            sizes = sorted(a.collective.message_bytes for a in _all_to_all_inputs(ops, i, by_id))
            if len(sizes) < 3:
                raise ValueError(f"attention op {op.name!r} of {workload.name!r} does not read three all-to-alls "
                                 "(q, k, v); pass a Ulysses (AutoSP) workload")
            chunks.append((sum(sizes[:2]), sizes[-1]))
    return chunks


MERGE_FLOPS_PER_ELEMENT = 6
"""Online-softmax merge per output element: two rescalings (multiplies), an add, and the exp/logaddexp
work on the row statistics spread over the head dimension."""
ACCUMULATOR_BYTES = 4
"""fp32 accumulators of the merge and of the gradient sums."""


def _ring_program(source: RankProgram, rank: int, p: int, sites: list[tuple[int, int]],
                  element_bytes: int) -> RankProgram:
    nxt, prv = (rank + 1) % p, (rank - 1) % p
    out = _Program(source.tensors, source.host_tensors)
    forward_sites = sum(1 for op in source.ops if op.op_class == "attention" and op.phase == "forward")
    seen = {"forward": 0, "backward": 0}

    def send_recv(tag: str, phase: str, nbytes: int, send_deps, recv_deps) -> tuple[int, int]:
        send = out.start(f"{tag}.send", phase, Collective(kind="send", group=RING_GROUPS[0], message_bytes=nbytes,
                                                          key=f"{tag}.{rank}>{nxt}", peer=nxt), send_deps)
        recv = out.start(f"{tag}.recv", phase, Collective(kind="recv", group=RING_GROUPS[1], message_bytes=nbytes,
                                                          key=f"{tag}.{prv}>{rank}", peer=prv), recv_deps)
        return send, recv

    def chunks(op: Op, i: int, deps) -> int:
        """Chunk i of ``op``: 1/P of its FLOPs, bytes and attention scores (the remainder on the last)."""
        def part(total):
            return total // p + (total % p if i == p - 1 else 0)

        return out.add(name=f"{op.name}.chunk{i}", kind="compute", op_class=op.op_class, phase=op.phase,
                       flops=part(op.flops), bytes_read=part(op.bytes_read), bytes_written=part(op.bytes_written),
                       attention_scores=part(op.attention_scores), deps=tuple(deps),
                       allocates=op.allocates if i == 0 else ())

    for op in source.ops:
        if op.collective is not None and op.collective.kind == "all_to_all":
            if op.kind != "collective":
                raise ValueError(f"op {op.name!r} is a split all-to-all; export the Ulysses workload with "
                                 "overlap_communication=False (blocking all-to-alls)")
            out.copy(op, name=f"{op.name}.relayout", kind="compute", op_class="other", flops=0, bytes_read=0,
                     bytes_written=0, collective=None)
            continue
        if op.op_class != "attention":
            out.copy(op)
            continue
        site = seen[op.phase]
        seen[op.phase] += 1
        kv, q = sites[site if op.phase == "forward" else max(forward_sites - 1 - site, 0)]
        deps = tuple(out.new_id[d] for d in op.deps)
        buffers = [out.tensor(kv) for _ in range(2)]
        grad_buffers = [out.tensor(2 * kv) for _ in range(2)] if op.phase == "backward" else []
        # fp32 accumulators: the merged output (forward) or dQ (backward), [B, H, S/P, D] like q.
        q_elements = q // element_bytes
        kv_elements = kv // element_bytes
        accumulator = out.tensor(ACCUMULATOR_BYTES * q_elements)
        tag = f"{op.name}.ring"
        recv = chunk = dkv_recv = None
        merged = None  # the last merge / accumulation op
        dkv_sends: list[int] = []
        for i in range(p):
            if i < p - 1:  # pass the K,V chunk in hand on while computing with it
                send, next_recv = send_recv(f"{tag}.kv{i}", op.phase, kv, deps if i == 0 else (recv,),
                                            deps if i == 0 else (chunk,))
                if i == 0:
                    out.ops[send]["allocates"] = tuple(buffers + grad_buffers)
            chunk = chunks(op, i, deps if i == 0 else (recv,))
            if i == 0:
                out.ops[chunk]["allocates"] = tuple(out.ops[chunk]["allocates"]) + (accumulator,)
            if op.phase == "forward" and i > 0:  # online-softmax merge of this chunk into the fp32 output
                acc = ACCUMULATOR_BYTES * q_elements
                merged = out.add(name=f"{op.name}.merge{i}", kind="compute", op_class="elementwise", phase=op.phase,
                                 flops=MERGE_FLOPS_PER_ELEMENT * q_elements, bytes_read=acc + q, bytes_written=acc,
                                 deps=(chunk,) if merged is None else (chunk, merged))
            elif op.phase == "backward":  # this chunk's dQ, dK, dV added into the fp32 sums
                acc = ACCUMULATOR_BYTES * (q_elements + 2 * kv_elements)
                merged = out.add(name=f"{op.name}.accumulate{i}", kind="compute", op_class="elementwise",
                                 phase=op.phase, flops=q_elements + 2 * kv_elements, bytes_read=2 * acc,
                                 bytes_written=acc, deps=tuple(d for d in (chunk, merged, dkv_recv) if d is not None))
            if i < p - 1:
                out.wait(send)
                out.wait(next_recv)
                recv = next_recv
            if op.phase == "backward":  # the chunk's partial dK,dV (plus what came before) moves on
                send, next_recv = send_recv(f"{tag}.dkv{i}", op.phase, 2 * kv, (merged,), (merged,))
                dkv_sends.append(send)
                dkv_recv = next_recv
        for send in dkv_sends:
            out.wait(send)
        arrived = out.wait(dkv_recv) if dkv_recv is not None else None
        # Cast the fp32 accumulators to the outputs (forward: out; backward: dQ, and the arrived dK, dV).
        elements = q_elements + (2 * kv_elements if op.phase == "backward" else 0)
        last = out.add(name=f"{op.name}.finalize", kind="compute", op_class="elementwise", phase=op.phase,
                       flops=elements, bytes_read=ACCUMULATOR_BYTES * elements, bytes_written=element_bytes * elements,
                       deps=tuple(d for d in (chunk, merged, arrived) if d is not None))
        out.free_at(last, list(op.frees) + buffers + grad_buffers + [accumulator])
        out.new_id[op.id] = last
    return out.build(source.static_memory)


def ring_workload(workload: Workload, *, name: str | None = None, element_bytes: int = 2) -> Workload:
    """The ring-attention step of a Ulysses ``workload`` on the same ranks (one program per rank).

    ``element_bytes``: bytes of one activation element (2: bf16).  See Note [Ring attention as a rewrite of the
    Ulysses trace]."""
    p = workload.world_size
    if p < 2:
        raise ValueError("ring attention needs at least two ranks")
    if not workload.symmetric:
        raise ValueError("ring_workload expects the symmetric Ulysses workload autosp.export writes")
    sites = attention_input_bytes(workload)
    source = workload.program(0)
    everyone = [list(range(p))]
    return Workload(name=name or f"{workload.name}/ring", world_size=p,
                    groups={**{g: [list(m) for m in inst] for g, inst in workload.groups.items()},
                            **dict.fromkeys(RING_GROUPS, everyone)},
                    ranks={r: _ring_program(source, r, p, sites, element_bytes) for r in range(p)}, symmetric=False,
                    metadata={**workload.metadata, "system": "ring"})


# --- data-parallel replicas ----------------------------------------------------------------------------------
