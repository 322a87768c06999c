"""The paper's training configuration, stated once.

Where each choice comes from (read off the installed DeepSpeed package):

* Precision ``bf16`` with ``data_types.grad_accum_dtype`` left unset.  Nothing
  under ``deepspeed/compile`` (DeepCompile, ``init_sp.py``/AutoSP) sets
  ``grad_accum_dtype``; ``DeepSpeedEngine.get_data_types`` then takes the model
  dtype, and ``_do_optimizer_sanity_check`` returns ``BFLOAT16`` (the
  ``BF16_Optimizer`` with an unpartitioned fp32 gradient buffer) only for
  ``bf16`` + ``fp32`` accumulation + ZeRO 1.  With the default, ZeRO 1 uses
  ``DeepSpeedZeroOptimizer``.  So the paper's runs are modelled without
  ``BF16_Optimizer``; that is an assumption about an unpublished config file.
* ZeRO stage 1 for AutoSP, Ulysses, Ulysses+checkpointing and ring attention:
  ``DeepSpeedEngine.get_autosp_backend`` refuses AutoSP unless the ZeRO stage
  is 0 or 1, and the baselines are run under the same engine settings.
* ZeRO stage 3 for the ZeRO-3 baseline (its definition).
* Adam, 8 ranks (one node of 8×A100-80GB, the paper's hardware), micro-batch 1.

No constant here is fitted to the published figures.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PaperConfig:
    precision: str = "bf16"
    grad_accum_dtype: str | None = None
    optimizer: str = "adam"
    world_size: int = 8
    micro_batch_size: int = 1
    sp_zero_stage: int = 1
    zero3_zero_stage: int = 3

    def zero_stage(self, system: str) -> int:
        """ZeRO stage of ``system`` (``zero3`` or one of the SP systems)."""
        return self.zero3_zero_stage if system.replace("-", "") == "zero3" else self.sp_zero_stage


PAPER_CONFIG = PaperConfig()


def training_config(model, system: str, config: PaperConfig = PAPER_CONFIG):
    """The ledger's :class:`~simulator.ledger.TrainingConfig` for ``model`` (a ``PaperModel``) under ``system``."""
    from simulator.ledger import TrainingConfig

    return TrainingConfig.for_llama(
        hidden=model.hidden_size, ffn_hidden=model.intermediate_size, layers=model.num_layers,
        heads=model.num_heads, kv_heads=model.num_kv_heads, vocab=model.vocab_size,
        tied_embeddings=model.tie_word_embeddings, optimizer=config.optimizer, precision=config.precision,
        grad_accum_dtype=config.grad_accum_dtype, zero_stage=config.zero_stage(system),
        dp_world_size=config.world_size, micro_batch_size=config.micro_batch_size)


def static_memory_bytes(model, system: str, which: str = "nominal", config: PaperConfig = PAPER_CONFIG) -> int:
    """Per-rank static memory inside backward (parameters, gradients, optimizer state, buffers, device reserve)."""
    return peak_memory_bytes(model, system, 0, which, config)


def peak_memory_bytes(model, system: str, activation_bytes: int, which: str = "nominal",
                      config: PaperConfig = PAPER_CONFIG) -> int:
    """Per-rank peak: the ledger inside backward with ``activation_bytes`` of simulated activations (the
    workload's peak above static memory), which also adds their allocator rounding and fragmentation band
    (`simulator.max_length.ledger_peak`)."""
    from simulator.max_length import ledger_peak

    return ledger_peak(training_config(model, system, config), activation_bytes, which)


def ledger_lines(model, system: str, activation_bytes: int = 0, config: PaperConfig = PAPER_CONFIG):
    """The ledger lines behind `peak_memory_bytes` (for tables and the notebook)."""
    from simulator.ledger import memory_ledger

    return memory_ledger(training_config(model, system, config), at="backward", activation_bytes=int(activation_bytes))


ALTERNATIVE_CONFIG = PaperConfig(grad_accum_dtype="fp32")
"""Not the stated configuration: the same runs with ``data_types.grad_accum_dtype = "fp32"``, which under ZeRO 1
and bf16 selects DeepSpeed's ``BF16_Optimizer`` and its unpartitioned fp32 gradient buffer (and fp32 gradient
partitions under ZeRO 3).  The max-seq-len table shows it as an explanation of the gap to the published figures,
never as the configuration the lengths are reported for."""
