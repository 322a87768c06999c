"""Session-wide test environment, set before anything imports DeepSpeed."""

import os
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parent.parent

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_ROOT / ".torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo_caches():
    """Every test compiles afresh: Dynamo caches compiled code per code object (model class forward)
    with a recompile limit of 8, and the in-process tests compile many instances of the same classes."""
    import torch

    torch._dynamo.reset()
    yield
