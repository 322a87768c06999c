"""The memory ledger equals the bytes real DeepSpeed engines hold, ZeRO 0-3, fp32 and bf16, on 2 gloo ranks (CPU).

Each case builds a small MLP (uneven sizes, so flat-buffer alignment and per-parameter partition padding show;
two biases under the ZeRO-3 persistence threshold), hands it with a torch Adam to ``deepspeed.initialize`` and
measures what the process holds: the storages of every live tensor (found through the garbage collector,
deduplicated by storage), minus what was live before the model was built. Measured right after initialisation,
after the first step, and at the end of the second backward (before its step), on both ranks; the ledger prices
the worst rank. The ledger (``device=False``: no CUDA context or NCCL on CPU; at the end of backward without the
buffers that live only inside it) must agree within 2 %; the paths differ from each other by more, so a wrong
path fails (``test_ledger_measured_cases_really_differ``).
bf16 works with DeepSpeed's CPU accelerator, so bf16 is tested as it is.

Optimizer offload (``offload_optimizer.device = "cpu"``, ZeRO 1-3, Note [Optimizer offload] in simulator/ledger.py)
runs with torch's Adam (``zero_force_ds_cpu_optimizer: false``): DeepSpeed's CPU Adam is a C++ op built on first
use (``DeepSpeedCPUAdam``, JIT through ninja and g++), and its build had not finished after 7 minutes on the
2-core test machine; it keeps the same fp32 ``exp_avg``/``exp_avg_sq`` (ops/adam/cpu_adam.py ``step``) and its
step count as a Python int instead of torch's 4-byte tensor.
On a CPU both pools are one process, so the test splits the measurement by which buffers DeepSpeed places on
its offload device (``self.device = 'cpu'``): those bytes must equal the ledger's ``pool="host"`` lines, and the
rest its device lines.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import time
import weakref

import pytest

from simulator.ledger import TrainingConfig, memory_ledger, summarize
from tests.harness import run_on_ranks
from tests.harness.deepspeed_memory import deepspeed_host_bytes

pytestmark = pytest.mark.slow  # about 90 s on 2 cores: three spawns of two ranks, nine engines

SIZES = ((96, 201), (201, 301), (301, 51))
NUMELS = (96 * 201, 201, 201 * 301, 301, 301 * 51)  # module order: weight, bias, weight, bias, weight
BUCKET = 10_000  # reduce_bucket_size: small, so that ZeRO 3's bucket does not dwarf the rest
PERSIST = 1_000  # stage3_param_persistence_threshold: the biases stay gathered
CASES = (  # (ZeRO stage, precision, grad_accum_dtype[, "offload"])
    (0, "fp32", None), (0, "bf16", None), (1, "fp32", None), (1, "bf16", None), (1, "bf16", "fp32"),
    (2, "fp32", None), (2, "bf16", None), (2, "bf16", "fp32"), (3, "fp32", None), (3, "bf16", None),
    (1, "bf16", None, "offload"), (2, "fp32", None, "offload"), (3, "bf16", None, "offload"),
)


def _live_bytes() -> int:
    import torch
    import torch.distributed as dist

    # ZeRO 3 finishes some of its work asynchronously (seen as an extra gathered partition right after
    # initialize, on a loaded machine only): measure when both ranks have reached this point.
    if dist.is_initialized():
        dist.barrier()
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values())


def _settled_bytes(readings: int = 4, pause_s: float = 0.25) -> int:
    """Live bytes after ZeRO 3's asynchronous work following initialize has finished: the smallest of a fixed
    number of readings (the same count on every rank, each behind a barrier) ``pause_s`` apart.  A reading
    right after initialize sometimes still holds one gathered partition (seen in one fresh-clone run of the
    suite: +61,409 bytes at ZeRO 3 fp32, though the barrier below was in place); the smallest reading is the
    steady state the ledger describes, if that partition is released within the readings."""
    values = []
    for _ in range(readings):
        values.append(_live_bytes())
        time.sleep(pause_s)
    return min(values)


def _micro_step(engine, dtype, *, step: bool) -> None:
    import torch

    loss = engine(torch.randn(2, SIZES[0][0], dtype=dtype)).float().pow(2).mean()
    engine.backward(loss)
    del loss
    if step:
        engine.step()


def _measure(rank: int, world: int, cases: tuple) -> list[dict]:
    import deepspeed
    import torch

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    os.environ["LOCAL_RANK"] = str(rank)
    out = []
    for case in cases:
        stage, precision, accum = case[:3]
        offload = case[3:] == ("offload",)
        torch.manual_seed(0)
        base = _live_bytes()
        layers = [torch.nn.Linear(a, b, bias=i < len(SIZES) - 1) for i, (a, b) in enumerate(SIZES)]
        model = torch.nn.Sequential(layers[0], torch.nn.GELU(), layers[1], torch.nn.GELU(), layers[2])
        assert tuple(p.numel() for p in model.parameters()) == NUMELS
        config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                                        "stage3_param_persistence_threshold": PERSIST}}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        if accum:
            config["data_types"] = {"grad_accum_dtype": accum}
        if offload:
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
            config["zero_force_ds_cpu_optimizer"] = False
        engine = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=config)[0]
        del model, layers
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        record = {"case": case, "wrapper": type(engine.optimizer).__name__,
                  "initialize": _settled_bytes() - base, "host_initialize": deepspeed_host_bytes(engine)}
        _micro_step(engine, dtype, step=True)
        record["step"], record["host_step"] = _live_bytes() - base, deepspeed_host_bytes(engine)
        _micro_step(engine, dtype, step=False)
        record["backward"], record["host_backward"] = _live_bytes() - base, deepspeed_host_bytes(engine)
        out.append(record)
        engine.step()  # a backward left without its step keeps the engine referenced
        if case == cases[-1]:
            break
        alive = weakref.ref(engine)
        engine.destroy()
        del engine
        gc.collect()
        assert alive() is None or stage == 3, (f"the engine of {record['case']} is still alive (referrers "
                                 f"{[type(r).__name__ for r in gc.get_referrers(alive())]}): the next case's "
                                 "measurement would include it")
    return out


@pytest.fixture(scope="module")
def measured() -> dict:
    # ZeRO 3 engines stay referenced by hooks after destroy(): the fp32 case runs alone; the bf16 one is followed
    # by the offload case in its process, whose measurements start from the bytes live after the first engine
    # (what the leftover engine holds cancels out; the exact host-pool comparison shows nothing of it leaks in).
    batches = [tuple(c for c in CASES if c[0] < 3), ((3, "fp32", None),),
               ((3, "bf16", None), (3, "bf16", None, "offload"))]
    assert sorted(map(str, (c for batch in batches for c in batch))) == sorted(map(str, CASES))
    out: dict = {}
    for batch in batches:
        for rank_records in zip(*run_on_ranks(_measure, 2, batch, timeout_s=600.0), strict=True):
            # the ledger prices the worst rank (ZeRO 1/2 gradients depend on which parameters a partition cuts)
            out[rank_records[0]["case"]] = {**rank_records[0], **{at: max(r[at] for r in rank_records)
                                                                  for at in ("initialize", "step", "backward")},
                                            **{f"host_{at}": max(r[f"host_{at}"] for r in rank_records)
                                               for at in ("initialize", "step", "backward")},
                                            "per_rank": [r["backward"] for r in rank_records]}
    return out


def _config(stage: int, precision: str, accum: str | None, offload: str | None = None) -> TrainingConfig:
    return TrainingConfig(parameter_numels=NUMELS, optimizer="adam", precision=precision, grad_accum_dtype=accum,
                          zero_stage=stage, dp_world_size=2, reduce_bucket_size=BUCKET,
                          param_persistence_threshold=PERSIST, offload_optimizer=offload == "offload")


def _case_id(c) -> str:
    return f"zero{c[0]}-{c[1]}{'-acc' + c[2] if c[2] else ''}{'-offload' if c[3:] else ''}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_ledger_equals_deepspeed_engine_bytes(measured, case):
    record, cfg = measured[case], _config(*case)
    assert record["wrapper"] == (cfg.wrapper if cfg.wrapper != "torch" else "Adam")
    log = logging.getLogger(__name__)
    for at in ("initialize", "step", "backward"):
        lines = [ln for ln in memory_ledger(cfg, at=at, device=False) if ln.when != "in_backward"]
        host = summarize(lines, "host").nominal
        assert host == record[f"host_{at}"], (case, at, host, record[f"host_{at}"])  # the offloaded buffers, exact
        assert (host > 0) == cfg.offload_optimizer
        predicted = summarize(lines, "all").nominal
        # at the end of backward ZeRO 1/2's ipg buckets may or may not be released yet (seen both ways)
        upper = predicted + sum(ln.bytes for ln in memory_ledger(cfg, at=at, device=False)
                                if ln.when == "in_backward" and ln.name.startswith("ipg"))
        got = record[at]
        log.info("%s %s: ledger %d (with ipg buckets %d; host %d), engine %d (%+.3f %%), per rank %s", case, at,
                 predicted, upper, host, got, 100 * (predicted - got) / got,
                 record["per_rank"] if at == "backward" else "")
        assert predicted * 0.98 <= got <= upper * 1.02, (case, at, predicted, upper, got)


def _predicted(case, at: str) -> int:
    lines = memory_ledger(_config(*case), at=at, device=False)
    return summarize([ln for ln in lines if ln.when != "in_backward"], "all").nominal


def test_ledger_measured_cases_really_differ(measured):
    """The 2 % tolerance can fail: two paths the ledger tells apart (by more than 2 % at one of the three instants)
    also measure more than 2 % apart.  Paths DeepSpeed lays out alike (ZeRO 1 and ZeRO 2 at one precision; ZeRO 1
    bf16 and ZeRO 2 bf16 with fp32 accumulation, whose compact fp32 partition is the size of ZeRO 1's) are the
    ledger's to match, not this test's."""
    instants = ("initialize", "step", "backward")
    for a, b in itertools.combinations(CASES, 2):
        if max(abs(_predicted(a, at) - _predicted(b, at)) / _predicted(a, at) for at in instants) <= 0.02:
            continue
        gap = max(abs(measured[a][at] - measured[b][at]) / measured[a][at] for at in instants)
        assert gap > 0.02, (a, b, gap)
