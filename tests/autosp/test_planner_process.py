"""The planner process started ahead of its request (Note [Planner process started ahead] in
autosp/plan/process.py): it makes its imports first, answers one request, and ends unasked when closed; one with no
answer within its timeout is stopped and its error shows where it stood; a process forked after it (a DataLoader
worker) does not keep it from its request; a compile that plans nothing refuses one.  The decisions it takes equal those of a process started at the request
(tests/autosp/test_strategy_auto.py, tests/autosp/test_memory_plan.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import autosp
from autosp.errors import AutoSPError
from autosp.plan import start_planner
from autosp.plan.auto import run_planner
from autosp.plan.process import PlannerProcess

REFUSED = {"decide": "strategy", "model": "tiny", "model_config": {"model_type": "llama"},
           "setup": {"seq_len": 64, "sp_size": 2}, "cluster": "no-such-cluster", "target_memory": None, "options": {}}
"""A request the process refuses at once (an unknown cluster): its answer is the refusal."""


def _ended(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_planner_started_ahead_imports_first_then_answers_one_request():
    planner = start_planner()
    with pytest.raises(AutoSPError, match=r"not ready within 0.01 s"):  # still importing torch
        planner.wait_ready(timeout_s=0.01)
    assert planner.ready_seconds is None
    assert planner.wait_ready(timeout_s=300) > 0 and planner.wait_ready() == planner.ready_seconds  # imports made, once
    answer = run_planner(REFUSED, planner)  # the process's own refusal comes back as the answer
    assert "no-such-cluster" in answer["error"] and answer["error"].startswith("strategy='auto': ")
    assert _ended(planner.pid)
    with pytest.raises(AutoSPError, match="answered already"):
        planner.answer(REFUSED)


def test_planner_closed_unasked_ends_and_a_failed_process_names_its_output():
    planner = start_planner()
    planner.close()
    assert _ended(planner.pid)
    with pytest.raises(AutoSPError, match="closed or has answered"):
        planner.answer({"decide": "memory"})
    with pytest.raises(AutoSPError, match=r"memory_plan='auto': the planner process failed \(exit 1\)"):
        run_planner({"decide": "memory"})  # no model config: the process raises KeyError


def test_compile_that_plans_nothing_or_cannot_plan_closes_its_planner():
    planner = PlannerProcess()
    model = torch.nn.Linear(4, 4)
    with pytest.raises(AutoSPError, match="plans nothing"):
        autosp.compile(model, sp_size=1, planner=planner)
    assert _ended(planner.pid)
    planner = PlannerProcess()  # refused before any planning (no Hugging Face config): closed on the way out
    with pytest.raises(AutoSPError, match="strategy='auto' plans for a Hugging Face model"):
        autosp.compile(model, sp_size=2, strategy="auto", plan_seq_len=64, planner=planner)
    assert _ended(planner.pid)


def test_planner_without_an_answer_in_its_timeout_is_stopped_with_its_stacks():
    planner = PlannerProcess()  # asked at once: still importing torch (seconds) when the timeout comes
    with pytest.raises(AutoSPError, match=r"gave no answer within 0.5 s \(plan_timeout_s\)") as raised:
        run_planner(REFUSED, planner, timeout_s=0.5)
    message = str(raised.value)
    assert message.startswith("strategy='auto': ") and "Fatal Python error: Aborted" in message, message
    assert 'File "' in message and "most recent call first" in message, message  # the Python stack it stood in
    assert _ended(planner.pid)


def test_an_aborted_planners_error_keeps_the_head_of_its_stacks_however_long_they_are():
    from autosp.plan.process import _SHOWN_CHARS, _with_stacks

    log = "".join(f"INFO planner line {i}\n" for i in range(2000))
    stacks = "Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n  File \"inner.py\", line 7\n"
    frames = "".join(f'  File "<frozen importlib._bootstrap>", line {i} in _find_and_load\n' for i in range(2000))
    shown = _with_stacks(log + stacks + frames)
    assert len(shown) <= _SHOWN_CHARS and stacks in shown and "INFO planner line 1999\n" in shown
    assert _with_stacks(log) == log[-_SHOWN_CHARS:]  # no stacks: the end of the output


def test_planner_answers_while_a_process_forked_after_it_holds_its_pipe():
    planner = PlannerProcess()
    worker = os.fork()  # as a DataLoader worker forked after the compile: a copy of every pipe's ends
    if worker == 0:
        time.sleep(120)
        os._exit(0)
    try:  # the request is a line, so the forked copy of its pipe's writing end does not hold it back
        answer = run_planner(REFUSED, planner, timeout_s=90)
    finally:
        os.kill(worker, signal.SIGKILL)
        os.waitpid(worker, 0)
    assert "no-such-cluster" in answer["error"]
    assert _ended(planner.pid)
