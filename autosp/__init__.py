"""AutoSP: automatic DeepSpeed-Ulysses sequence parallelism as a ``torch.compile`` backend.

The single responsibility of this package is to turn an unmodified single-device
causal-LM training step into an exactly equivalent sequence-parallel one: shard
the tokens, wrap every ``scaled_dot_product_attention`` in all-to-alls, make the
loss and gradients those of the full sequence, and export the resulting
collective schedule for the simulator.  Entry points: `compile`,
`prepare_inputs`, `sync_gradients`; with DeepSpeed, `deepspeed_initialize`
(and `sequence_parallel_sampler` for data loading); with the Hugging Face Trainer,
`AutoSPTrainer` (autosp.integrations.hf, imported on first use: it needs accelerate); for
``strategy="auto"``, `start_planner` (autosp.plan.process, imported on first use).
"""

from autosp import ops, tiled_ops  # noqa: F401 - register the autosp_testbed:: custom ops
from autosp.api import SequenceParallelModel, compile, sync_gradients
from autosp.config import AutoSPConfig
from autosp.errors import AutoSPError
from autosp.inputs import prepare_inputs
from autosp.integrations.deepspeed_engine import SequenceParallelMPU, deepspeed_initialize
from autosp.sampler import sequence_parallel_sampler

__all__ = [
    "AutoSPConfig",
    "AutoSPTrainer",
    "AutoSPError",
    "SequenceParallelMPU",
    "SequenceParallelModel",
    "compile",
    "deepspeed_initialize",
    "prepare_inputs",
    "sequence_parallel_sampler",
    "start_planner",
    "sync_gradients",
]


def __getattr__(name: str):
    # The Trainer integration imports transformers' Trainer and accelerate: only when asked for.
    if name == "AutoSPTrainer":
        from autosp.integrations.hf import AutoSPTrainer

        return AutoSPTrainer
    # The planner's process, started ahead of strategy="auto" (autosp/plan/process.py): the planner package
    # imports the simulator, which a plain compile does not need.
    if name == "start_planner":
        from autosp.plan.process import start_planner

        return start_planner
    raise AttributeError(f"module 'autosp' has no attribute {name!r}")
