"""Host memory and DeepSpeed's optimizer offload in the simulator: the presets' host figures, device<->host copies
over the host-memory link on their own stream (exact timelines on a toy cluster), and the ledger's device and host
pools against DeepSpeed's source-derived formulas (the real engines are compared in test_ledger_deepspeed.py).

Toy numbers (tests/simulator/toys.py): 1 GFLOP = 1 ms, every link and the host-memory link move 1 MB/ms.
"""

from __future__ import annotations

import dataclasses

import pytest

from simulator import Cluster, ProgramBuilder, TrainingConfig, Workload, simulate, validate_workload
from simulator.device_reserve import reserved_bytes
from simulator.gpu_constants import GPU_CONSTANTS
from simulator.hardware import DATASHEETS, GB, LinkSpec, get_preset
from simulator.ledger import memory_ledger, summarize
from simulator.training_step import GradientReady, add_training_step, host_optimizer_time_s
from tests.simulator.toys import GFLOP, MS, toy_preset

HOST = LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=0.0)
CLUSTER = Cluster.from_preset(dataclasses.replace(toy_preset(), host_memory_link=HOST, host_memory_bytes=2**30))


@pytest.mark.parametrize("name, per_direction, kind, node_bytes", [
    ("a100-80gb-sxm", 32 * GB, "pcie", 2 * 2**40),  # PCIe Gen4 x16; DGX A100 640GB: 2 TB
    ("h100-sxm", 64 * GB, "pcie", 2 * 2**40),  # PCIe Gen5 x16; DGX H100: 2 TB
    ("h200-sxm", 64 * GB, "pcie", 2 * 2**40),
    ("gh200", 450 * GB, "nvlink-c2c", 4 * 480 * 2**30),  # NVLink-C2C 900 GB/s bidirectional
    ("b200", 64 * GB, "pcie", 2 * 2**40),  # PCIe Gen5 x16; DGX B200: 2 TB
    ("mi300x", 64 * GB, "pcie", 2 * 2**40),  # PCIe Gen5 x16; 2 TB per 8-GPU server, an assumption
])
def test_presets_have_host_memory_and_its_link_with_a_source(name, per_direction, kind, node_bytes):
    preset = get_preset(name)
    scope = {"pcie": "pcie_host", "nvlink-c2c": "c2c"}[kind]
    assert preset.host_memory_kind == kind and preset.host_memory_bytes == node_bytes
    link = preset.host_memory_link
    assert link.bandwidth_bytes_per_s == per_direction
    assert link.efficiency == GPU_CONSTANTS[f"{scope}.efficiency"].nominal < 1
    assert DATASHEETS[name].host_source in preset.sources and "memory" in DATASHEETS[name].host_source
    cluster = Cluster.from_preset(preset)
    assert cluster.host_memory_per_rank_bytes == node_bytes // preset.devices_per_node
    assert cluster.describe()["host_memory_link"]["bandwidth_bytes_per_s"] == link.effective_bandwidth_bytes_per_s
    # device-to-device routes never pass through host memory
    assert all(cluster.topology.links[i].kind != "host" for i in cluster.topology.path(0, 1))


def test_cpu_gloo_host_memory_is_the_ram_and_its_link_the_measured_offload_copy():
    """cpu-gloo: device and host memory are the machine's RAM (the device pool is capped by the run: target_memory)
    and the host-memory link is AutoSP's offload copy as experiments.calibrate_cpu measured it; a CPU process's
    ledger has no device reserve (CUDA context, NCCL, workspaces, allocator, host-process allowance)."""
    import json

    from simulator.hardware import CPU_GLOO_JSON

    preset = get_preset("cpu-gloo")
    measured = json.loads(CPU_GLOO_JSON.read_text())["calibration"]["compute"]
    link = preset.host_memory_link
    assert preset.host_memory_kind == "memory" and link.efficiency == 1.0
    assert (link.bandwidth_bytes_per_s, link.latency_s) == (measured["host_copy_bytes_per_s"],
                                                            measured["host_copy_latency_s"])
    assert preset.host_memory_bytes // preset.devices_per_node == preset.device.memory_bytes  # the RAM, split
    cluster = Cluster.from_preset(preset, devices_per_node=2)
    assert cluster.topology.links[cluster.topology.host_path(1, to_host=False)[0]].bandwidth_bytes_per_s == \
        link.bandwidth_bytes_per_s
    config = TrainingConfig(parameter_numels=(1000,), precision="fp32", zero_stage=0, optimizer="sgd")
    tensors = memory_ledger(config, at="backward", device=False, host_activation_bytes=4096)
    assert memory_ledger(dataclasses.replace(config, gpu_process=False), at="backward",
                         host_activation_bytes=4096) == tensors
    assert summarize(tensors).nominal == 8000 and summarize(tensors, "host").nominal == 4096


def _host_copies(cluster, *messages, streams: int = 1):
    """Copies of 1 MB started together, the k-th on stream (group) ``k % streams``, then all waited."""
    b = ProgramBuilder()
    starts = [b.start(f"c{k}", kind=kind, group=f"host{k % streams}", message_bytes=10**6, key=f"c{k}")
              for k, kind in enumerate(messages)]
    for s in starts:
        b.wait(s)
    workload = Workload(name="copies", world_size=2, groups={f"host{k}": [[0], [1]] for k in range(streams)},
                        ranks={0: b.build()}, symmetric=True)
    return simulate(workload, cluster)


def test_host_copies_run_on_their_own_link_and_share_it_by_direction():
    assert _host_copies(CLUSTER, "to_host").step_time_s == pytest.approx(1 * MS)
    # one stream runs its copies one after the other, as a CUDA stream does
    assert _host_copies(CLUSTER, "to_host", "from_host").step_time_s == pytest.approx(2 * MS)
    # on two streams, two copies down share the device's link; one down and one up use its two directions
    assert _host_copies(CLUSTER, "to_host", "to_host", streams=2).step_time_s == pytest.approx(2 * MS)
    assert _host_copies(CLUSTER, "to_host", "from_host", streams=2).step_time_s == pytest.approx(1 * MS)
    latency = Cluster.from_preset(dataclasses.replace(CLUSTER.preset, host_memory_link=dataclasses.replace(
        HOST, latency_s=0.5 * MS, efficiency=0.5)))
    assert _host_copies(latency, "from_host").step_time_s == pytest.approx(2.5 * MS)
    with pytest.raises(ValueError, match="host_memory_link"):
        _host_copies(Cluster.from_preset(toy_preset()), "to_host")


def _cfg(**kw):
    return TrainingConfig(**{"parameter_numels": (250_000,) * 3, "precision": "bf16", "dp_world_size": 2,
                             "offload_optimizer": True, **kw})


def _stepped(cfg):
    b = ProgramBuilder()
    ids = [b.compute(f"B{i}", flops=GFLOP, phase="backward") for i in range(3)]
    workload = Workload(name="bwd", world_size=2, groups={"dp": [0, 1]}, ranks={0: b.build()}, symmetric=True)
    stepped = add_training_step(workload, [GradientReady(op_id=i, numel=250_000) for i in ids], cfg)
    validate_workload(stepped)
    return stepped


def _times(result, name):
    tl = result.timelines[0]
    pos = next(i for i, op in enumerate(tl.compiled.program.ops) if op.name == name)
    return pytest.approx((tl.begin_s[pos] / MS, tl.end_s[pos] / MS))


def test_offload_zero2_gradients_go_down_per_bucket_and_parameters_come_back_before_the_gather():
    cfg = _cfg(zero_stage=2, reduce_bucket_size=250_000)
    stepped = _stepped(cfg)
    result = simulate(stepped, CLUSTER)
    # B0 0-1, reduce-scatter 1-1.25, then its half of the bucket in fp32 (500 kB) goes down 1.25-1.75 on the host
    # stream while B1 runs; the last one 3.75-4.25; the 375,000-element bf16 partition comes up 4.25-5.0, then
    # the all-gather (750 kB) 5.0-5.75. No optimizer kernel on the device: Adam runs on the CPU.
    assert _times(result, "grad_to_host_0") == (1.25, 1.75)
    assert _times(result, "B1") == (1.25, 2.25)
    assert _times(result, "grad_to_host_2") == (3.75, 4.25)
    assert _times(result, "params_from_host") == (4.25, 5.0)
    assert _times(result, "param_all_gather_0") == (5.0, 5.75)
    assert result.step_time_s == pytest.approx(5.75 * MS)
    ops = stepped.program(0).ops
    assert not [op for op in ops if op.name == "optimizer_step"]
    assert sum(op.collective.message_bytes for op in ops if op.kind == "collective_start"
               and op.collective.kind == "to_host") == 4 * 375_000
    assert "comm:host" in {result.timelines[0].compiled.stream_of[i] for i in range(len(ops))}
    meta = stepped.metadata["training_step"]
    assert meta["offload_optimizer"] and meta["host_optimizer_s"] == pytest.approx(host_optimizer_time_s(cfg))
    assert host_optimizer_time_s(cfg) == pytest.approx(375_000 / GPU_CONSTANTS["host_cpu.adam_elements_per_s"].nominal)
    assert host_optimizer_time_s(dataclasses.replace(cfg, offload_optimizer=False)) == 0.0


def test_offload_zero3_sends_the_gradient_partition_in_bf16_and_fp32_and_gathers_nothing_after():
    stepped = _stepped(_cfg(zero_stage=3, reduce_bucket_size=250_000))
    ops = stepped.program(0).ops
    down = [op.collective.message_bytes for op in ops if op.kind == "collective_start"
            and op.collective.kind == "to_host"]
    assert down == [(2 + 4) * 125_000] * 3  # stage3.py partition_grads: bf16 buffer, then the fp32 .grad
    up = [op for op in ops if op.collective is not None and op.collective.kind == "from_host"]
    assert [op.collective.message_bytes for op in up] == [2 * 375_000]
    assert not [op for op in ops if op.name.startswith("param_all_gather")]
    assert simulate(stepped, CLUSTER).step_time_s > 3 * MS
    # a workload that reduces its own gradients (the ZeRO-3 rewrite: no GradientReady) sends the partition at the end
    b = ProgramBuilder()
    b.compute("B", flops=GFLOP, phase="backward")
    own = add_training_step(Workload(name="z3", world_size=2, groups={"dp": [0, 1]}, ranks={0: b.build()},
                                     symmetric=True), [], _cfg(zero_stage=3))
    result = simulate(own, CLUSTER)
    assert _times(result, "grad_to_host_0") == (1.0, 1.0 + 6 * 375_000 / 1e6)
    assert result.step_time_s == pytest.approx((1.0 + 6 * 0.375 + 2 * 0.375) * MS)


LLAMA = {"hidden": 64, "ffn_hidden": 160, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 320}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_ledger_moves_master_weights_gradient_partitions_and_adam_to_the_host(stage):
    """Source-derived formulas (Note [Optimizer offload] in simulator/ledger.py), per rank of d = 4: the device
    keeps the bf16 parameters and buckets, the host gets the fp32 master partition, its fp32 gradient, Adam's two
    moments and (ZeRO 1/2) a bf16 copy of the partition and a staging buffer of the largest parameter."""
    d = 4
    on = TrainingConfig.for_llama(**LLAMA, zero_stage=stage, dp_world_size=d, offload_optimizer=True)
    off = dataclasses.replace(on, offload_optimizer=False)
    n, largest = on.parameter_count, max(on.parameter_numels)
    part = sum(-(-e // d) for e in on.parameter_numels) if stage == 3 else -(-n // (2 * d)) * 2
    lines = memory_ledger(on, at="backward", device=False)
    host = summarize(lines, "host")
    adam = 8 * part + 4
    if stage == 3:  # fp32 master, bf16 gradient partitions, fp32 gradient buffer, Adam
        assert host.nominal == 4 * part + 2 * part + 4 * part + adam
    else:  # fp32 master, fp32 gradient partition, bf16 partition buffer, bf16 staging buffer, Adam
        assert host.nominal == 4 * part + 4 * part + 2 * part + 2 * largest + adam
    assert host.by_category["optimizer"][1] == 4 * part + adam
    device_on, device_off = (summarize(memory_ledger(c, at="backward", device=False)) for c in (on, off))
    assert device_on.by_category["optimizer"] == (0, 0, 0) and device_off.by_category["optimizer"][1] == 4 * part + adam
    assert device_on.by_category["parameters"] == device_off.by_category["parameters"]
    assert summarize(lines, "all").nominal == device_on.nominal + host.nominal
    # on a GPU: the allocator's rounding and fragmentation count device tensors only; the host gets its process
    gpu = memory_ledger(on, at="backward")
    assert [ln.name for ln in gpu if ln.pool == "host" and ln.category == "runtime"] == [
        "host process (Python, PyTorch, CUDA libraries)"]
    rounding = next(ln for ln in gpu if ln.name == "caching-allocator rounding").bytes
    per_pool = {pool: sum(reserved_bytes(t) - t for ln in gpu if ln.pool in pool for t in ln.tensor_bytes)
                for pool in (("device",), ("device", "host"))}
    assert rounding == per_pool[("device",)] < per_pool[("device", "host")]


def test_offload_configurations_deepspeed_does_not_have_are_refused():
    with pytest.raises(ValueError, match="ZeRO feature"):
        TrainingConfig(parameter_numels=(10,), zero_stage=0, offload_optimizer=True)
    with pytest.raises(ValueError, match="compact fp32"):
        TrainingConfig(parameter_numels=(10,), zero_stage=2, grad_accum_dtype="fp32", offload_optimizer=True)
    with pytest.raises(ValueError, match="0.19.8"):
        TrainingConfig(parameter_numels=(10,), zero_stage=1, deepspeed="0.16.3", offload_optimizer=True)
