"""A small imperative builder for :class:`~simulator.workload.RankProgram` objects.

Writing :class:`~simulator.workload.Op` tuples by hand means tracking op ids, tensor ids and collective keys;
:class:`ProgramBuilder` does that bookkeeping so hand-built test workloads, synthetic generators and the exporter
can say ``b.compute("mm", flops=...)``, ``h = b.start("a2a_q", ...)``, ``b.wait(h)``. Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable

from simulator.workload import Collective, Op, RankProgram, StaticMemory


class ProgramBuilder:
    """Accumulates ops in program order and hands out op and tensor ids (both start at 0)."""

    def __init__(self) -> None:
        self._ops: list[Op] = []
        self._tensors: dict[int, int] = {}
        self._host: set[int] = set()
        self._starts: dict[int, Collective] = {}

    @property
    def num_ops(self) -> int:
        """Number of ops added so far."""
        return len(self._ops)

    def tensor(self, nbytes: int, *, host: bool = False) -> int:
        """Declare a tensor of ``nbytes`` bytes (in host memory with ``host``: Note [Host tensors] in
        :mod:`simulator.workload_types`) and return its id."""
        tid = len(self._tensors)
        self._tensors[tid] = int(nbytes)
        if host:
            self._host.add(tid)
        return tid

    def _add(self, **fields) -> int:
        op_id = len(self._ops)
        for key in ("deps", "allocates", "frees"):
            fields[key] = tuple(fields.get(key) or ())
        self._ops.append(Op(id=op_id, **fields))
        return op_id

    def compute(
        self,
        name: str,
        *,
        flops: int = 0,
        bytes_read: int = 0,
        bytes_written: int = 0,
        op_class: str = "other",
        phase: str = "forward",
        deps: Iterable[int] = (),
        allocates: Iterable[int] = (),
        frees: Iterable[int] = (),
        attention_scores: int = 0,
    ) -> int:
        """Append a compute op; return its id."""
        return self._add(name=name, kind="compute", op_class=op_class, phase=phase, flops=int(flops),
                         bytes_read=int(bytes_read), bytes_written=int(bytes_written), deps=deps,
                         allocates=allocates, frees=frees, attention_scores=int(attention_scores))

    def _collective_op(
        self,
        op_kind: str,
        name: str,
        *,
        kind: str,
        group: str,
        message_bytes: int,
        key: str | None = None,
        peer: int | None = None,
        phase: str = "forward",
        deps: Iterable[int] = (),
        allocates: Iterable[int] = (),
        frees: Iterable[int] = (),
    ) -> int:
        """Append an op of ``op_kind`` carrying a :class:`Collective` (its ``key`` defaults to ``c<op id>``)."""
        coll = Collective(kind=kind, group=group, message_bytes=int(message_bytes),
                          key=key if key is not None else f"c{len(self._ops)}", peer=peer)
        return self._add(name=name, kind=op_kind, phase=phase, deps=deps, allocates=allocates, frees=frees,
                         collective=coll)

    def collective(self, name: str, **fields) -> int:
        """Append a blocking collective (the compute stream waits for it); return its op id.

        ``fields``: ``kind``, ``group`` and ``message_bytes``, and optionally ``key`` (default ``c<op id>``),
        ``peer``, ``phase`` (default "forward"), ``deps``, ``allocates`` and ``frees``."""
        return self._collective_op("collective", name, **fields)

    def start(self, name: str, **fields) -> int:
        """Append a ``collective_start`` on ``group``'s comm stream, with :meth:`collective`'s ``fields``; return
        its op id (pass it to :meth:`wait`)."""
        op_id = self._collective_op("collective_start", name, **fields)
        self._starts[op_id] = self._ops[op_id].collective
        return op_id

    def wait(
        self,
        start_id: int,
        *,
        name: str | None = None,
        phase: str | None = None,
        deps: Iterable[int] = (),
        allocates: Iterable[int] = (),
        frees: Iterable[int] = (),
    ) -> int:
        """Append the ``collective_wait`` for the start ``start_id``; return its op id."""
        if start_id not in self._starts:
            raise ValueError(f"op {start_id} is not a collective_start of this builder; pass the id start() returned")
        start = self._ops[start_id]
        return self._add(name=name or f"wait_{start.name}", kind="collective_wait", phase=phase or start.phase,
                         deps=deps, allocates=allocates, frees=frees, collective=self._starts[start_id])

    def build(self, static_memory: StaticMemory | None = None) -> RankProgram:
        """The program built so far."""
        return RankProgram(ops=tuple(self._ops), tensors=dict(self._tensors),
                           static_memory=static_memory or StaticMemory(), host_tensors=frozenset(self._host))
