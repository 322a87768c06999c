"""What runs on every rank of a launch (`cases_on_rank`): for each case the reference step on one device, the
compiled step, the timed steps, one peak-memory step, one profiled step and, on rank 0, the exported workload.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
import warnings

from experiments.gpu_validate.case_set import PLAIN, Case
from experiments.gpu_validate.section_exactness import compare_with_reference
from experiments.gpu_validate.section_kernels import profiled_ops
from experiments.gpu_validate.section_prediction import plan_facts


def cases_on_rank(rank: int, world: int, cases: list[dict], device_kind: str) -> list[dict]:
    """Runs on every rank of one launch: `case_on_rank` for each case (as dicts: they cross processes); a case
    that raises is reported with its traceback and the next one runs (every rank raises alike, or the launcher's
    deadline stops a rank left waiting in a collective)."""
    import traceback

    results = []
    for c in cases:
        try:
            results.append(case_on_rank(rank, world, Case(**c), device_kind))
        except Exception:  # noqa: BLE001 - the case fails, with its story
            results.append({"case": c["name"], "rank": rank, "error": traceback.format_exc()})
    return results


def case_on_rank(rank: int, world: int, case: Case, device_kind: str) -> dict:
    """Reference step, compiled step (exactness), timed steps, one peak-memory step, one profiled step, export."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import autosp
    from autosp.export import export_workload
    from experiments.cpu.peak_memory import PeakMemory
    from experiments.models import build_model, vocab_size

    cuda = device_kind == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 exactness: no TF32 on either side
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    torch._dynamo.reset()  # every case compiles afresh
    gc.collect()  # the previous case's models gone before this one's allocator peak
    if cuda:
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    reference = build_model(case.model, **case.sizes).to(device=device, dtype=getattr(torch, case.dtype))
    candidate = copy.deepcopy(reference)
    ids = torch.randint(0, vocab_size(reference), (1, case.seq_len), generator=torch.Generator().manual_seed(1234))
    ids = ids.to(device)
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}
    ref_loss = ref_loss.detach()
    del reference

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="autosp.compile with sp_size=1")
        compiled = autosp.compile(candidate, sp_size=world, compiler=case.compiler, **case.options)
    inputs = autosp.prepare_inputs(ids, labels=ids)
    loss = compiled(**inputs).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in candidate.named_parameters() if p.grad is not None}
    exact = compare_with_reference(loss.detach(), ref_loss, grads, ref_grads, case.tolerance)
    del grads, ref_grads, loss

    def step():
        compiled(**inputs).loss.backward()  # the output dropped after the forward, as the export assumes

    for _ in range(case.warmup):
        candidate.zero_grad(set_to_none=False)
        step()
    step_s = []
    for _ in range(case.steps):
        candidate.zero_grad(set_to_none=False)
        sync()
        dist.barrier()
        start = time.perf_counter()
        step()
        sync()
        step_s.append(time.perf_counter() - start)
    params = list(candidate.parameters())
    candidate.zero_grad(set_to_none=False)
    sync()
    dist.barrier()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync()
        peak = torch.cuda.max_memory_allocated(device)
    else:
        with PeakMemory(static=params + [p.grad for p in params]) as pm:
            step()
        peak = pm.peak_bytes
    candidate.zero_grad(set_to_none=False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        sync()
    ops = profiled_ops(prof, case.quadratic_from)
    result = {"case": case.name, "rank": rank, "exact": exact, "step_s": step_s, "peak_bytes": peak,
              "ops": [dataclasses.asdict(op) for op in ops], "plan": plan_facts(compiled.report.memory_plan),
              "options": {k: getattr(compiled.config, k) for k in (*PLAIN, "activation_offload", "strategy")}}
    if rank == 0:
        workload = export_workload(compiled.report.aot_graphs, name=f"gpu_validate {case.name}", sp_size=world,
                                   parameter_bytes=sum(p.numel() * p.element_size() for p in params),
                                   optimizer_bytes_per_parameter_byte=0.0, saved_freed_at_last_use=True)
        result["workload"] = workload.to_dict()
    dist.barrier()
    return result
