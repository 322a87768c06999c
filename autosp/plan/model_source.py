"""``--model``: a preset of `autosp.presets` or any Hugging Face ``config.json``, as the planner needs it.

The configuration is read with `autosp.presets.hf_config` (every entry point's one model source, so a model the
planner predicts for is the model ``python -m autosp.train --model`` trains).  Nothing is downloaded and no
weights are created: the parameter tensors' sizes come from a model built on the meta device, and the traced
step builds the model inside a fake-tensor mode (`autosp.tracing.trace_fake_step`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from autosp.errors import AutoSPError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """One model, by the name or path the user gave."""

    spec: str
    """A preset name of `autosp.presets.PRESETS` or the path of a config.json (or of its folder)."""
    _numels: dict[str, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)
    """`parameter_numels` by the configuration's config.json text (every field: the model class and its sizes)."""

    def config(self, *, seq_len: int, num_layers: int | None = None):
        """The Hugging Face config (``attn_implementation="sdpa"``, position embeddings for ``seq_len`` tokens)."""
        from autosp.presets import hf_config

        try:
            return hf_config(self.spec, seq_len=seq_len, num_layers=num_layers)
        except (KeyError, ValueError, TypeError) as exc:
            raise AutoSPError(f"--model {self.spec}: transformers cannot build a config from it ({exc}); give a "
                              "Hugging Face config.json with its model_type") from None

    def attention_heads(self, *, seq_len: int) -> int | None:
        """The query heads of each attention layer (None where the config names none)."""
        config = self.config(seq_len=seq_len)
        return next((int(value) for name in ("num_attention_heads", "n_head", "num_heads")
                     if isinstance(value := getattr(config, name, None), int)), None)

    def build(self, config, dtype: torch.dtype) -> torch.nn.Module:
        """The causal LM of ``config`` on the current device context (``meta``, or fake tensors when traced)."""
        from autosp.presets import build_model

        try:
            return build_model(config, torch.device("cpu"), dtype)
        except ValueError as exc:
            raise AutoSPError(f"--model {self.spec}: transformers has no causal-LM class for model_type "
                              f"{getattr(config, 'model_type', '?')!r} ({exc})") from None

    def parameter_numels(self, config) -> tuple[int, ...]:
        """Element count of every trainable parameter tensor in module order (tied weights once), from a model
        built on the meta device (no memory); built once per configuration by this source (a decision, which shares
        one source through `autosp.plan.traces.TraceReuse`, asks for the same few at every candidate and length)."""
        try:
            key = config.to_json_string(use_diff=False)
        except (TypeError, ValueError):  # a field JSON cannot write: built every time
            return self._built_numels(config)
        if key not in self._numels:
            self._numels[key] = self._built_numels(config)
        return self._numels[key]

    def _built_numels(self, config) -> tuple[int, ...]:
        import transformers

        with torch.device("meta"):
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except ValueError as exc:
                raise AutoSPError(f"--model {self.spec}: transformers has no causal-LM class for model_type "
                                  f"{getattr(config, 'model_type', '?')!r} ({exc})") from None
        return tuple(p.numel() for p in model.parameters() if p.requires_grad)

