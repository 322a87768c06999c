"""What the model's configuration says about its attention that a shard cannot show.

The mask pass (autosp.passes.dynamo.masks) learns a model's attention mask by
evaluating it on the shard's length; a sliding window at least that long is
invisible there, so its length and the layers it applies to come from the model's
configuration (Hugging Face's ``sliding_window``, ``use_sliding_window``,
``layer_types``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class SlidingWindow:
    window: int
    """Tokens a query attends to (itself included), as Hugging Face's ``sliding_window``."""
    every_layer: bool
    """True when every attention layer slides (no ``layer_types``, or all of them ``sliding_attention``)."""


def sliding_window_layers(module: nn.Module) -> SlidingWindow | None:
    """The sliding window of a Hugging Face model whose config has one in use, else None."""
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    every = layer_types is None or all(t == "sliding_attention" for t in layer_types)
    return SlidingWindow(window, every)
