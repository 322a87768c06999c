"""Start N local gloo ranks for a measurement and collect what each rank returns.

Experiments run their CPU measurements in fresh processes (one thread each, a
free local port) so that every system sees the same clean process state.  Each
rank writes its JSON-serialisable result to a file in a temporary folder; the
parent reads them back once all ranks have exited.  A rank that raises makes
the whole measurement fail with that rank's traceback.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    path = pathlib.Path(out_dir) / f"rank{rank}.json"
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(minutes=10))
        try:
            result = fn(rank, world_size, *args)
            dist.barrier()  # all ranks done communicating before any tears the group down
        finally:
            dist.destroy_process_group()
        path.write_text(json.dumps({"ok": result}))
    except BaseException:
        path.write_text(json.dumps({"error": traceback.format_exc()}))
        raise


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; the per-rank results in rank order."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.spawn(_rank_entry, args=(fn, world_size, _free_port(), out_dir, args), nprocs=world_size, join=True)
        except mp.ProcessRaisedException as err:
            stories = [
                f"rank {p.stem[4:]}:\n{json.loads(p.read_text())['error']}"
                for p in sorted(pathlib.Path(out_dir).glob("rank*.json"))
                if "error" in json.loads(p.read_text())
            ]
            raise RuntimeError("measurement failed:\n" + "\n".join(stories or [str(err)])) from None
        return [json.loads((pathlib.Path(out_dir) / f"rank{r}.json").read_text())["ok"] for r in range(world_size)]
