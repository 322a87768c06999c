"""Hand-sized clusters and workloads with round numbers, so expected timelines can be written down exactly."""

from __future__ import annotations

from simulator import Cluster, ProgramBuilder, Workload
from simulator.hardware import DeviceSpec, HardwarePreset, LinkSpec, NetworkSpec, OpClassEfficiency

GFLOP = 10**9
MS = 1e-3


def toy_preset(*, devices_per_node: int = 2, flops_per_s: float = 1e12, memory_bandwidth_bytes_per_s: float = 1e12,
               link_bytes_per_s: float = 1e9, link_latency_s: float = 0.0, memory_bytes: int = 10**12,
               launch_s: float = 0.0, nic_bytes_per_s: float = 1e8, nic_latency_s: float = 0.0,
               collectives_in_flight: int = 1) -> HardwarePreset:
    """A preset where 1 GFLOP takes 1 ms and every device link moves 1 MB per ms (per direction)."""
    device = DeviceSpec(name="toy", peak_flops_per_s=flops_per_s, memory_bandwidth_bytes_per_s=memory_bandwidth_bytes_per_s,
                        memory_bytes=memory_bytes, kernel_launch_overhead_s=launch_s,
                        efficiency={"other": OpClassEfficiency(flops=1.0, memory=1.0)})
    return HardwarePreset(
        name="toy", device=device, devices_per_node=devices_per_node, intra_node_kind="loopback",
        intra_node=LinkSpec(bandwidth_bytes_per_s=link_bytes_per_s, latency_s=link_latency_s),
        host_link=LinkSpec(bandwidth_bytes_per_s=1e12, latency_s=0.0),
        network=NetworkSpec(name="toy-net", nic=LinkSpec(bandwidth_bytes_per_s=nic_bytes_per_s, latency_s=nic_latency_s),
                            switch_latency_s=0.0),
        collectives_in_flight=collectives_in_flight,
    )


def toy_cluster(*, nodes: int = 1, devices_per_node: int = 2, **preset_kwargs) -> Cluster:
    """A cluster of :func:`toy_preset` nodes."""
    return Cluster.from_preset(toy_preset(devices_per_node=devices_per_node, **preset_kwargs), nodes=nodes)


def overlap_program(*, compute_before_gflop: float = 1, hidden_gflop: float = 2, after_gflop: float = 1,
                    message_bytes: int = 2 * 10**6) -> ProgramBuilder:
    """A -> start(all_to_all) ; B (independent) ; wait ; C."""
    b = ProgramBuilder()
    a = b.compute("A", flops=int(compute_before_gflop * GFLOP))
    s = b.start("a2a", kind="all_to_all", group="sp", message_bytes=message_bytes, deps=[a], key="a2a")
    b.compute("B", flops=int(hidden_gflop * GFLOP))
    b.wait(s)
    b.compute("C", flops=int(after_gflop * GFLOP))
    return b


def symmetric(program_builder: ProgramBuilder, world: int = 2, groups=None, name: str = "toy") -> Workload:
    """A symmetric workload running the builder's program on ``world`` ranks (group ``sp`` = all ranks)."""
    return Workload(name=name, world_size=world, groups=groups or {"sp": [list(range(world))]},
                    ranks={0: program_builder.build()}, symmetric=True)
