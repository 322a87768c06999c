"""Test harness: run code on real multi-rank process groups on CPU.

`run_on_ranks` (the project's one launcher, `experiments.launch`) spawns N
processes joined by a real gloo process group and gathers each rank's return
value (a rank's exception fails the test with its rank and traceback; a rank that
dies or hangs fails it within a bounded time).  `fake_process_group` gives a
single-process fake group of any world size for tracing and graph tests, where
collective values are meaningless.
"""

from experiments.launch import RankFailure, run_on_ranks
from tests.harness.fake_group import fake_process_group

__all__ = ["RankFailure", "fake_process_group", "run_on_ranks"]
