"""Errors from torch.compile turned into AutoSP errors that say what to change, and what avoids them."""

from __future__ import annotations

import logging
import re

from torch import nn

from autosp.errors import AutoSPError

log = logging.getLogger(__name__)


def install_output_capture_hooks(module: nn.Module) -> None:
    """Install Hugging Face's output-capturing hooks now, outside the compiled forward.

    Hugging Face models that return per-layer outputs (``output_router_logits``,
    ``output_hidden_states``, ``output_attentions``) install forward hooks lazily, on
    the first call that asks for them, under a ``threading.Lock``: a context manager
    Dynamo cannot trace (a graph break, refused under fullgraph).  Installed before
    compiling, the check inside the forward finds them and the hooks trace like any
    other code.  They record nothing unless a call asks for those outputs.
    """
    try:
        from transformers.modeling_utils import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, maybe_install_capturing_hooks
    except ImportError:  # no transformers, or a version without lazy output capture: nothing to install
        return
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel) and _CAN_RECORD_REGISTRY.get(sub):
            maybe_install_capturing_hooks(sub)
            log.debug("installed Hugging Face output-capturing hooks on %s", type(sub).__name__)


def graph_break_error(err: Exception, model: str) -> AutoSPError:
    """An `AutoSPError` for a construct Dynamo cannot trace into one graph, naming it and where it is."""
    text = str(err)
    construct = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text.split("from user code:")[-1])
    where = f" at {frames[-1][0].rsplit('/', 1)[-1]}:{frames[-1][1]} in {frames[-1][2]}()" if frames else ""
    return AutoSPError(
        f"{model}.forward does not trace as one graph: {construct}{where}.  AutoSP compiles with fullgraph=True, since a "
        "graph break would split attention from its all-to-alls and hide token-mixing ops from its analysis; "
        "change that code so torch.compile can trace it (or move it out of the model's forward)"
    )


def with_attention_hint(err: AutoSPError, module: nn.Module) -> AutoSPError:
    """``err``, where ``module`` is a Hugging Face model that runs its eager attention (matmul and softmax, which
    AutoSP does not split over the sequence), with a sentence saying so and what to change: the refusal may name an
    op of the mask its eager attention builds, and that attention would be refused next in any case."""
    config = getattr(module, "config", None)
    if type(err) is not AutoSPError or getattr(config, "_attn_implementation", None) != "eager":
        return err  # a subclass is caught by what it names (e.g. `DocumentAttentionUnavailable`)
    name = type(module).__name__
    fix = ("load it with attn_implementation='sdpa'" if getattr(type(module), "_supports_sdpa", False) else
           f"{name} has no SDPA attention in Hugging Face transformers, and AutoSP does not yet recognise attention "
           "written as matmul and softmax")
    return AutoSPError(f"{err}.  Note: {name} runs eager attention, which AutoSP cannot split over the sequence "
                       f"(it rewrites scaled_dot_product_attention): {fix}")
