"""Every efficiency and latency constant of the GPU presets, in one table, each with its band and provenance.

The datasheet figures of a preset (peak FLOP/s, HBM bandwidth, capacity, link bandwidths) live, each with its
source, in :mod:`simulator.datasheets`; what a datasheet does not give - the fraction of those peaks real kernels
and NCCL reach, and the fixed latencies - lives here, as :class:`simulator.device_reserve.Uncertain` entries (value, low,
high, unit, provenance, ``assumption``). ``assumption=True`` marks a value no public measurement we can cite pins
down: an engineering estimate with a deliberately wide band. Nothing here is fitted to the AutoSP paper's
published figures. :func:`simulator.hardware.build_preset` reads the nominal values; ``python -m simulator
--sensitivity`` moves each constant to its low and high end and re-simulates (:func:`constants_for`).

Names are ``<scope>.<quantity>``; the scope is an architecture (``ampere``: A100; ``hopper``: H100, H200, GH200;
``blackwell``: B200; ``cdna2``: MI250; ``cdna3``: MI300X), ``gpu`` (shared by all of them), or a fabric (``nvlink``,
``xgmi``, ``pcie``, ``ib``, ``rail``: the leaf switches of a rail-optimised network).

Note [Attention efficiency is the kernel PyTorch runs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The traced models call ``scaled_dot_product_attention``; on CUDA, PyTorch's flash backend is FlashAttention-2.
So the nominal attention efficiency is FA-2's measured causal forward+backward throughput at head dim 128
(FLOPs counted as in the FA papers: 4·S²·D·H per forward, halved under causal masking, backward 2.5x), and the
band's high end on Hopper is FlashAttention-3 (a different kernel, reachable through flash-attn 3 or cuDNN).
On Hopper FA-2 reaches a much smaller fraction of the peak than on Ampere (35 % vs 50-73 %), which is why the
constant is per architecture. Recent PyTorch puts its cuDNN backend first on sm90 and sm100 when the runtime cuDNN
is newer than 9.15 (``check_prefer_cudnn_attention`` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp); the
Hopper figures above are FA-2's and predate that, while the Blackwell constant is bracketed by cuDNN's and
FlashAttention-4's kernels. On ROCm the flash backend is AOTriton's (or composable_kernel's) FlashAttention-2 port.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from simulator.device_reserve import Uncertain

_FA2 = "Dao, 'FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning' (arXiv 2307.08691)"
_FA3 = ("Shah et al., 'FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision' "
        "(arXiv 2407.08608)")
_FA4 = ("Zadouri et al., 'FlashAttention-4: Algorithm and Kernel Pipelining Co-Design for Asymmetric Hardware "
        "Scaling' (abstract)")
_MAMF = ("S. Bekman, 'Machine Learning Engineering Open Book' (github.com/stas00/ml-engineering), "
         "compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison table' (BF16 matmul, best shape "
         "of a search, mean of 100 iterations)")
_VECTOR = ("datasheet ratio: elementwise and reduction kernels run on the non-tensor FP32 units, ~6 % of the dense "
           "BF16 tensor peak (A100 datasheet 19.5 vs 312 TFLOP/s, H100 SXM 67 vs 989); they are memory-bound in "
           "practice, so only the memory fraction matters")
_STREAM = ("attainable HBM bandwidth: STREAM/BabelStream-style copy and triad kernels (Deakin et al., 'Evaluating "
           "attainable memory bandwidth of parallel programming models via BabelStream', IJCSE 2018) reach ~85-92 % "
           "of the datasheet bandwidth on A100 and H100 as commonly reported; generated pointwise kernels (Triton, "
           "Inductor) a little less. Assumption within that range")


def _u(name: str, low: float, nominal: float, high: float, unit: str, provenance: str, *,
       assumption: bool) -> Uncertain:
    return Uncertain(name=name, low=low, nominal=nominal, high=high, unit=unit, provenance=provenance,
                     assumption=assumption)


GPU_CONSTANTS: dict[str, Uncertain] = {u.name: u for u in (
    # --- tensor-core kernels, per architecture -------------------------------------------------------------
    _u("ampere.matmul.flops", 0.70, 0.80, 0.90, "fraction of BF16 peak",
       f"large BF16 GEMMs (cuBLAS) at LLM shapes on A100; {_FA2} (abstract) calls its 50-73 % of peak 'close to "
       "the efficiency of GEMM operations'; NVIDIA 'Matrix Multiplication Background User's Guide' (tile and "
       "wave quantization) explains the gap to peak. No single published figure for these shapes: assumption "
       "bracketed by those sources", assumption=True),
    _u("hopper.matmul.flops", 0.60, 0.70, 0.80, "fraction of BF16 peak",
       "large BF16 GEMMs (cuBLAS, wgmma) on H100/H200 SXM at LLM shapes reach roughly 600-800 of 989 TFLOP/s in "
       "public microbenchmarks; the H100 runs below its boost clock under sustained tensor load (power limit). "
       "Assumption within that range", assumption=True),
    _u("cdna2.matmul.flops", 0.50, 0.70, 0.80, "fraction of BF16 peak",
       "assumption: no public rocBLAS BF16 GEMM figure at these shapes was found; same nominal as Ampere's low end",
       assumption=True),
    _u("blackwell.matmul.flops", 0.55, 0.68, 0.78, "fraction of BF16 peak",
       f"{_MAMF}: B200 SXM 1,745 of 2,250 TFLOP/s (77.6 %) at its best shape (torch 2.7.1, CUDA 12.8), against "
       "80.3 % on H100 SXM, so the high end; LLM shapes reach less (tile and wave quantization, power-limited "
       "clocks under sustained load), so the nominal sits below it as Hopper's (0.70) sits below the H100's 80 %. "
       "Assumption within that range", assumption=True),
    _u("cdna3.matmul.flops", 0.35, 0.45, 0.60, "fraction of BF16 peak",
       f"{_MAMF}: MI300X 668.4 of 1,300 TFLOP/s (51.4 %) at its best shape (torch 2.5.1, ROCm 6.3, TunableOp on); "
       "an earlier revision of the table gave 781.9 (60 %) on ROCm 6.2 and its notes ~450 (35 %) on ROCm 6.1: "
       "hipBLASLt reaches a smaller fraction of the datasheet peak than cuBLAS does of NVIDIA's (the datasheet peak "
       "assumes the boost clock, held in lightly loaded phases: AMD ROCm blog 'Understanding Peak, Max-Achievable "
       "& Delivered FLOPs, Part 1'), and LLM shapes less than the best one. Assumption within that range",
       assumption=True),
    _u("ampere.attention.flops", 0.50, 0.60, 0.73, "fraction of BF16 peak",
       f"{_FA2}, sec. 4.1 and Fig. 4-5: on A100 FA-2 reaches 50-73 % of peak in the forward and up to 63 % in the "
       "backward; causal forward+backward at head dim 128 and 8K tokens lands near 60 % (see Note [Attention "
       "efficiency is the kernel PyTorch runs])", assumption=False),
    _u("hopper.attention.flops", 0.30, 0.35, 0.60, "fraction of BF16 peak",
       f"{_FA3}, abstract and sec. 1: FlashAttention-2 (PyTorch's flash backend) reaches ~35 % of the H100 peak "
       f"(up to 335 TFLOP/s forward+backward, {_FA2} sec. 4.1); FA-3 reaches 75 % in the forward and is "
       "1.5-1.75x faster than FA-2 in the backward, so ~50-60 % forward+backward is the high end",
       assumption=False),
    _u("cdna2.attention.flops", 0.25, 0.40, 0.55, "fraction of BF16 peak",
       "assumption: ROCm's FlashAttention-2 port (composable_kernel) on MI250 reports no causal head-dim-128 "
       "figure we can cite; set between Hopper's FA-2 and Ampere's", assumption=True),
    _u("blackwell.attention.flops", 0.25, 0.45, 0.65, "fraction of BF16 peak",
       f"{_FA4}: on B200 in BF16 FA-4 reaches up to 1,613 TFLOP/s (71 %) in the forward, up to 1.3x faster than "
       "cuDNN 9.13 and 2.7x faster than Triton. PyTorch runs cuDNN's kernel on sm100 (see Note [Attention "
       "efficiency is the kernel PyTorch runs]); no causal forward+backward figure at head dim 128 for it we can "
       "cite, and backward kernels run below the forward. Assumption: nominal below cuDNN's forward (at least "
       "71 %/1.3 = 55 % where FA-4 peaks) for the slower backward; low end a kernel not written for Blackwell "
       "(Triton, FA-2), high end FA-4 forward+backward", assumption=True),
    _u("cdna3.attention.flops", 0.20, 0.35, 0.50, "fraction of BF16 peak",
       "assumption: PyTorch's flash backend on ROCm is AOTriton's FlashAttention-2 port (composable_kernel's with "
       "torch.backends.cuda.preferred_rocm_fa_library); no causal forward+backward figure at head dim 128 on MI300X "
       "we can cite. Set below cdna3.matmul.flops, as FA-2 sits below GEMM wherever both are measured "
       f"({_FA2}, abstract: 50-73 % of the A100 peak, 'close to the efficiency of GEMM operations')",
       assumption=True),
    # --- vector-unit and memory-bound kernels, shared ---------------------------------------------------------
    _u("gpu.vector.flops", 0.04, 0.06, 0.08, "fraction of BF16 tensor peak", _VECTOR, assumption=False),
    _u("gpu.elementwise.memory", 0.60, 0.80, 0.90, "fraction of HBM bandwidth", _STREAM, assumption=True),
    _u("gpu.reduction.memory", 0.50, 0.70, 0.90, "fraction of HBM bandwidth",
       "row reductions (norms, softmax, loss) reach less of the HBM bandwidth than pointwise kernels (short rows, "
       "two passes when the row does not fit in registers); assumption below the STREAM fraction",
       assumption=True),
    _u("gpu.memory.memory", 0.70, 0.85, 0.92, "fraction of HBM bandwidth",
       f"copies, casts, concatenations: the STREAM copy kernel itself; {_STREAM}", assumption=True),
    _u("gpu.matmul.memory", 0.60, 0.80, 0.90, "fraction of HBM bandwidth",
       "memory-bound GEMMs (skinny shapes) stream their operands like a copy; assumption like the pointwise one",
       assumption=True),
    _u("gpu.other.memory", 0.40, 0.60, 0.85, "fraction of HBM bandwidth",
       "ops of no known class: assumption, wide band", assumption=True),
    _u("gpu.kernel_launch_overhead_s", 2e-6, 4e-6, 8e-6, "seconds per kernel",
       "NVIDIA developer blog 'Getting Started with CUDA Graphs' (A. Gray, 2019): launching a short kernel costs "
       "a few microseconds, comparable to its run time; with asynchronous launches the GPU-side gap between "
       "kernels is smaller and the host-side Triton launcher of Inductor larger. Assumption within that range",
       assumption=True),
    # --- fabrics ----------------------------------------------------------------------------------------------
    _u("nvlink.efficiency", 0.70, 0.80, 0.90, "fraction of NVLink peak per direction",
       "NVIDIA nccl-tests (doc/PERFORMANCE.md defines bus bandwidth): all_reduce_perf on 8x A100 SXM reports "
       "~230-240 GB/s busbw of 300 GB/s, on 8x H100 SXM ~360-380 of 450 without NVLink SHARP, as commonly "
       "published for DGX systems; assumption within that range, taken for B200's NVLink 5 too (no B200 figure "
       "cited)", assumption=True),
    _u("nvlink.latency_s", 0.5e-6, 1.0e-6, 3.0e-6, "seconds per algorithm step",
       "NCCL's small-message all-reduce latency on one NVSwitch node is ~10-20 us for 14 ring steps (nccl-tests, "
       "8 GPUs), i.e. ~1 us per step; assumption", assumption=True),
    _u("xgmi.efficiency", 0.55, 0.70, 0.85, "fraction of Infinity Fabric peak per direction",
       "assumption: RCCL on MI250 reaches a smaller fraction of the link peak than NCCL on NVSwitch (partial mesh); "
       "taken for MI300X's full mesh too (no MI300X figure cited)", assumption=True),
    _u("xgmi.latency_s", 1.0e-6, 1.5e-6, 4.0e-6, "seconds per algorithm step", "assumption: RCCL's per-step latency over Infinity Fabric, taken above NCCL's over NVSwitch",
       assumption=True),
    _u("pcie.latency_s", 0.3e-6, 0.5e-6, 1.0e-6, "seconds per hop",
       "PCIe switch hop latency (PCIe Gen4/Gen5 switch product briefs give ~100-150 ns per switch; a GPU->NIC "
       "hop adds the root ports); assumption", assumption=True),
    _u("ib.efficiency", 0.80, 0.90, 0.95, "fraction of the NIC line rate",
       "InfiniBand HDR/NDR: perftest ib_write_bw reaches ~90-97 % of the line rate; NCCL over IB a little less. "
       "Assumption within that range", assumption=True),
    _u("ib.nic_latency_s", 1.5e-6, 2.5e-6, 5.0e-6, "seconds per message",
       "NVIDIA ConnectX-6/7 product briefs quote sub-microsecond adapter latency; NCCL's proxy and GPUDirect RDMA "
       "path add a few microseconds end to end. Assumption", assumption=True),
    _u("ib.switch_latency_s", 0.3e-6, 0.6e-6, 1.5e-6, "seconds through the fabric",
       "NVIDIA Quantum (HDR) and Quantum-2 (NDR) switch datasheets: ~100-130 ns port to port; a three-level fat "
       "tree crosses up to five switches plus cables. Assumption", assumption=True),
    # --- device <-> host memory (optimizer offload) -------------------------------------------------------
    _u("pcie_host.efficiency", 0.70, 0.80, 0.90, "fraction of the PCIe peak per direction",
       "device<->host copies from and to pinned host memory: NVIDIA's CUDA samples bandwidthTest commonly reports "
       "~25 GB/s of the 32 GB/s per direction of PCIe Gen4 x16 and ~50 of 64 on Gen5 (packet and DMA overhead); "
       "pageable memory is slower. Assumption within that range", assumption=True),
    _u("pcie_host.latency_s", 2e-6, 5e-6, 10e-6, "seconds per copy",
       "cudaMemcpyAsync to or from pinned host memory: a few microseconds of launch and DMA set-up per copy "
       "(CUDA C++ Best Practices Guide, 'Data Transfer Between Host and Device', gives no figure). Assumption",
       assumption=True),
    _u("c2c.efficiency", 0.60, 0.80, 0.90, "fraction of the NVLink-C2C peak per direction",
       "GH200: NVLink-C2C is 450 GB/s per direction (datasheet); copy kernels and DMA between HBM and LPDDR5X "
       "reach part of it, and the Grace memory (LPDDR5X, up to 512 GB/s per the datasheet) bounds it too. "
       "Assumption", assumption=True),
    _u("c2c.latency_s", 1e-6, 3e-6, 10e-6, "seconds per copy",
       "one copy between HBM and Grace memory: launch and set-up, as for PCIe without its DMA engine hop. "
       "Assumption", assumption=True),
    _u("host_cpu.adam_elements_per_s", 0.3e9, 1.0e9, 2.0e9, "fp32 elements per second per rank",
       "DeepSpeed's CPU Adam (ops/adam/cpu_adam.py; Ren et al., 'ZeRO-Offload', USENIX ATC 2021, sec. 5: a "
       "vectorised Adam on the CPU) streams ~30 bytes per element (reads parameter, gradient and two moments, "
       "writes them back and the low-precision copy), so it is bound by DRAM bandwidth: a two-socket DGX-class "
       "host (8 DDR4-3200 or DDR5-4800 channels per socket, 0.4-0.6 TB/s peak, ~70 % attained) shared by 8 ranks "
       "gives 1-2e9 elements/s per rank. Not measured here: assumption (read by "
       "simulator.training_step.host_optimizer_time_s, outside the simulated step)", assumption=True),
    # --- rail-optimised inter-node fabrics (multi-node cluster presets) --------------------------------------
    _u("rail.leaf_latency_s", 0.15e-6, 0.3e-6, 0.6e-6, "seconds through one rail (leaf) switch",
       "rail-optimised compute fabric as in the NVIDIA DGX SuperPOD reference architectures (DGX A100 and DGX "
       "H100): NIC k of every node in a scalable unit plugs into leaf switch k, so traffic between GPUs of equal "
       "local index crosses one switch; Quantum/Quantum-2 switch datasheets give ~100-130 ns port to port, plus "
       "cables. Traffic between rails crosses leaf-spine-leaf and pays ib.switch_latency_s instead. Assumption",
       assumption=True),
)}
"""Every efficiency and latency constant of the GPU presets, by name."""

ARCHITECTURES = ("ampere", "hopper", "blackwell", "cdna2", "cdna3")
HOST_SCOPES = {"pcie": "pcie_host", "nvlink-c2c": "c2c"}
"""Host-memory link kind (``HardwarePreset.host_memory_kind``) -> scope of its constants."""


def constants_for(arch: str, fabric: str, *, rail_optimized: bool = False, host: str = "pcie") -> tuple[str, ...]:
    """Names of the constants a preset of architecture ``arch`` with intra-node fabric ``fabric`` and host-memory
    link ``host`` (a key of :data:`HOST_SCOPES`) reads (with ``rail_optimized``: also those of a rail-optimised
    inter-node network, see ``simulator.hardware.NETWORKS``)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES}")
    if host not in HOST_SCOPES:
        raise ValueError(f"unknown host-memory link {host!r}; choose one of {tuple(HOST_SCOPES)}")
    scopes = (arch, "gpu", fabric, "pcie", HOST_SCOPES[host], "ib", *(("rail",) if rail_optimized else ()))
    return tuple(n for n in GPU_CONSTANTS if n.split(".")[0] in scopes)


def moved(name: str, to: str, table: Mapping[str, Uncertain] | None = None) -> dict[str, Uncertain]:
    """A copy of ``table`` (default :data:`GPU_CONSTANTS`) with ``name``'s nominal moved to its ``low``/``high``."""
    table = dict(GPU_CONSTANTS if table is None else table)
    if name not in table:
        raise ValueError(f"unknown GPU constant {name!r}; known: {sorted(table)}")
    if to not in ("low", "high", "nominal"):
        raise ValueError("to must be 'low', 'nominal' or 'high'")
    table[name] = dataclasses.replace(table[name], nominal=getattr(table[name], to))
    return table
