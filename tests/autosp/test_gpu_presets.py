"""`autosp.plan.auto.GPU_PRESETS`: the hardware preset a GPU's name picks for ``memory_plan="auto"`` and
``strategy="auto"`` (`autosp.plan.auto.default_cluster`), checked with a GPU of the given name (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from autosp.errors import AutoSPError


@pytest.mark.parametrize("gpu, preset", [
    ("NVIDIA B200", "b200"), ("AMD Instinct MI300X", "mi300x"), ("AMD Instinct MI300X VF", "mi300x"),
    ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA H200", "h200-sxm"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"), ("AMD Instinct MI250X", "mi250"),
    ("NVIDIA GB200", None), ("AMD Instinct MI300A", None), ("AMD Instinct MI325X", None)])
def test_a_gpus_name_picks_its_hardware_preset(monkeypatch, gpu, preset):
    """`autosp.plan.auto.GPU_PRESETS` through `default_cluster` (a GPU of the given name; this machine has none):
    B200 and MI300X have their presets, a GB200 is not priced as a B200, and a GPU without a preset is refused."""
    from autosp.plan.auto import GPU_PRESETS, default_cluster
    from simulator.hardware import preset_names

    assert {p for _, p in GPU_PRESETS if p is not None} <= set(preset_names())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    assert default_cluster(torch.device("cpu")) == "cpu-gloo"
    if preset is None:
        with pytest.raises(AutoSPError, match=f"no hardware preset for the GPU '{gpu}'"):
            default_cluster(torch.device("cuda", 0))
    else:
        assert default_cluster(torch.device("cuda", 0)) == preset
