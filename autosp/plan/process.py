"""The planner's own process (``python -m autosp.plan.worker``), started ahead of its request.

Note [Planner process started ahead]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A compiled model's planner runs in a fresh Python process (autosp/plan/auto.py says why), and a fresh process
spends its first seconds importing torch, its compiler and transformers: 6.6 CPU-s on a 2-core machine, about as
long as predicting one strategy candidate then takes, and none of it depends on what is asked.  So a
`PlannerProcess` is started before its request is known: ``python -m autosp.plan.worker - OUT`` makes those imports
(`COMPILE_IMPORTS` and the planner's own modules), prints ``ready`` and waits for the request, one line of JSON, on
its standard input (a line, not the stream to its end: a DataLoader worker the job forks meanwhile holds a copy of
the pipe, whose end then never comes); `PlannerProcess.answer` sends it and waits for the decision, which the process writes to OUT before it
ends without the interpreter's teardown (1.8 s once torch is loaded).  With ``--warm-up`` it first predicts a tiny
Llama (`autosp.plan.worker.warm_up`), which pays a fresh process's first-use costs of Dynamo and AOTAutograd
(about 3 s of an 8B candidate's prediction) before the request; `start_planner` asks for it, since a script
that starts its process before loading its model leaves it time, and the automatic start below does not, since
the first batch may follow the compile at once.

Measured on a 2-core machine, idle (Llama-3.1-8B, SP 8, 65,536 tokens, h100-sxm, one candidate per process as
on 8 ranks): the wait from the request to the answer was 12.0 s for Ulysses in a process ready after its imports
(7.8 s), 8.3 s after a warm-up (ready at 13.1 s), 6.2 s once the teardown was no longer waited for; the ring 8.0
s, the hybrid 2 x 4 11.1 s before the teardown change; every candidate's step time and peak the same floats.

- ``autosp.compile(..., memory_plan="auto")`` starts one on every rank when it compiles (each predicts its share
  of the candidates: Note [Candidates spread over the ranks] in autosp/plan/auto.py): the plan waits for the
  first batch, and the imports run meanwhile (while the script builds its optimizer, its engine, its data).
- ``strategy="auto"`` decides inside ``autosp.compile``, so there is nothing to overlap unless the script starts
  the process itself, before it loads its model: ``planner = autosp.start_planner()``, then
  ``autosp.compile(model, ..., strategy="auto", planner=planner)`` (every rank; `autosp.compile` closes a
  rank's process unasked when the rank has no candidate to predict).
- A process answers one request.  One that is never asked exits when `close` is called (the compiled model does
  it when it is collected), or when its standard input closes, at the latest when the job's process ends.

Without a process started ahead, `autosp.plan.auto.run_planner` starts one at the request.

A process that gives no answer within the config's ``plan_timeout_s`` is aborted (SIGABRT; it runs with ``-X
faulthandler``, so it first prints every thread's Python stack) and the error holds its output: the other ranks wait
in a collective meanwhile, and a planner stuck past the process group's timeout would otherwise end the job with a
collective timeout on those ranks and no word of where the planner stood.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autosp.errors import AutoSPError

log = logging.getLogger(__name__)

COMPILE_IMPORTS = ("torch", "torch.distributed", "torch._dynamo", "transformers", "torch._inductor.pattern_matcher",
                   "torch._dynamo.repro.after_dynamo", "torch._inductor.debug", "torch._inductor.compile_fx",
                   "torch.export._trace", "torch.distributed.tensor.experimental._func_map")
"""What a fresh process's first ``torch.compile`` of a Hugging Face model imports (found with ``python -X
importtime``): AOTAutograd's min-cut partitioner imports the compiler's pattern matcher (about 1 s of CPU), Dynamo
its debugging helpers.  The planner process imports them ahead (Note [Planner process started ahead]), and so does
the rank server of the project's launcher (experiments/launch.py)."""


_ABORT_GRACE_S = 10.0
"""Seconds an aborted planner process has to print its stacks before it is killed."""
_SHOWN_CHARS = 8000
"""How much of a failed planner process's output its error shows: the end, or for an aborted one the head of its
stacks (`_with_stacks`)."""


def import_ahead(names) -> None:
    """Import ``names`` now, to take their import time off a later compile; one that fails is skipped (the compile
    imports what it needs itself)."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a hint only
            log.debug("%s not imported ahead: %s", name, err)


class PlannerProcess:
    """One planner process, started now and asked later (Note [Planner process started ahead]).  ``warm_up``: after
    its imports the process also predicts a tiny model (`autosp.plan.worker.warm_up`) before it says ready, for a
    process whose request is seconds away."""

    def __init__(self, warm_up: bool = False):
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the autosp and simulator packages
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
               "CUDA_VISIBLE_DEVICES": ""}  # the planner traces on fake tensors only
        self._folder = tempfile.TemporaryDirectory(prefix="autosp-plan-")
        self._out = Path(self._folder.name, "plan.json")
        self._log = Path(self._folder.name, "planner.log").open("w+")
        self.started = time.perf_counter()
        self.ready_seconds: float | None = None
        """Seconds from the start to the end of the imports (set by `wait_ready`)."""
        # -X faulthandler: the process prints every thread's Python stack when `answer` aborts it at its timeout
        command = [sys.executable, "-X", "faulthandler", "-m", "autosp.plan.worker", "-", str(self._out),
                   *(["--warm-up"] if warm_up else [])]
        self._process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._log, text=True)
        self.pid = self._process.pid

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Wait until the process has made its imports; the seconds since it started.  After ``timeout_s`` seconds
        (None: as long as it takes) an `AutoSPError` with its output so far; the process goes on (close it)."""
        if self.ready_seconds is None:
            stdout = None if self._process is None else self._process.stdout
            if stdout is not None and timeout_s is not None and not select.select([stdout], [], [], timeout_s)[0]:
                raise AutoSPError(f"the planner process was not ready within {timeout_s:g} s; its output so far:\n"
                                  f"{self._output()[-_SHOWN_CHARS:]}")
            if stdout is None or stdout.readline().strip() != "ready":
                raise AutoSPError(f"the planner process did not start:\n{self._output()}")
            self.ready_seconds = time.perf_counter() - self.started
        return self.ready_seconds

    def answer(self, request: dict, timeout_s: float | None = None) -> dict:
        """Send ``request`` (`autosp.plan.auto.plan_request` or `strategy_request`) and wait for the decision:
        {"report": ..., "text": ...}, {"candidates": ...} or {"error": why}.  The process ends with it.  After
        ``timeout_s`` seconds without an answer the process is aborted and the error holds its output, ending with
        every thread's Python stack (where it was stuck); None: wait as long as it takes."""
        if self._process is None:
            raise AutoSPError("this planner process was closed or has answered already: start another with "
                              "autosp.start_planner()")
        process, self._process = self._process, None
        try:
            try:
                process.communicate(json.dumps(request) + "\n", timeout=timeout_s)  # one line: the request
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGABRT)  # the faulthandler prints the stacks, then the process ends
                try:
                    process.communicate(timeout=_ABORT_GRACE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.communicate()
                raise AutoSPError(f"the planner process gave no answer within {timeout_s:g} s (plan_timeout_s) and "
                                  "was stopped; if its output shows it still at work, raise plan_timeout_s and the "
                                  "process group's timeout (init_process_group(timeout=...)) with it; its output "
                                  f"and stacks:\n{_with_stacks(self._output())}") from None
            output = self._output()
            log.debug("planner output:\n%s", output)
            if process.returncode != 0 or not self._out.is_file():
                raise AutoSPError(f"the planner process failed (exit {process.returncode}):\n"
                                  f"{output[-_SHOWN_CHARS:]}")
            return json.loads(self._out.read_text())
        finally:
            self._cleanup()

    def close(self) -> None:
        """End the process unasked (nothing happens if it has answered)."""
        if self._process is not None:
            process, self._process = self._process, None
            process.kill()
            process.communicate()
            self._cleanup()

    def _output(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def _cleanup(self) -> None:
        self._log.close()
        self._folder.cleanup()

    def __enter__(self) -> PlannerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _with_stacks(output: str) -> str:
    """An aborted process's output, shortened to its last log lines and the head of the stacks the faulthandler
    printed (innermost frame first), where the process was; an import chain alone can be longer than the limit."""
    fatal = output.rfind("Fatal Python error")
    if fatal < 0:
        return output[-_SHOWN_CHARS:]
    before = output[max(0, fatal - _SHOWN_CHARS // 4):fatal]
    return before + output[fatal:fatal + _SHOWN_CHARS - len(before)]


def start_planner() -> PlannerProcess:
    """Start a planner process now, for ``autosp.compile(..., strategy="auto", planner=...)`` later: its imports
    and its warm-up then overlap the script's own work (Note [Planner process started ahead])."""
    return PlannerProcess(warm_up=True)
