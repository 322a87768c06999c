"""Per-rank peak tensor memory of real (non-fake) CPU runs: a dispatch-level live-storage tracker.

Usage (one training step, on any rank)::

    with PeakMemory(static=[p for p in model.parameters()] + [p.grad for p in model.parameters()]) as pm:
        loss = model(**inputs).loss
        loss.backward()
    pm.peak_bytes            # static + the peak of tensors created inside the block (the device pool)
    pm.host_peak_bytes       # the peak of the host pool (activation offload's copies)
    pm.breakdown()           # {"static": ..., "by_op": {aten op: bytes live at the peak}, ...}

Note [What PeakMemory counts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
It is a ``TorchDispatchMode``: every aten op that runs inside the block (eager ops, the ops of an
``aot_eager``-compiled forward and backward graph, custom ops such as AutoSP's all-to-all, and the
autograd engine's gradient accumulation) is seen with its outputs; so are the ops inside the kernels of
AutoSP's tiled loss and tiled MLP, which allocate their chunks there (a mode does not see inside other
custom ops, whose kernels allocate only what they return). Each output's *storage* is counted
once (views share it) from the op that created it until Python's weak reference to the storage fires,
i.e. until the C++ storage is really freed (storages keep their Python object alive while C++ holds
them, so the callback marks the true free). Sizes are ``storage.nbytes()``: the CPU allocator does not
round them up.

Counted: activations (saved for backward or not), temporaries, the outputs of collectives, gradients
produced by backward, plus the ``static`` tensors passed in (deduplicated by storage) - typically the
parameters, preallocated gradients and optimizer state, which exist before the block starts and are
therefore invisible to a dispatch mode. Not counted: memory a kernel allocates internally without
returning it as a tensor (e.g. scratch buffers of the CPU flash-attention kernel, gloo's transport
buffers), Python objects, and the fused kernels of inductor (only their extern calls are visible: use
``aot_eager`` when measuring). Cost: a dictionary update per op output and a weakref per new storage;
a few percent on a tiny model, so measure memory on an untimed step.

Two pools: the outputs of ``autosp_testbed::offload_to_host`` (Note [Activation offload] in
autosp/passes/partitioned/offload.py) are host memory on a GPU, so they count in a separate host pool
(``host_live_bytes``, ``host_peak_bytes``), never in ``peak_bytes``: the device peak, which is what "fits" means
for the memory-cap search (experiments/cpu/memory_cap.py) and the measured tables.  On CPU both are the same
RAM; the split is what a GPU run would see.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autosp.costs import TILED_LOSS, TILED_MLP
from autosp.passes.partitioned.offload import OFFLOAD

log = logging.getLogger(__name__)

__all__ = ["PeakMemory", "storage_bytes"]

_SCRATCH_OPS = frozenset((*TILED_LOSS, *TILED_MLP))
"""AutoSP's ops that allocate and free scratch inside their kernels (autosp.costs.workspace_bytes)."""
_HOST_OPS = frozenset((OFFLOAD,))
"""AutoSP's ops whose outputs live in host memory (Note [Activation offload ops] in autosp/ops.py)."""


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    st = t.untyped_storage()
    if st.nbytes() == 0:
        return None
    return (st.data_ptr(), st.nbytes())


def _has_storage(t) -> bool:
    """A real tensor with a storage: not meta, not a torch.func wrapper (the tiled MLP's backward runs
    ``torch.func.vjp``; the mode sees its ops on the wrappers and again on the tensors they wrap)."""
    return (isinstance(t, torch.Tensor) and t.device.type != "meta"
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and ``None`` entries count nothing)."""
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = _storage_key(t)
            if key is not None:
                seen[key] = key[1]
    return sum(seen.values())


class PeakMemory(TorchDispatchMode):
    """Track live tensor-storage bytes inside a ``with`` block; see Note [What PeakMemory counts].

    ``static``: tensors alive before the block whose memory belongs to the measurement (parameters,
    gradients, optimizer state); counted once per storage for the whole block. ``keep_breakdown``: keep,
    at each new peak, the bytes live per allocating aten op (for :meth:`breakdown`).
    """

    def __init__(self, *, static: Iterable[torch.Tensor | None] = (), keep_breakdown: bool = True) -> None:
        super().__init__()
        static = [t for t in static if isinstance(t, torch.Tensor)]
        self.static_bytes = storage_bytes(static)
        self._static_keys = {k for k in map(_storage_key, static) if k is not None}
        self._keep_breakdown = keep_breakdown
        self._live: dict[int, tuple[int, str]] = {}  # id(storage) -> (bytes, allocating op), device pool
        self._host: dict[int, int] = {}  # id(storage) -> bytes, host pool
        self._refs: dict[int, weakref.ref] = {}
        self.live_bytes = 0
        """Bytes of the storages created inside the block that are still alive."""
        self.peak_live_bytes = 0
        """Peak of ``live_bytes`` over the block."""
        self.allocated_bytes = 0
        """Total bytes of all storages created inside the block (a measure of allocator traffic)."""
        self._peak_by_op: Counter[str] = Counter()
        self.host_live_bytes = 0
        """Bytes of the host pool (outputs of activation offload's copies to host) still alive."""
        self.host_peak_bytes = 0
        """Peak of ``host_live_bytes`` over the block."""

    @property
    def peak_bytes(self) -> int:
        """Static bytes plus the peak of the tensors created inside the block."""
        return self.static_bytes + self.peak_live_bytes

    def breakdown(self) -> dict:
        """``static_bytes``, ``peak_live_bytes``, ``peak_bytes`` (the device pool), ``host_peak_bytes`` (the host
        pool) and ``by_op``: device bytes live at the device peak per op."""
        return {"static_bytes": self.static_bytes, "peak_live_bytes": self.peak_live_bytes,
                "peak_bytes": self.peak_bytes, "host_peak_bytes": self.host_peak_bytes,
                "allocated_bytes": self.allocated_bytes, "by_op": dict(self._peak_by_op.most_common())}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let torch.compile compile (and hit its cache) while the mode is on: the mode is switched off
        # while Dynamo traces and on again while the compiled artifact runs, so with aot_eager it sees
        # every aten op of the compiled forward and backward graphs.
        return True

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        self._refs.pop(key, None)
        if key in self._host:
            self.host_live_bytes -= self._host.pop(key)
            return
        nbytes, _ = self._live.pop(key, (0, ""))
        self.live_bytes -= nbytes

    def _track(self, t: torch.Tensor, op_name: str, *, host: bool = False) -> None:
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self._live or key in self._host:
            return
        nbytes = st.nbytes()
        if nbytes == 0 or (st.data_ptr(), nbytes) in self._static_keys:
            return
        try:
            ref = weakref.ref(st, lambda r, key=key: self._freed(key, r))
        except TypeError:  # pragma: no cover - storages without weakref support: count, never free
            ref = None
        if ref is not None:
            self._refs[key] = ref
        self.allocated_bytes += nbytes
        if host:
            self._host[key] = nbytes
            self.host_live_bytes += nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_live_bytes)
            return
        self._live[key] = (nbytes, op_name)
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes
            if self._keep_breakdown:
                by_op: Counter[str] = Counter()
                for b, name in self._live.values():
                    by_op[name] += b
                self._peak_by_op = by_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SCRATCH_OPS and not any(isinstance(t, torch.Tensor) and t.device.type != "cpu"
                                            for t in tree_leaves((args, kwargs))):
            # A dispatch mode is off while its handler runs, so it never sees the ops inside a custom op's
            # kernel; these ops allocate their chunks there.  Run the (Python) CPU kernel with the mode on.
            with self:
                out = func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
        else:
            out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        # Views, in-place and out= ops return (aliases of) an input: no new memory.
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if _has_storage(t)}
        for leaf in tree_leaves(out):
            if _has_storage(leaf) and id(leaf.untyped_storage()) not in inputs:
                self._track(leaf, name, host=func in _HOST_OPS)
        return out

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        log.debug("PeakMemory: static %d B, peak live %d B, host peak %d B, allocated %d B", self.static_bytes,
                  self.peak_live_bytes, self.host_peak_bytes, self.allocated_bytes)
        return result
