"""The one multi-rank launcher: run a function on N real gloo ranks, each in its own process (or on N NCCL
ranks, one GPU each: ``backend="nccl"``).

Used by the CPU measurements (``experiments.reproduce``, the calibration and
validation, the SAC/overlap bench, the notebooks) and by the test suite
(``tests.harness`` re-exports it), so every system and every test sees the same
clean process state: a fresh process per rank, one intra-op thread, a free
local port.

The function must be importable by name (defined at module level) because ranks
are started with the ``forkserver`` method: a server process started on the first
launch imports torch, its compiler, transformers' model modules and autosp once (`PRELOAD`), and
every rank is a fork of it, so a launch does not pay those imports again (about
4 s of CPU per rank on a 2-core machine).  Nothing runs in the server before the
fork (no thread pool, no process group), so each rank starts as clean as a spawned
one; the parent's environment at the time of the launch is passed to the rank.  It is called as ``fn(rank, world_size,
*args)`` after ``torch.distributed`` has been initialised with gloo, and its
return value must be picklable.  The parent collects results over a queue and
enforces an overall deadline (``timeout_s``): if any rank raises, the others are
killed and `RankFailure` names the rank and carries its traceback; a rank that
exits without a result or a run that passes its deadline fails the same way, so
a broken rank can never hang a measurement or the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_POLL_S = 0.05
_GRACE_S = 3.0
PRELOAD = ("autosp", *(f"transformers.models.{family}.modeling_{family}"
                       for family in ("llama", "qwen2", "qwen3", "mistral", "mixtral", "gpt2")))
"""Modules the forkserver imports before it forks any rank: autosp and every model family's modeling module, then
what a fresh process's first compile imports (`autosp.plan.process.COMPILE_IMPORTS`: torch, its compiler and
transformers; a 2-layer Hugging Face Llama's first compile on a 2-core machine, 7.7 CPU-s without the compiler's
modules, 5.3 with; about 4 in a warm process).  A hint: one that fails to import is skipped.  Imports only: they
start no thread and leave no tensor behind."""


class RankFailure(RuntimeError):
    """One or more ranks raised, died or hung; the message holds each rank's story."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, args, results, collective_timeout_s, env, backend="gloo"):
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":  # one GPU per rank, chosen before NCCL's communicator binds to one
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        try:
            value = fn(rank, world_size, *args)
            dist.barrier()  # all ranks done communicating before any tears the group down
        finally:
            dist.destroy_process_group()
        # Plain pickle: torch's queue reducers would pass tensors by shared-memory handles,
        # which die with this process.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    collective_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``backend="nccl"``: NCCL ranks instead, rank r on GPU ``r % torch.cuda.device_count()`` (set before the
    group is made), started with the ``spawn`` method: a fresh interpreter per rank, no forkserver, so that no
    process forks after CUDA might have been touched (`experiments.gpu_validate`).

    ``timeout_s`` bounds the whole run; ``collective_timeout_s`` is the process
    group's timeout (how long one collective may wait for a slower rank, e.g. one
    still compiling).  Raises `RankFailure` when a rank raises (with its
    traceback), exits without reporting, or when the whole run exceeds
    ``timeout_s`` seconds.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: choose gloo or nccl")
    ctx = mp.get_context("forkserver" if backend == "gloo" else "spawn")
    if backend == "gloo":
        from autosp.plan.process import COMPILE_IMPORTS

        # read when the server starts (the first launch of this process)
        ctx.set_forkserver_preload(list(dict.fromkeys((*PRELOAD, *COMPILE_IMPORTS))))
    results = ctx.Queue()
    port = _free_port()
    # A forked rank inherits the server's environment, not this process's: pass this one's along.
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, args, results, collective_timeout_s, child_env, backend),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()

    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) + len(errors) < world_size:
            try:
                rank, status, payload = results.get(timeout=_POLL_S)
                (values if status == "ok" else errors)[rank] = payload
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r not in values and r not in errors and not p.is_alive() and p.exitcode != 0:
                    errors[r] = f"process exited with code {p.exitcode} without a result"
            if errors:
                # One rank failed: the others are probably stuck in a collective.  Keep
                # listening briefly so that every rank's own story is reported.
                deadline = min(deadline, now + _GRACE_S)
            if now > deadline:
                reason = f"no result after {timeout_s:.0f} s (hung?)" if not errors else "stopped after another rank failed"
                for r in range(world_size):
                    if r not in values and r not in errors:
                        errors[r] = reason
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()

    if errors:
        stories = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed running {fn.__name__}:\n{stories}")
    return [pickle.loads(values[r]) for r in range(world_size)]
