"""One compiled model trains on many sequence lengths with no setting, every step exact.

Note [One program per length] (autosp/api.py): each distinct shard shape compiles one
program, guarded by its shapes, so twelve lengths need no option, a length seen before
compiles nothing, and the compiles are listed by `SequenceParallelModel.programs`.
`experiments.cpu.bench_lengths.train_on_lengths` compares every step with a
single-device run of the full sequence (loss and every gradient, fp32 rtol 1e-4 /
atol 1e-6).  Lengths that are not multiples of sp_size are padded at the end (labels
ignored) and share the padded length's program.  The twelve-length runs use aot_eager
(Inductor's cold compile takes tens of seconds per program on CPU); the default options,
Inductor included, run on three lengths here and on twelve in the benchmark
(`python -m experiments.cpu.bench_lengths`).
"""

from __future__ import annotations

import pytest
import torch

from experiments.cpu.bench_lengths import train_on_lengths
from tests.harness import run_on_ranks

TWELVE = (16, 24, 17, 32, 40, 9, 48, 31, 64, 20, 56, 12, 16)
"""Twelve distinct lengths: odd ones, 31 sharing 32's padded length at sp_size 2, and a repeat of the first."""


def _shard_lengths(lengths, sp_size: int) -> list[int]:
    """Tokens per rank of each length's program, in the order they first arrive."""
    return list(dict.fromkeys(-(-n // sp_size) for n in lengths))


def _check_compiles(per_rank, lengths, sp_size):
    expected = _shard_lengths(lengths, sp_size)
    for rows in per_rank:
        assert [r["length"] for r in rows] == list(lengths)
        assert rows[-1]["programs"] == len(expected)
        # A step compiles exactly when its shard length is new; the repeat at the end compiles nothing.
        seen, compiled = set(), []
        for r in rows:
            shard = -(-r["length"] // sp_size)
            assert (r["compile_s"] > 0) == (shard not in seen), r
            compiled += [shard] if shard not in seen else []
            seen.add(shard)
        assert compiled == expected


@pytest.mark.parametrize("name", ["hf-llama", "hf-qwen2"])
def test_twelve_lengths_one_compiled_model_every_step_exact(name):
    assert len(set(TWELVE)) == 12
    # one layer: a new length compiles a new program, whose cost (not the depth) is what this test pays for
    spec = {"model": name, "layers": 1, "batch": 2, "lengths": TWELVE, "options": {"compiler": "aot_eager"}}
    per_rank = run_on_ranks(train_on_lengths, 2, spec, timeout_s=900, collective_timeout_s=300)
    _check_compiles(per_rank, TWELVE, 2)


@pytest.mark.inductor
def test_variable_lengths_with_default_options():
    lengths = (16, 17, 16)  # 17 pads to 18: a second program; 16 again reuses the first
    spec = {"model": "hf-llama", "layers": 1, "batch": 2, "lengths": lengths, "options": {}}
    per_rank = run_on_ranks(train_on_lengths, 2, spec, timeout_s=900, collective_timeout_s=600)
    _check_compiles(per_rank, lengths, 2)


def _past_max_programs(rank, world):
    import autosp
    from autosp.errors import AutoSPError
    from experiments.models import build_model

    torch._dynamo.reset()
    model = build_model("hf-llama", layers=1)
    compiled = autosp.compile(model, sp_size=world, compiler="aot_eager", max_programs=2)
    for length in (16, 24, 16, 32):
        ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
        try:
            compiled(**autosp.prepare_inputs(ids, labels=ids)).loss.backward()
        except AutoSPError as err:
            return length, len(compiled.programs), str(err)
    return None, len(compiled.programs), None


def test_a_length_past_max_programs_is_refused_naming_length_bucket():
    for refused_at, programs, message in run_on_ranks(_past_max_programs, 2):
        assert (refused_at, programs) == (32, 2)
        assert "max_programs=2" in message and "length_bucket" in message
