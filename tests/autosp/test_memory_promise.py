"""Note [The plan's promise checked] (autosp/model.py): a memory_plan="auto" model measures its first steps with a
memory meter and stops, naming the plan and the measurement, when they pass ``target_memory``.

The model core is built as `autosp.compile` builds it under ``memory_plan="auto"``, with a first-batch plan that
answers at once (the planner's own decision is tested in tests/autosp/test_memory_plan.py) and a meter whose
readings the test sets: a CPU has no allocator peak to read.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autosp
from autosp.config import AutoSPConfig
from autosp.errors import AutoSPError
from autosp.groups import build_groups
from autosp.model import PROMISE_CHECKED_CALLS, SequenceParallelModel
from experiments.models import build_model, vocab_size
from tests.autosp.cases import make_sample
from tests.harness.fake_group import fake_process_group

TARGET = 64 * 2**20


class _AnsweredPlan:
    """A `autosp.model.FirstBatchPlan` whose decision is given (SAC, predicted at half the target)."""

    closed = 0

    def decide(self, module, config, *, seq_len, micro_batch, device):
        return {"options": {"checkpointing": "sac"}, "target_memory_bytes": TARGET, "chosen": 0,
                "candidates": [{"plan": "sac", "peak_bytes": TARGET // 2}], "setup": {"seq_len": seq_len}}

    def close(self):
        type(self).closed += 1


@dataclasses.dataclass
class _Meter:
    readings: list[int]
    resets: int = 0

    def reset(self):
        self.resets += 1

    def peak_bytes(self):
        return self.readings.pop(0)


def _planned(meter):
    config = AutoSPConfig.from_options(sp_size=1, compiler="aot_eager",
                                       options={"memory_plan": "auto", "target_memory": TARGET})
    return SequenceParallelModel(build_model("hf-llama", layers=1), config, build_groups(1, None),
                                 first_batch_plan=_AnsweredPlan(), memory_meter=meter)


def _step(model, seed):
    ids, labels = make_sample(32, vocab_size(model.module), seed=seed)
    model(**autosp.prepare_inputs(ids, labels=labels)).loss.backward()


def test_a_peak_past_the_target_stops_the_job_naming_the_plan_and_the_measurement():
    torch._dynamo.reset()
    meter = _Meter(readings=[TARGET // 2, TARGET + 2**20])
    with fake_process_group(1):
        model = _planned(meter)
        _step(model, 0)  # the planned first call: the meter starts its peak just before its program runs
        assert meter.resets == 1
        _step(model, 1)  # within the target: goes on
        with pytest.raises(AutoSPError, match=r"chose 'sac', predicted at 0\.03 GiB .* measured 0\.06 GiB.*lower "
                                              r"target_memory"):
            _step(model, 2)


def test_a_plan_within_its_target_is_read_on_the_first_calls_only():
    torch._dynamo.reset()
    meter = _Meter(readings=[TARGET] * PROMISE_CHECKED_CALLS)  # exactly the target fits
    with fake_process_group(1):
        model = _planned(meter)
        for seed in range(PROMISE_CHECKED_CALLS + 3):
            _step(model, seed)
    assert meter.readings == [] and meter.resets == 1  # read on the calls after the first, then no more


def test_no_meter_on_a_cpu_checks_nothing():
    torch._dynamo.reset()
    with fake_process_group(1):
        model = _planned(None)
        for seed in range(3):
            _step(model, seed)
    assert model._memory_meter is None and model.config.checkpointing == "sac"


def _two_ranks_one_over(rank, world):
    """Rank 0's meter reads past the target, rank 1's within it: both must stop at the same call."""
    torch._dynamo.reset()
    readings = [TARGET + 2**20] if rank == 0 else [TARGET // 2]
    config = AutoSPConfig.from_options(sp_size=world, compiler="aot_eager",
                                       options={"memory_plan": "auto", "target_memory": TARGET})
    torch.manual_seed(0)
    model = SequenceParallelModel(build_model("hf-llama", layers=1), config, build_groups(world, None),
                                  first_batch_plan=_AnsweredPlan(), memory_meter=_Meter(readings=readings))
    _step(model, 0)
    try:
        _step(model, 1)
    except AutoSPError as err:
        return str(err)
    return None


def test_the_largest_peak_of_the_group_stops_every_rank():
    from experiments.launch import run_on_ranks

    messages = run_on_ranks(_two_ranks_one_over, 2, timeout_s=240)
    assert all(m is not None and "measured 0.06 GiB" in m for m in messages), messages
