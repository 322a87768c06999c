"""What a DeepSpeed engine holds off the device, read from its optimizer, for the tests that check the
planner's ledger against real engines (tests/simulator/test_ledger_deepspeed.py, tests/autosp/test_deepspeed.py)."""

from __future__ import annotations


def deepspeed_host_bytes(engine) -> int:
    """Bytes of the buffers DeepSpeed allocates on its offload device (Note [Optimizer offload] in simulator/ledger.py): measured as
    host memory."""
    import torch

    opt = engine.optimizer
    if not getattr(opt, "cpu_offload", False) and not getattr(opt, "offload_optimizer", False):
        return 0
    if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO 1/2
        tensors = [*opt.single_partition_of_fp32_groups, *(t.grad for t in opt.single_partition_of_fp32_groups),
                   *opt.param_buffer_of_bit16_for_cpu_offload_groups, opt.temp_grad_buffer_for_cpu_offload,
                   *opt.accumulated_grads_in_cpu.values()]
    else:  # ZeRO 3
        tensors = [*opt.fp32_partitioned_groups_flat, *(t.grad for t in opt.fp32_partitioned_groups_flat),
                   opt.grad_partitions_flat_buffer]
    tensors += [v for state in opt.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    storages: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values())
