"""AutoSP with the Hugging Face Trainer: ``AutoSPTrainer``, a drop-in ``transformers.Trainer``.

One line changes in a Trainer script::

    from autosp.integrations.hf import AutoSPTrainer as Trainer   # was: from transformers import Trainer

and it runs under ``torchrun`` as before (``sp_size`` defaults to the world size; pass
``sp_size=P`` to make the other ranks data-parallel replicas, ``autosp_options={...}``
for `autosp.compile`'s options).  See Note [The Trainer path].

Note [The Trainer path]
The Trainer, through accelerate, would wrap the model in DistributedDataParallel and
shard each batch over every rank; under sequence parallelism both are wrong (DDP
averages gradients over the SP ranks of one sequence, and the ranks of an SP group
must hold the same sample).  `AutoSPTrainer` overrides these hooks:

- ``_wrap_model``: the distributed wrapper is the `SequenceParallelModel` (the
  Trainer then leaves the model to it and prepares only the optimizer with
  accelerate: no DDP), its forward under the Trainer's autocast (Note [Mixed
  precision under the Trainer]); evaluation runs the plain model;
- ``get_train_dataloader``: the Trainer's collator (unused columns removed, dynamic
  padding as the collator does it) over `autosp.sequence_parallel_sampler`: the
  ranks of an SP group read the same samples, replicas different ones;
- ``compute_loss``: the batch goes through `autosp.prepare_inputs` (ids, labels,
  padding mask, position ids); where the Trainer counts the accumulated targets
  (``num_items_in_batch``, as for a model that takes loss kwargs) the sample's mean
  loss is turned into the Trainer's sum / count, so gradient accumulation weighs
  tokens exactly as on one device;
- ``_clip_grad_norm`` and ``_get_grad_norm``: the norm is the compiled model's
  (``clip_grad_norm_``), which sums the squares of sharded parameters' gradients over the
  ranks (``shard_parameters=True``: Note [Parameters gathered in the graph] in
  autosp/parameter_sharding.py); accelerate's would clip each rank by its own shard's norm.
Gradients need nothing more: the compiled model reduces them during backward (sum over
the SP group, average over replicas; autosp/gradients.py), before
the Trainer clips and steps.

Note [Mixed precision under the Trainer]
With ``bf16=True`` (or ``fp16=True`` on a GPU) the plain Trainer trains in mixed precision only
because accelerate's ``prepare_model`` replaces the model's forward with
``convert_outputs_to_fp32(autocast(forward))``; the model `_wrap_model` returns skips that
preparation, so `AutoSPTrainer` puts the same wrapper around the compiled model's forward:
``accelerator.autocast()`` (the context manager accelerate builds from the same state: the
dtype, the device type, the user's ``AutocastKwargs``) and the outputs back in fp32, wherever
accelerate would (``accelerator.native_amp``: not for fp16 on CPU, which accelerate leaves in
fp32 too).  Dynamo traces the model under the ambient autocast, so the compiled program holds
its casts, as the plain model's eager forward does; backward runs outside it, as in the plain
Trainer, and fp16's loss scaling stays the Trainer's (``accelerator.backward``).

Note [FSDP under the Trainer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A Trainer job asks for FSDP with ``fsdp=True`` (or ``fsdp="full_shard"``) and an ``fsdp_config`` (FSDP2 or 1): each rank is to
hold 1/N of every parameter, its gradient and its optimizer state.  Accelerate's FSDP would wrap the model in
hooks that Dynamo cannot trace into AutoSP's one graph and would shard it over the ranks of one sequence as if they
were replicas.  AutoSP has the same layout of its own, ``shard_parameters=True`` (each parameter split over the
whole group, gathered layer by layer inside the compiled step, its gradient reduce-scattered there: Note
[Parameters gathered in the graph] in autosp/parameter_sharding.py), so `AutoSPTrainer` serves the FSDP settings
with it: the accelerator is built without the FSDP plugin (``create_accelerator_and_postprocess``), the compile
gets ``shard_parameters=True``, the planner prices ZeRO 3's layout (`planned_setup`), and the Trainer's optimizer
steps the shards as under a plain Trainer.  Options that tune FSDP's wrapping and state dicts (the wrap policy and
classes, ``reshard_after_forward``, ``state_dict_type``, ``cpu_ram_efficient_loading``, FSDP's activation
checkpointing: AutoSP's ``checkpointing`` decides that) do not apply and are logged; ``cpu_offload`` (parameters in
host memory) is refused, as AutoSP's shards stay on the device.  The Trainer's saved model is the plain model's
state dict, each parameter whole.

Note [The planned length under the Trainer]
A memory plan (the default on a GPU, or ``memory_plan="auto"``) and ``strategy="auto"`` are made
for ``plan_seq_len`` tokens; left out, the first batch's length, which under dynamic padding is
rarely the longest the job trains.  Where the compile plans and ``autosp_options`` holds no
``plan_seq_len``, `AutoSPTrainer` gives it the longest sample of the training set, read once as
the Trainer reads lengths for its length-aware samplers (`longest_sample`), padded as the batch
holding it will be (`planned_length`: the collator's ``pad_to_multiple_of`` / ``max_length``,
then AutoSP's multiple of sp_size or ``length_bucket``).  Where the lengths cannot be read (no
``input_ids`` lists in the samples) the plan stays with the first batch and a warning says so.
Whether the default compile plans is decided here as `autosp.compile` decides it
(`autosp.plan.auto.resolve_memory_plan`), and the decision is passed on as ``memory_plan``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader

# The defining modules, not the package: autosp/__init__.py imports this module on first use of AutoSPTrainer.
from autosp.api import SequenceParallelModel
from autosp.api import compile as autosp_compile
from autosp.config import PLANNING_OPTIONS, ZIGZAG_STRATEGIES, AutoSPConfig, with_job_setup
from autosp.errors import AutoSPError
from autosp.inputs import prepare_inputs
from autosp.plan.auto import resolve_memory_plan
from autosp.sampler import sequence_parallel_sampler

log = logging.getLogger(__name__)

_TOKEN_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd"}
"""The Trainer's ``optim`` values whose state the planner's ledger counts exactly (`autosp.plan.TrainingSetup`'s
``optimizer``); for the others the planner keeps its default (AdamW's two fp32 states per parameter)."""


def planned_setup(args: transformers.TrainingArguments) -> dict:
    """The `autosp.plan.TrainingSetup` fields a Trainer job fixes, for ``plan_setup`` under ``memory_plan="auto"``
    or ``strategy="auto"``: no ZeRO (every rank holds its optimizer's whole state), or ZeRO 3's layout where the
    job asks for FSDP (Note [FSDP under the Trainer]), the per-device batch, the accumulation steps and the
    optimizer where known."""
    optim = getattr(args.optim, "value", args.optim)
    kind = _OPTIMIZERS.get(optim)
    if kind == "sgd":  # the Trainer passes optim_args "momentum=0.9,..." to torch's SGD
        given = dict(m.split("=", 1) for m in (args.optim_args or "").replace(" ", "").split(",") if "=" in m)
        kind = "sgd_momentum" if float(given.get("momentum", 0)) else "sgd"
    return {"zero_stage": 3 if asks_fsdp(args) else 0, "micro_batch": args.per_device_train_batch_size,
            "grad_accum": args.gradient_accumulation_steps, **({"optimizer": kind} if kind else {})}


def asks_fsdp(args: transformers.TrainingArguments) -> bool:
    """Whether the Trainer's arguments ask for FSDP (``fsdp=...``), served by AutoSP's sharded parameters."""
    return getattr(args, "fsdp_plugin_args", None) is not None


def _check_fsdp_settings(plugin_args: Mapping) -> None:
    """Refuse what AutoSP's sharded parameters cannot serve of the Trainer's FSDP settings (Note [FSDP under the
    Trainer]); log the options that do not apply."""
    if plugin_args.get("cpu_offload"):
        raise AutoSPError("AutoSPTrainer serves FSDP with AutoSP's sharded parameters, which stay on the device: drop "
                          "\"cpu_offload\" from fsdp_config (or \"offload\" from fsdp)")
    sharding = plugin_args.get("reshard_after_forward", True)  # FSDP2: a bool; FSDP1: the sharding strategy's name
    if not isinstance(sharding, bool) and str(sharding).lower() not in ("full_shard", "shard_grad_op"):
        raise AutoSPError(f"FSDP {sharding}: AutoSPTrainer serves sharding over every rank (AutoSP's "
                          "shard_parameters=True); use fsdp=True with the default fsdp_config (full sharding), or "
                          "drop fsdp to keep every parameter whole on each rank")
    ignored = sorted(k for k in plugin_args if k not in ("fsdp_version", "cpu_offload"))  # FSDP's own tuning
    log.info("AutoSPTrainer: FSDP served by AutoSP's sharded parameters (each rank 1/N of every parameter, gathered "
             "inside the compiled step)%s", f"; {', '.join(ignored)} do not apply" if ignored else "")


def longest_sample(dataset, length_column: str | None = "length", input_name: str = "input_ids") -> int | None:
    """Tokens in the longest sample of a map-style ``dataset``, read the way the Trainer infers lengths for its
    length-aware samplers: a ``datasets.Dataset``'s ``length_column`` where it has one, else ``len`` of each
    sample's ``input_name`` list (one pass over the dataset).  None where they cannot be read: no dataset, an
    iterable one, samples without that key."""
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        return None
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, (list, tuple)) and len(dataset):  # a datasets.Dataset: whole columns, no Python rows
        if length_column and length_column in columns:
            return int(max(dataset[length_column]))
        if input_name in columns:
            return max(len(ids) for ids in dataset[input_name])
        return None
    longest = None
    for i in range(len(dataset)):
        sample = dataset[i]
        ids = sample.get(input_name) if isinstance(sample, Mapping) else None
        if ids is None:
            return None
        longest = max(longest or 0, len(ids))
    return longest


def planned_length(longest: int, collator: Callable | None, *, sp_size: int, strategy: str = "ulysses",
                   length_bucket: int | None = None) -> int:
    """The padded length of a batch holding the ``longest`` sample: padded by ``collator`` (its
    ``pad_to_multiple_of``; with ``padding="max_length"`` to its ``max_length`` at least), then by AutoSP to a
    multiple of ``length_bucket``, else of sp_size (2 * sp_size for the zig-zag strategies, and for
    ``strategy="auto"``, which may choose one)."""
    padding = getattr(collator, "padding", None)
    max_length = getattr(collator, "max_length", None)
    if getattr(padding, "value", padding) == "max_length" and isinstance(max_length, int):
        longest = max(longest, max_length)
    multiple = getattr(collator, "pad_to_multiple_of", None)
    if isinstance(multiple, int) and multiple > 1:
        longest = -(-longest // multiple) * multiple
    multiple = length_bucket or (2 * sp_size if strategy in (*ZIGZAG_STRATEGIES, "auto") else sp_size)
    return -(-longest // multiple) * multiple


class _EpochLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` reaches its sampler (the Trainer calls it each epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


class AutoSPTrainer(transformers.Trainer):
    """``transformers.Trainer`` training the model with AutoSP sequence parallelism (Note [The Trainer path])."""

    def __init__(self, *args: Any, sp_size: int | None = None, autosp_options: dict | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        import torch.distributed as dist

        if not dist.is_initialized():
            raise AutoSPError("AutoSPTrainer needs torch.distributed: launch with torchrun (or call "
                              "torch.distributed.init_process_group) before building the trainer")
        if isinstance(self.model, SequenceParallelModel):
            raise AutoSPError("pass AutoSPTrainer the plain model: it compiles it with AutoSP itself (and the Trainer "
                              "saves and evaluates the plain model)")
        self._sp_size = sp_size or dist.get_world_size()
        self._autosp_options = dict(autosp_options or {})
        if self.compute_loss_func is not None or self.args.label_smoothing_factor:
            raise AutoSPError("AutoSPTrainer takes the loss the model returns (the exact causal-LM loss AutoSP makes "
                              "of it); drop compute_loss_func / label_smoothing_factor")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise AutoSPError("AutoSPTrainer reduces gradients itself; drop the Trainer's DeepSpeed settings (for "
                              "DeepSpeed ZeRO use autosp.deepspeed_initialize) or accelerate's FSDP launch config "
                              "(pass fsdp=True in TrainingArguments instead)")
        if asks_fsdp(self.args):  # Note [FSDP under the Trainer]
            if self._autosp_options.get("shard_parameters") is False:
                raise AutoSPError("the Trainer's fsdp setting is AutoSP's shard_parameters=True: drop "
                                  "\"shard_parameters\": False from autosp_options, or drop fsdp")
            self._autosp_options["shard_parameters"] = True
        self._sp_model: SequenceParallelModel | None = None
        if getattr(getattr(self.model, "config", None), "use_cache", False):
            self.model.config.use_cache = False  # a KV cache serves generation, not training
            log.info("AutoSPTrainer: set model.config.use_cache = False for training")

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, built without the FSDP plugin its arguments ask for: AutoSP's sharded
        parameters serve FSDP (Note [FSDP under the Trainer])."""
        if not asks_fsdp(self.args):
            return super().create_accelerator_and_postprocess()
        plugin_args = self.args.fsdp_plugin_args
        _check_fsdp_settings(plugin_args)
        self.args.fsdp_plugin_args = None
        try:
            super().create_accelerator_and_postprocess()
        finally:
            self.args.fsdp_plugin_args = plugin_args

    # -- the model -----------------------------------------------------------------------------
    @property
    def sp_model(self) -> SequenceParallelModel:
        """The AutoSP-compiled model (built on first use, on every rank)."""
        if self._sp_model is None:
            options = with_job_setup(self._autosp_options, lambda: planned_setup(self.args))  # priced as it runs
            options = self._with_plan_seq_len(options)
            self._sp_model = autosp_compile(self.model, sp_size=self._sp_size, **options)
        return self._sp_model

    def _with_plan_seq_len(self, options: dict) -> dict:
        """``options`` with ``plan_seq_len`` the longest padded sample of the training set (Note [The planned
        length under the Trainer]) where the compile plans and the user gave none."""
        if "plan_seq_len" in options:
            return options
        if options.get("strategy") != "auto" and options.get("memory_plan") is None:
            # The default plans wherever it can: decide it here (as autosp.compile would) to know whether the
            # length is asked for; the options passed on say the decision, so that the compile does not redo it.
            config = AutoSPConfig.from_options(sp_size=self._sp_size, compiler=options.get("compiler", "inductor"),
                                               options={k: v for k, v in options.items() if k != "compiler"})
            if resolve_memory_plan(self.model, config).memory_plan == "off":
                return {**{k: v for k, v in options.items() if k not in PLANNING_OPTIONS}, "memory_plan": "off"}
            options = {**options, "memory_plan": "auto"}
        if options.get("strategy") != "auto" and options.get("memory_plan") != "auto":
            return options  # nothing is planned: plan_seq_len would be refused
        longest = longest_sample(self.train_dataset, self._length_column(), self._model_input_name())
        if longest is None:
            log.warning("AutoSPTrainer: the training samples' lengths are unknown (%s), so the plan is made for the "
                        "first batch's length; pass autosp_options={'plan_seq_len': N}, N the longest padded "
                        "sample the job trains", "no train_dataset" if self.train_dataset is None
                        else f"a {type(self.train_dataset).__name__} without {self._model_input_name()!r} lists")
            return options
        plan_seq_len = planned_length(longest, self.data_collator, sp_size=self._sp_size,
                                      strategy=options.get("strategy", "ulysses"),
                                      length_bucket=options.get("length_bucket"))
        log.info("AutoSPTrainer: plan_seq_len=%d (the longest training sample, %d tokens, padded as the collator "
                 "and AutoSP pad it)", plan_seq_len, longest)
        return {**options, "plan_seq_len": plan_seq_len}

    def _length_column(self) -> str | None:
        return getattr(self.args, "length_column_name", None)

    def _model_input_name(self) -> str:
        names = getattr(self.processing_class, "model_input_names", None)
        return names[0] if names else "input_ids"

    def _clip_grad_norm(self, model: nn.Module):
        if not isinstance(model, SequenceParallelModel):
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()  # what accelerate's clip_grad_norm_ does first (fp16's loss scale)
        return model.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        if grad_norm is None and isinstance(model, SequenceParallelModel):
            self.accelerator.unscale_gradients()
            grad_norm = model.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: DataLoader | None = None) -> nn.Module:
        if not training:
            return self.model
        return self._with_mixed_precision(self.sp_model)

    def _with_mixed_precision(self, model: SequenceParallelModel) -> SequenceParallelModel:
        """``model`` whose forward runs under the Trainer's autocast (Note [Mixed precision under the Trainer])."""
        if self.accelerator.native_amp and not getattr(model, "_autosp_trainer_autocast", False):
            from accelerate.utils import convert_outputs_to_fp32

            forward = model.forward
            accelerator = self.accelerator

            def autocast_forward(*args, **kwargs):
                with accelerator.autocast():
                    return forward(*args, **kwargs)

            model.forward = convert_outputs_to_fp32(autocast_forward)
            model._autosp_trainer_autocast = True
        return model

    # -- the data ------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise AutoSPError("AutoSPTrainer needs a map-style dataset (with __len__) so that every rank of an SP "
                              "group reads the same samples")
        sampler = sequence_parallel_sampler(dataset, self.sp_model, shuffle=True, seed=self.args.seed,
                                            drop_last=self.args.dataloader_drop_last)
        return _EpochLoader(dataset, batch_size=self._train_batch_size, sampler=sampler, collate_fn=collator,
                            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
                            drop_last=self.args.dataloader_drop_last)

    # -- the step ------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not isinstance(model, SequenceParallelModel):  # evaluation: the plain model
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        extra = sorted(k for k, v in inputs.items() if k not in _TOKEN_KEYS and v is not None)
        if extra:
            raise AutoSPError(f"the batch has inputs {extra} that AutoSP does not shard; AutoSPTrainer passes "
                              f"{list(_TOKEN_KEYS)} (drop the others in the collator)")
        labels = inputs.get("labels")
        if labels is None:
            raise AutoSPError("the batch has no labels; use a causal-LM collator (e.g. DataCollatorForLanguageModeling "
                              "with mlm=False) so that the model returns its loss")
        outputs = model(**prepare_inputs(inputs["input_ids"], labels=labels,
                                         attention_mask=inputs.get("attention_mask"),
                                         position_ids=inputs.get("position_ids")))
        loss = outputs.loss
        if num_items_in_batch is not None:
            if getattr(outputs, "aux_loss", None) is not None:
                # HF adds the auxiliary loss unweighted to sum / count; the sample's mean loss cannot be split.
                raise AutoSPError(
                    "the model returns an auxiliary (router) loss, which the Trainer's token-weighted gradient "
                    "accumulation leaves unweighted while AutoSPTrainer can only weigh the whole loss; set "
                    "trainer.model_accepts_loss_kwargs = False (each micro-batch's loss then counts 1 / accumulation "
                    "steps, as on one device with that setting)")
            loss = loss * self._token_weight(labels, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def _token_weight(self, labels: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        """Factor turning this sample's mean loss into the Trainer's sum over targets / accumulated count."""
        groups = self.sp_model.groups
        targets = (labels[..., 1:] != self.sp_model.config.ignore_index).sum()
        total, scale = num_items_in_batch, 1
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            # The Trainer summed the count over every rank: each SP group's sample sp_size times.  The
            # replicas' gradients are averaged by the model's reduction, so each carries dp_size times its share.
            total, scale = num_items_in_batch / groups.sp_size, groups.dp_size
        return targets.to(torch.float32) * scale / total


__all__ = ["AutoSPTrainer"]
