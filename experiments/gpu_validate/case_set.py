"""The cases of a GPU validation run (`cases`): each a compiled training step to run on real ranks, check, measure
and predict; and `Judged`, what every section keeps of one (it passed when it found no problem).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FP32_TOL = {"rtol": 1e-4, "atol": 1e-6}
"""CPU fp32: the tolerance of the project's equivalence tests (tests/autosp/test_equivalence.py)."""
GPU_FP32_TOL = {"rtol": 1e-4, "atol": 1e-5, "relative_to_scale": True}
"""GPU fp32 (TF32 off): Inductor's fused kernels and cuBLAS's shape-dependent algorithms sum in another order than
eager's; atol is relative to the gradient's largest magnitude."""
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2, "relative_to_scale": True}
"""bf16, as tests/autosp/test_equivalence.py compares it."""
PLAIN = {"checkpointing": "none", "tiled_loss": "off", "tiled_mlp": "off"}
"""The step with no memory technique: a planned case's target is one byte below its predicted peak."""

TINY_CPU = {"layers": 1, "hidden": 32, "vocab": 2048}
"""The tiny Hugging Face Llama of the CPU cases (tests/autosp/test_memory_plan.py's): 8 heads of 4, 2 kv heads."""
SMALL_GPU = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "vocab": 4096}
"""The fp32 exactness cases on a GPU (head dim 64)."""
MEDIUM_GPU = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 2, "vocab": 32000}
"""The bf16 timed cases on a GPU (head dim 128): long enough a step for its time to mean something."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One compiled training step to run, check, measure and predict."""

    name: str
    world: int
    """Ranks (= SP size)."""
    sizes: dict
    """`experiments.models.build_model` overrides of the Hugging Face Llama."""
    seq_len: int
    dtype: str = "float32"
    compiler: str = "aot_eager"
    options: dict = field(default_factory=dict)
    """Other ``autosp.compile`` options."""
    plan_below_plain: bool = False
    """``memory_plan="auto"`` with ``target_memory`` one byte below the predicted peak of `PLAIN`."""
    tolerance: dict = field(default_factory=lambda: dict(FP32_TOL))
    warmup: int = 1
    steps: int = 3
    model: str = "hf-llama"

    @property
    def quadratic_from(self) -> int:
        """A 4-D tensor whose last two dims both reach this is a [.., S, S] score or mask block (the shortest
        attention block is a zig-zag chunk, S / 2P tokens; the cases keep head dims and head counts below it)."""
        return max(2, self.seq_len // (2 * self.world))


def cases(device: str, gpus: int = 0) -> list[Case]:
    """The cases of a run: on CPU 2-rank Ulysses and ring and a planned SP 1 step; on a GPU a planned fp32 and a
    timed bf16 step at SP 1, and with two or more GPUs Ulysses and ring (fp32) and a timed Ulysses step over NCCL."""
    if device == "cpu":
        return [Case(name="sp2-ulysses", world=2, sizes=TINY_CPU, seq_len=64, options={"memory_plan": "off"}),
                Case(name="sp2-ring", world=2, sizes=TINY_CPU, seq_len=64,
                     options={"memory_plan": "off", "strategy": "ring"}),
                Case(name="sp1-planned", world=1, sizes=TINY_CPU, seq_len=64, plan_below_plain=True)]
    gpu = {"compiler": "inductor", "tolerance": GPU_FP32_TOL, "warmup": 2, "steps": 5}
    timed = {"compiler": "inductor", "dtype": "bfloat16", "tolerance": BF16_TOL, "warmup": 3, "steps": 10,
             "sizes": MEDIUM_GPU, "seq_len": 4096}
    out = [Case(name="sp1-planned", world=1, sizes=SMALL_GPU, seq_len=1024, plan_below_plain=True, **gpu),
           Case(name="sp1-bf16", world=1, options={"memory_plan": "off"}, **timed)]
    if gpus >= 2:
        out += [Case(name="sp2-ulysses", world=2, sizes=SMALL_GPU, seq_len=1024, options={"memory_plan": "off"}, **gpu),
                Case(name="sp2-ring", world=2, sizes=SMALL_GPU, seq_len=1024,
                     options={"memory_plan": "off", "strategy": "ring"}, **gpu),
                Case(name="sp2-bf16", world=2, options={"memory_plan": "off"}, **timed)]
    return out


CASE_NAMES = tuple(sorted({c.name for device, gpus in (("cpu", 0), ("cuda", 2)) for c in cases(device, gpus)}))


class Judged:
    """A section's record (a dataclass with a ``problems`` field): it passed when ``problems`` is empty."""

    problems: list[str]

    @property
    def passed(self) -> bool:
        return not self.problems
