"""Warm the rank server's compiler once, so that every rank forked from it starts warm (opt-in:
`experiments.launch.WARMUP_ENV`).

`experiments.launch` forks every rank from one server process per launching process.  A rank's first
``torch.compile`` pays one-off work that has nothing to do with its model: imports torch defers until a compile
needs them, Dynamo's tables of what to trace and what to inline, the source-file scans it uses to name
functions, AOTAutograd's decomposition tables.  On a 2-core machine that is about 2-3 CPU-s per rank per launch
(tiny Hugging Face Llama, Qwen2 and GPT-2 models compiled on 2 ranks: 6.2-7.1 CPU-s a rank cold, 3.2-4.9 warm).  When this module is preloaded,
the server compiles and runs one forward and backward of a tiny Hugging Face Llama, then resets Dynamo (its code
caches, guards and counters), so the forks inherit only the warm tables.

It changes no result: the server's random state is restored, the compile runs on one intra-op thread (no OpenMP
pool exists before a fork), no process group is created, and Dynamo's counters are cleared so that a rank's graph-
break and recompile tallies count only its own compiles.  It does change how long a rank's first compile takes,
which is why it is opt-in: the test suite turns it on (``tests/conftest.py``); the measured tables of
``python -m experiments.reproduce`` keep it off, so their first-step times are a fresh process's.

The forkserver runs this by importing it (`experiments.launch.preload_modules`), so the work happens at import;
nothing else imports this module.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def warm_up_compiler() -> None:
    """Compile, run and differentiate a tiny Hugging Face Llama through Dynamo, AOTAutograd and the min-cut
    partitioner (the path every AutoSP compile takes), then forget the compiled code."""
    import torch
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from experiments.models import build_model

    def run_as_traced(graph, _example_inputs):
        return make_boxed_func(graph.forward)

    backend = aot_autograd(fw_compiler=run_as_traced, bw_compiler=run_as_traced,
                           partition_fn=min_cut_rematerialization_partition)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            model = build_model("hf-llama")
            ids = torch.randint(0, model.config.vocab_size, (1, 16))
            torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss.backward()
    finally:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.set_num_threads(threads)


def _warm_up_at_import() -> bool:
    """`warm_up_compiler`, True when it succeeded: the forkserver skips a preload module only on ImportError, so
    anything else raised at import would stop the server; a failed warm-up costs time, never a result."""
    try:
        warm_up_compiler()
    except Exception:  # noqa: BLE001
        log.warning("warming the rank server's compiler failed; ranks will compile cold", exc_info=True)
        return False
    return True


WARMED = _warm_up_at_import()
"""Whether the warm-up succeeded in this process (a rank forked from the server reads the server's)."""
