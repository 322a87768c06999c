"""Run-time checks of what a compiled AutoSP program assumed about its inputs.

Dynamo guards on shapes and dtypes, not on values.  Where a rule of the
sequence-sharding analysis relied on the values it saw at compile time, the
compiled model checks on every call that they still hold (cheap checks on the
full-length inputs, before any collective runs).
"""

from __future__ import annotations

import torch
from torch import nn

from autosp.errors import AutoSPError
from autosp.inputs import ShardLayout


def sliding_window(module: nn.Module) -> int | None:
    """The attention window of a Hugging Face model whose config has one in use, else None."""
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def check_sliding_window(module: nn.Module, layout: ShardLayout) -> None:
    """A window shorter than the sequence is invisible on a shard shorter than the window: refuse it."""
    window = sliding_window(module)
    if window is not None and window < layout.padded_seq_len:
        raise AutoSPError(
            f"the model attends within a sliding window of {window} tokens, shorter than the sequence "
            f"({layout.padded_seq_len} tokens); AutoSP does not support sliding-window attention yet: train with "
            f"sequences of at most {window} tokens or disable the window (Mistral/Qwen2: sliding_window=None)"
        )


def positions_are_plain(position_ids: torch.Tensor | None) -> bool:
    """True when every row's positions are 0..S-1 (one unpacked sequence per row)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if position_ids is None or isinstance(position_ids, FakeTensor):  # a shape-only trace: nothing to check
        return True
    plain = torch.arange(position_ids.shape[-1], device=position_ids.device).expand_as(position_ids)
    return torch.equal(position_ids, plain)


PACKED_POSITIONS_REFUSED = (
    "position_ids are not 0..S-1 in every row (packed documents?) and the model builds its attention mask from "
    "them; AutoSP supports one unpacked sequence per row so far (Note [Causal masks built from positions])"
)
