"""``build_system("alst", ...)``: DeepSpeed's ALST (Arctic Long Sequence Training), configured as its authors do.

ALST (arXiv 2506.13996) is a set of components in DeepSpeed's released
``deepspeed.runtime.sequence_parallel.ulysses_sp`` plus the training loop of Snowflake's ArcticTraining
(``arctic_training/trainer``) that puts them together.  This system uses DeepSpeed's components as they are and
writes only the glue the DeepSpeed ALST tutorial and ArcticTraining's trainer write:

- Ulysses attention: ``UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation=...,
  sequence_parallel_size=sp_size, micro_batch_size=1, seq_length_is_variable=True)``, which makes the SP groups
  (its ``mpu``) and replaces the named attention function with its all-to-all wrapper;
- the sample's shard: DeepSpeed's ``UlyssesSPDataLoaderAdapter`` over a one-sample loader (global
  ``position_ids``, labels pre-shifted over the whole sequence into ``shift_labels``, then sliced);
- tiled MLP: every MLP's ``forward`` runs DeepSpeed's ``TiledMLP`` with ArcticTraining's
  ``tiled_mlp_forward_common`` rule (``ceil(seq / hidden)`` shards, maxed over the ranks);
- tiled logits+loss: ArcticTraining's ``SFTTrainer.loss`` for models without Liger kernels: the decoder's hidden
  states into DeepSpeed's ``TiledFusedLogitsLoss`` (reduction "sum" of per-shard summed losses, shards sized to
  ``logits_shard_bytes`` of fp32 logits, ArcticTraining's 1 GiB by default), divided by the local valid
  targets, then the differentiable weighted all-gather of the ranks' losses;
- per-layer activation checkpointing: Hugging Face's (non-reentrant, every decoder layer,
  `adapters.enable_layer_checkpointing`);
- checkpoint offload: DeepSpeed's ``get_checkpoint_hidden_states_offloading_ctx_manager()`` (the offload the
  tutorial gives for non-reentrant checkpointing) around each step's forward and backward: every decoder layer's
  checkpointed input goes to host memory, but the last;
- the engine: ``deepspeed.initialize(model, optimizer, config, mpu=mpu)`` and ``engine.backward(loss)``, ZeRO
  stage 0, so that it holds what the other rows of the CPU tables hold (fp32 parameters and
  gradients, no optimizer state: a torch AdamW that never steps, as in `zero3`); ALST's published runs add
  ZeRO-3 with optimizer offload, a separate technique (the ``zero3`` row measures ZeRO-3 alone).

It runs eagerly, as ArcticTraining does (``compiler`` is accepted for the common interface and not used), and
only Hugging Face decoders with gate/up/down MLPs, one sample per step (``micro_batch_size`` 1, as every ALST
configuration; ArcticTraining's loss function handles no more), over the whole world (its SP groups).

Workarounds (each the smallest; docs/reproduction.md, "Faults of the peer found while running ALST", reproduces
the three faults, 1, 2 and 7):

1. Fault: the engine's gradient reduction under ZeRO stages 0, 1 and 2 sums an SP group's gradients (it divides
   the all-reduce over the sequence-data-parallel group by the data-parallel size only; ZeRO-0:
   ``engine._reduce_non_expert_gradients``), while ALST's loss aggregation (the differentiable all-gather of the
   ranks' losses, in DeepSpeed's tutorial and ArcticTraining's trainer) already gives every rank sp_size times
   its share: every gradient of an SP job comes out sp_size times too large (ZeRO-3, ALST's published setting,
   gives the single-device gradient).  `step` divides the gradients by sp_size after ``engine.backward``.
2. Fault: ``TiledFusedLogitsLoss`` runs the lm_head's backward inside its forward with an incoming gradient of 1
   and scales only the hidden states' gradient by the gradient its result later receives; ArcticTraining divides
   the result by the valid-target count (and weights it across ranks) afterwards, so the lm_head weight's gradient
   is never divided by the token count.  `step` passes that later factor in: the per-shard loss function's output
   is multiplied by it and the sum divided by it again (a constant: the loss and the hidden states' gradient are
   unchanged), so that the in-forward backward gets what the rest of the graph would give it.
   ``as_released=True`` runs without workarounds 1 and 2 (tests/experiments/test_alst_baseline.py pins both faults).
3. ``register_with_transformers`` replaces the attention function it is given for the whole process ("Being John
   Malkovich"); under ``"sdpa"`` every other model of the process would run Ulysses too.  The model gets an
   attention name of its own (`_own_sdpa`) mapped to transformers' SDPA: registered for this model only.  With a
   name transformers has no mask function for, it builds no attention mask, which is what ArcticTraining gets by
   registering a mask function that returns None for "sdpa" (for the whole process).  Likewise the tiled MLP is
   installed on this model's MLP modules, where ArcticTraining patches the MLP class.
4. DeepSpeed keeps the SP groups and the engine's ``mpu`` in process-wide globals: the old SP groups are released
   before registering (a process builds the system once per probe of the memory-cap search), and
   ``deepspeed.utils.groups.mpu`` is set only while this system builds and steps (a ZeRO-3 engine built later in
   the same process would otherwise train as an SP job).
5. On CPU, DeepSpeed's offload engine skips every tensor (no streams, "synchronized device": nothing to offload
   to), so the checkpoint offload would do nothing at all.  `_HostOffload` lets it offload CPU tensors as it
   would device tensors and allocates each host copy with ``autosp_testbed::offload_to_host`` (on CPU a clone),
   the op whose outputs the memory tracker (experiments/cpu/peak_memory.py) counts in its host pool: the
   offloaded layer inputs count as host memory exactly as AutoSP's activation offload does, what a GPU run would
   see.  On CPU both pools are the same RAM: the offload saves no real memory and its copies cost time.
   DeepSpeed's host-buffer pool, which keeps buffers across steps outside any step's count, is off.
6. On CPU the adapter's ``.cpu()`` of a shard is an alias of the gathered full-length tensor (on a GPU, a copy),
   which would keep three full-length copies of the sample alive through the step: the shard is cloned.
7. Fault (ArcticTraining's): its per-shard loss function tests ``all((shift_labels == -100).squeeze())``, which
   raises ``TypeError: iteration over a 0-d tensor`` on a shard of one token (``TiledFusedLogitsLoss`` cuts the
   tokens with ``torch.chunk``, whose last chunk can hold one); `fused_logits_loss_fn` flattens with
   ``reshape(-1)`` instead.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import types
import warnings

import torch
import torch.distributed as dist
from torch import nn

from experiments.baselines.adapters import enable_layer_checkpointing
from experiments.baselines.common import (
    IGNORE_INDEX,
    BaselineUnsupported,
    ensure_deepspeed_comm,
    named_gradients,
)

log = logging.getLogger(__name__)

ARCTIC_LOGITS_SHARD_BYTES = 2**30
"""ArcticTraining's tiled logits+loss shard: about 1 GiB of fp32 logits per shard (``SFTTrainer.loss``)."""
ALST_DEVICE_BYTES = 80 * 2**30
"""The memory of the GPU ALST was run and sized on (H100-80GB, arXiv 2506.13996)."""


def logits_shard_bytes_for(device_bytes: int) -> int:
    """ArcticTraining's logits shard scaled to a device of ``device_bytes``: the same share of its memory as 1 GiB
    of an 80 GiB H100 (the memory-cap table's ALST row: at a cap of a few MiB the unscaled rule is one shard, no
    tiling at all)."""
    return max(1, ARCTIC_LOGITS_SHARD_BYTES * int(device_bytes) // ALST_DEVICE_BYTES)

_names = itertools.count()


def _is_tiled_mlp_target(module: nn.Module) -> bool:
    """An MLP ``down(act(gate(x)) * up(x))``: what ArcticTraining's tiled MLP patch assumes."""
    return all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def unsupported_reason(model: nn.Module | str) -> str | None:
    """Why ALST cannot run ``model``, in one line, or None where it can: a Hugging Face causal LM (a config,
    ``set_attn_implementation``, the decoder as ``.model`` and an ``lm_head``: ALST's Ulysses attention registers
    with transformers) with gate/up/down MLP modules (ArcticTraining's tiled MLP).  Decided from the model's
    structure; ``model`` may be a built model or a tiny model's name (experiments.models), then built with one
    layer on the meta device (no memory, no random numbers drawn)."""
    if isinstance(model, str):
        from experiments.models import build_model

        with torch.device("meta"):
            model = build_model(model, layers=1)
    faults = []
    if not (hasattr(model, "config") and hasattr(model, "set_attn_implementation")):
        faults.append("is no Hugging Face model (ALST's Ulysses attention registers with transformers)")
    elif not (hasattr(model, "model") and hasattr(model, "lm_head")):
        faults.append("has no decoder .model beside an lm_head (ArcticTraining's loss runs the two apart)")
    if not any(_is_tiled_mlp_target(m) for m in model.modules()):
        faults.append("has no gate/up/down MLP (ArcticTraining's tiled MLP takes no other)")
    return f"{type(model).__name__} {' and '.join(faults)}" if faults else None


def tiled_mlp_forward(self, x):
    """ArcticTraining's ``tiled_mlp_forward_common`` (arctic_training/model/tiled_compute.py): DeepSpeed's TiledMLP over
    ``ceil(seq / hidden)`` shards, the same count on every rank (the largest)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    seqlen, hidden = x.shape[-2:]
    num_shards = torch.tensor(math.ceil(seqlen / hidden), device=x.device)
    dist.all_reduce(num_shards, op=dist.ReduceOp.MAX)
    compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    return TiledMLP.apply(mlp_forward, self, x, int(num_shards.item()), compute_params)


def fused_logits_loss_fn(model_with_head=None, hidden_states=None, shift_labels=None):
    """ArcticTraining's per-shard loss (``SFTTrainer.loss``): the shard's summed cross-entropy; a fake zero loss
    where every target of the shard is ignored (workaround 7: ``reshape(-1)`` where ArcticTraining squeezes)."""
    vocab_size = model_with_head.config.vocab_size
    logits = model_with_head.lm_head(hidden_states)
    if all((shift_labels == IGNORE_INDEX).reshape(-1)):
        return (logits.sum() * 0.0).float()
    good_items = ((shift_labels != IGNORE_INDEX).squeeze()).sum()
    loss = model_with_head.loss_function(logits=logits, labels=None, vocab_size=vocab_size, shift_labels=shift_labels)
    return loss * good_items


def _host_offload_class():
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    import autosp.ops  # noqa: F401  (registers autosp_testbed::offload_to_host)

    class _HostOffload(CheckpointHiddenStatesOffload):
        """DeepSpeed's checkpoint-input offload, offloading CPU tensors as device tensors (workaround 5)."""

        def _should_skip(self, tensor: torch.Tensor) -> bool:
            # DeepSpeed's rule without "synchronized device / not on the accelerator", which skips every CPU tensor
            return (self._num_bytes(tensor) < self.min_offload_bytes or isinstance(tensor, nn.Parameter)
                    or (tensor.numel() > 1 and 0 in tensor.stride()))

        def _empty_cpu_like(self, tensor: torch.Tensor):
            host = torch.ops.autosp_testbed.offload_to_host(tensor.detach())  # counted in the host pool
            return host, self._buffer_key(tensor)

    return _HostOffload


@contextlib.contextmanager
def _deepspeed_mpu(mpu):
    """``deepspeed.utils.groups.mpu`` set to ``mpu`` inside the block only (workaround 4)."""
    from deepspeed.utils import groups

    previous, groups.mpu = groups.mpu, mpu
    try:
        yield
    finally:
        groups.mpu = previous


def _own_sdpa(model: nn.Module) -> str:
    """Give ``model`` an attention implementation of its own that is transformers' SDPA (workaround 3)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    name = f"alst_sdpa_{os.getpid()}_{next(_names)}"
    AttentionInterface.register(name, sdpa_attention_forward)
    model.set_attn_implementation(name)
    return name


class ALSTSystem:
    """Exact with workarounds 1 and 2 (tests/experiments/test_alst_baseline.py); see the module docstring."""

    name = "alst"

    def __init__(
        self, model: nn.Module, *, sp_size: int, process_group: dist.ProcessGroup | None = None,
        compiler: str = "aot_eager", logits_shard_bytes: int = ARCTIC_LOGITS_SHARD_BYTES, as_released: bool = False,
    ):
        import deepspeed
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as parallel_state_sp
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        if process_group is not None and process_group != dist.group.WORLD:
            raise BaselineUnsupported("alst: register_with_transformers makes SP groups over the whole world; "
                                      "pass process_group=None")
        why = unsupported_reason(model)
        if why is not None:
            raise BaselineUnsupported(f"alst: {why}")
        mlps = [m for m in model.modules() if _is_tiled_mlp_target(m)]
        world = dist.get_world_size()
        if sp_size < 2 or world % sp_size:
            raise BaselineUnsupported(f"alst: sequence parallelism over {sp_size} of {world} ranks; ALST's "
                                      "Ulysses needs at least 2 and a divisor of the world")
        if logits_shard_bytes <= 0:
            raise ValueError(f"alst: logits_shard_bytes must be positive, got {logits_shard_bytes}")
        if "LOCAL_RANK" not in os.environ:
            raise ValueError("alst: deepspeed.initialize needs the LOCAL_RANK environment variable; launch with "
                             "torchrun or the deepspeed launcher, or set it in each rank before build_system")
        ensure_deepspeed_comm()
        # ArcticTraining's loss aggregation calls torch.distributed.nn.functional.all_gather, deprecated: every step
        warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
                                category=FutureWarning)
        self.model = model
        self.sp_size = sp_size
        self.logits_shard_bytes = int(logits_shard_bytes)
        self.as_released = as_released
        model.config.use_cache = False

        attention = _own_sdpa(model)
        parallel_state_sp._release_sequence_parallel_groups()  # workaround 4: one set of SP groups per build
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=attention, sequence_parallel_size=sp_size,
            micro_batch_size=1, seq_length_is_variable=True,
        )
        for mlp in mlps:  # workaround 3: this model's MLPs, not the class
            mlp.forward = types.MethodType(tiled_mlp_forward, mlp)
        enable_layer_checkpointing(model)
        self._mpu = mpu
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 0},  # what the other rows hold; workaround 1 is this stage's fix
            "sequence_parallel_size": sp_size,
            "steps_per_print": 10**9,
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # never steps: no state
        with _deepspeed_mpu(mpu):
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
        self.sp_group = mpu.get_sequence_parallel_group()
        self.sp_rank = mpu.get_sequence_parallel_rank()
        self._offload = _host_offload_class()(max_cpu_buffer_pool_count=0)  # DeepSpeed's defaults, no pool
        log.info("alst: sp_size=%d, attention %s, tiled MLP on %d modules, eager (compiler=%s unused)",
                 sp_size, attention, len(mlps), compiler)

    def _local_batch(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """This rank's shard through DeepSpeed's data-loader adapter (every rank holds the same sample: the shard of
        the first rank's, the others dropped)."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        sample = {"input_ids": input_ids, "position_ids": positions, "labels": labels}
        adapter = UlyssesSPDataLoaderAdapter([sample], sp_rank=self.sp_rank, sp_group=self.sp_group,
                                             sp_world_size=self.sp_size, device=input_ids.device)
        batch = next(adapter)
        return {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}  # workaround 6

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """ArcticTraining's ``SFTTrainer.loss`` for SP > 1 without Liger (with workaround 2 unless as released)."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        shift_labels = batch["shift_labels"]
        bs, seqlen = shift_labels.shape
        vocab_size = self.model.config.vocab_size
        num_shards = math.ceil(bs * seqlen * vocab_size * 4 / self.logits_shard_bytes)  # fp32 logits per shard

        model_with_head = self.engine.module
        outputs = model_with_head.model(**batch, use_cache=False)
        hidden_states = outputs.last_hidden_state
        compute_params = [model_with_head.lm_head.weight]
        good_tokens = ((shift_labels != IGNORE_INDEX).view(-1)).sum()

        loss_fn, scale = fused_logits_loss_fn, None
        if not self.as_released:  # workaround 2: d(loss)/d(total_loss_sum) on this rank, = sp_size / all targets
            total = good_tokens.detach().clone()
            dist.all_reduce(total, group=self.sp_group)
            scale = self.sp_size / max(int(total), 1)

            def loss_fn(model_with_head=None, hidden_states=None, shift_labels=None):
                return fused_logits_loss_fn(model_with_head, hidden_states, shift_labels) * scale

        total_loss_sum = TiledFusedLogitsLoss.apply(loss_fn, model_with_head, hidden_states, shift_labels, None,
                                                    num_shards, compute_params, "sum")
        if scale is not None:
            total_loss_sum = total_loss_sum / scale
        total_good_items = (shift_labels != IGNORE_INDEX).squeeze().sum()
        loss = total_loss_sum / max(total_good_items, 1)

        # differentiable weighted per-shard-loss aggregation across ranks
        losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=self.sp_group)
        good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=self.sp_group)
        total_loss = sum(losses_per_rank[rank] * good_tokens_per_rank[rank] for rank in range(self.sp_size))
        total_good_tokens = sum(good_tokens_per_rank)
        return total_loss / total_good_tokens

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] != 1:
            raise BaselineUnsupported(f"alst: a batch of {input_ids.shape[0]} samples; ALST trains one sample per "
                                      "step (micro_batch_size 1: ArcticTraining's loss function handles no more)")
        batch = self._local_batch(input_ids, labels)
        with _deepspeed_mpu(self._mpu), self._offload:  # forward and backward inside the offload context
            loss = self._loss(batch)
            self.engine.backward(loss)
        if not self.as_released:  # workaround 1: ZeRO-0 left every gradient sp_size times too large
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(self.sp_size)
        return loss.detach()

    def gradients(self) -> dict[str, torch.Tensor]:
        return named_gradients(self.model)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
