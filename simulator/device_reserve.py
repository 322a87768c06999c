"""Device memory that no framework tensor accounts for: CUDA context, NCCL buffers, library workspaces, allocator.

Every uncertain constant of the memory ledger (:mod:`simulator.ledger`) lives here, in one place, as an
:class:`Uncertain` with a low / nominal / high band, its unit and where it comes from. ``assumption=True`` marks a
value that no public source pins down: it is an engineering estimate with a deliberately wide band, and nothing
here is fitted to any paper's published sequence lengths. :func:`with_uncertain` returns the table with one
constant moved (what ``python -m simulator --sensitivity`` varies).

Note [Caching allocator model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``) rounds every request up to a multiple of
``kMinBlockSize`` = 512 bytes; requests of at most ``kSmallSize`` = 1 MiB are carved from 2 MiB segments
(``kSmallBuffer``), requests under ``kMinLargeAlloc`` = 10 MiB from 20 MiB segments (``kLargeBuffer``), and
larger ones get their own segment rounded up to ``kRoundLarge`` = 2 MiB. :func:`reserved_bytes` applies the
512-byte rounding and, for large requests, the 2 MiB segment rounding; the rest of a shared small/medium segment
is not charged per request (it is reused). What rounding cannot capture - free blocks stranded between live ones
as tensors of different sizes come and go during a step - is the fragmentation band, a fraction of the bytes
that churn (activations and step transients), not of the long-lived flat buffers allocated once at start-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True, kw_only=True)
class Uncertain:
    """One uncertain constant with its band."""

    name: str
    low: float
    nominal: float
    high: float
    unit: str
    provenance: str
    assumption: bool
    """True: an estimate no public source fixes (see the module docstring)."""

    def __post_init__(self) -> None:
        if not self.low <= self.nominal <= self.high:
            raise ValueError(f"{self.name}: need low <= nominal <= high, got {self.low}, {self.nominal}, {self.high}")


UNCERTAIN: dict[str, Uncertain] = {u.name: u for u in (
    Uncertain(
        name="cuda_context_bytes", low=0.3 * GiB, nominal=0.6 * GiB, high=1.0 * GiB, unit="bytes per process",
        provenance="assumption: the CUDA context plus the loaded kernel images of PyTorch and its libraries; "
                   "the CUDA C++ Programming Guide (Lazy Loading, CUDA_MODULE_LOADING) says it depends on which "
                   "modules are loaded and gives no figure; 0.3-1 GiB is the range commonly reported for A100/H100",
        assumption=True),
    Uncertain(
        name="nccl_bytes_per_communicator", low=0.15 * GiB, nominal=0.3 * GiB, high=1.5 * GiB,
        unit="bytes per NCCL communicator",
        provenance="NCCL environment-variable documentation: NCCL_BUFFSIZE (default 4 MiB) per channel, peer and "
                   "protocol (Simple; LL128 about as large; LL small) with up to NCCL_MAX_NCHANNELS=32 channels: "
                   "8-32 channels x 2 ring/tree peers x ~9 MiB gives 0.15-0.6 GiB; all-to-all/p2p adds buffers "
                   "per peer. ALST (arXiv 2506.13996) and Fujii et al. (arXiv 2411.06465) report one to several "
                   "GB of NCCL memory per GPU at scale, hence the high end (assumption within that range)",
        assumption=True),
    Uncertain(
        name="workspace_bytes_per_stream", low=8 * MiB, nominal=32 * MiB, high=64 * MiB,
        unit="bytes per compute stream",
        provenance="cuBLAS/cuBLASLt workspace that PyTorch keeps per (handle, stream): CUBLAS_WORKSPACE_CONFIG "
                   "(:4096:8 = 32 MiB, cuBLAS documentation 'Results reproducibility'); attention kernels' "
                   "scratch is counted with the activations of the traced workload",
        assumption=False),
    Uncertain(
        name="fragmentation_fraction", low=0.0, nominal=0.05, high=0.20, unit="fraction of churning bytes",
        provenance="assumption: stranded free blocks in PyTorch's caching allocator (see Note [Caching allocator "
                   "model]); the PyTorch CUDA semantics docs (PYTORCH_CUDA_ALLOC_CONF, expandable_segments) "
                   "describe the effect without a figure",
        assumption=True),
    Uncertain(
        name="host_process_bytes", low=2 * GiB, nominal=4 * GiB, high=8 * GiB, unit="bytes of host memory per rank",
        provenance="assumption: resident host memory of one GPU training process outside its tensors (the Python "
                   "interpreter, PyTorch's and the CUDA user-space libraries, DeepSpeed and its CPU Adam); no "
                   "public figure, commonly a few GiB per process; only counted under optimizer or activation "
                   "offload, where host memory is a budget",
        assumption=True),
)}
"""Every uncertain constant, by name."""

ALLOCATOR_PROVENANCE = ("PyTorch c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize=512 B rounding, kSmallSize=1 MiB, "
                        "kMinLargeAlloc=10 MiB, kRoundLarge=2 MiB segments (see Note [Caching allocator model])")

_MIN_BLOCK = 512
_MIN_LARGE_ALLOC = 10 * MiB
_ROUND_LARGE = 2 * MiB


def reserved_bytes(request: int) -> int:
    """Bytes the caching allocator sets aside for one request of ``request`` bytes (Note [Caching allocator
    model])."""
    if request <= 0:
        return 0
    rounded = -(-request // _MIN_BLOCK) * _MIN_BLOCK
    if rounded >= _MIN_LARGE_ALLOC:
        rounded = -(-rounded // _ROUND_LARGE) * _ROUND_LARGE
    return rounded


def with_uncertain(name: str, value: float) -> dict[str, Uncertain]:
    """A copy of :data:`UNCERTAIN` whose ``name`` has nominal ``value`` (kept inside its own band: it widens)."""
    if name not in UNCERTAIN:
        raise ValueError(f"unknown uncertain constant {name!r}; known: {sorted(UNCERTAIN)}")
    old = UNCERTAIN[name]
    table = dict(UNCERTAIN)
    table[name] = dataclasses.replace(old, nominal=value, low=min(old.low, value), high=max(old.high, value))
    return table
