"""The example training script (``python -m autosp.examples.train_lm``): data, packing, save and resume.

- Reading and packing (in this process): text split into documents three ways, ``.jsonl`` (ids, objects with
  ids or text), ``.npy`` (1-D and 2-D), a Hugging Face tokenizer from a local folder; packed samples restart
  their position ids at every document and ignore the label of each document's first token; too little data
  is refused.
- Save and resume (one launch of 2 gloo ranks, tiny Llama, aot_eager): an uninterrupted run of 6 steps saves at
  step 3 and 6; its step-3 checkpoint alone, in a fresh output folder (what a crash before step 6 leaves
  behind), continued with ``--resume`` to step 6 gives the same losses at steps 4-6 and the same parameters,
  optimizer and learning-rate state, bit for bit (fp32, one thread per rank: the same operations on the same
  values).  The data set is smaller than the run (9 samples, 2 per micro-batch), so the resumed run continues
  mid-epoch and then crosses into the next shuffled epoch at the right sample.  Each rank's RNG state is saved
  and restoring it gives that state back.  The same through DeepSpeed's engine under ZeRO 3 (AutoSP's parameter
  shards: each rank saves its own, as a model-parallel rank) with gradient accumulation and the ring
  (``--zero-stage 3 --grad-accum 2 --strategy ring``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from autosp.errors import AutoSPError
from autosp.examples.train_lm import ByteTokenizer, HFTokenizer, pack, read_documents
from tests.harness import run_on_ranks

WORDS = "the quick brown fox jumps over a lazy dog while sequence parallel training splits tokens".split()


def _corpus(path: Path, documents: int = 16, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    text = "\n\n".join(" ".join(rng.choice(WORDS, size=int(rng.integers(3, 12)))) for _ in range(documents))
    path.write_text(text + "\n", encoding="utf-8")
    return path


def test_read_documents_from_text_jsonl_and_npy(tmp_path):
    (tmp_path / "a.txt").write_text("ab\ncd\n\nef\n\n\ngh\n", encoding="utf-8")
    byte = ByteTokenizer()
    enc = byte.encode
    assert read_documents([str(tmp_path / "a.txt")], byte) == [enc("ab\ncd"), enc("ef"), enc("gh")]
    assert read_documents([str(tmp_path / "a.txt")], byte, text_split="line") == [enc(s) for s in
                                                                                  ("ab", "cd", "ef", "gh")]
    assert read_documents([str(tmp_path / "a.txt")], byte, text_split="file") == [enc("ab\ncd\n\nef\n\n\ngh\n")]
    (tmp_path / "b.jsonl").write_text('[1, 2, 3]\n{"input_ids": [4, 5]}\n\n{"text": "hi"}\n', encoding="utf-8")
    np.save(tmp_path / "c.npy", np.array([7, 8, 9], dtype=np.int32))
    np.save(tmp_path / "d.npy", np.array([[1, 2], [3, 4]], dtype=np.int64))
    got = read_documents([str(tmp_path / "b.jsonl"), str(tmp_path / "c.npy"), str(tmp_path / "d.npy")], byte)
    assert got == [[1, 2, 3], [4, 5], enc("hi"), [7, 8, 9], [1, 2], [3, 4]]
    # A folder: its data files in name order.
    assert read_documents([str(tmp_path)], byte)[:3] == [enc("ab\ncd"), enc("ef"), enc("gh")]
    (tmp_path / "bad.jsonl").write_text('{"ids": [1]}\n', encoding="utf-8")
    with pytest.raises(AutoSPError, match="bad.jsonl line 1"):
        read_documents([str(tmp_path / "bad.jsonl")], byte)


def test_hf_tokenizer_from_a_local_folder(tmp_path):
    import tokenizers
    import transformers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    (tmp_path / "t.txt").write_text("the lazy dog\n\nsplits zebra tokens\n", encoding="utf-8")
    docs = read_documents([str(tmp_path / "t.txt")], HFTokenizer(str(tmp_path / "tok")))
    assert docs == [[vocab["the"], vocab["lazy"], vocab["dog"]], [vocab["splits"], 0, vocab["tokens"]]]


def test_pack_restarts_positions_per_document_and_ignores_cross_document_targets():
    docs = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]]
    packed = pack(docs, 4)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]  # 13 left out
    # The second document does not fit the first sample: it continues in the next one as a new document.
    assert packed.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 0, 0]]
    assert packed.labels.tolist() == [[-100, 2, 3, -100], [-100, 6, 7, 8], [-100, 10, -100, -100]]
    with pytest.raises(AutoSPError, match="fewer than one sample"):
        pack([[1, 2]], 4)


STEPS, SAVE_AT = 6, 3


def _params(output_dir: Path, step: int, zero: bool) -> dict[str, torch.Tensor]:
    tag = output_dir / "checkpoints" / f"step-{step:08d}"
    if zero:  # one file per rank, each holding its shards
        files = sorted(tag.glob("mp_rank_*_model_states.pt"))
        assert len(files) == 2, files
        return {f"{f.name}:{k}": v for f in files for k, v in torch.load(f, weights_only=False)["module"].items()}
    return torch.load(tag / "state.pt", weights_only=False)["model"]


def _runs_on_rank(rank, world, data, base, variants):
    import torch._dynamo
    import torch.distributed as dist

    from autosp.examples.train_lm import parse_args, set_rng_state, train

    os.environ["LOCAL_RANK"] = str(rank)  # one node: what torchrun sets (DeepSpeed reads it)
    out = {}
    for name, extra in variants.items():
        common = ["--data", data, "--model", "tiny-llama", "--num-layers", "1", "--seq-len", "64",
                  "--micro-batch-size", "2", "--lr", "1e-2", "--warmup", "2", "--log-interval", "2",
                  "--steps", str(STEPS), *extra]
        full, part = Path(base, f"{name}-full"), Path(base, f"{name}-part")
        runs = {"full": train(parse_args([*common, "--output-dir", str(full), "--save-every", str(SAVE_AT)]))}
        state_at_end = torch.get_rng_state()
        # The run is stopped after its step-3 checkpoint: what a crash before step 6 leaves behind.
        if rank == 0:
            tag = f"step-{SAVE_AT:08d}"
            shutil.copytree(full / "checkpoints" / tag, part / "checkpoints" / tag)
            (part / "checkpoints" / "latest").write_text(tag + "\n")
        dist.barrier()
        torch._dynamo.reset()
        torch.rand(3)  # move the generator on: resuming must not depend on it
        runs["resumed"] = train(parse_args([*common, "--output-dir", str(part), "--resume"]))
        torch._dynamo.reset()
        torch.rand(3)  # move the generator on: restoring must bring it back
        set_rng_state(torch.load(full / "checkpoints" / f"step-{STEPS:08d}" / f"rng-rank{rank:05d}.pt",
                                 weights_only=False))
        runs["rng_restored"] = torch.equal(torch.get_rng_state(), state_at_end)
        out[name] = runs
    return out


@pytest.mark.slow
def test_resumed_run_equals_an_uninterrupted_one(tmp_path):
    data = _corpus(tmp_path / "corpus.txt")
    assert len(pack(read_documents([str(data)], ByteTokenizer()), 64)) == 9  # fewer than the 12 the run reads
    # --strategy reaches the compile on both paths: the DeepSpeed one trains with the ring here.
    variants = {"plain": [], "zero3": ["--zero-stage", "3", "--grad-accum", "2", "--strategy", "ring"]}
    results = run_on_ranks(_runs_on_rank, 2, str(data), str(tmp_path), variants, timeout_s=400)
    for name, extra in variants.items():
        zero = bool(extra)
        full, part = tmp_path / f"{name}-full", tmp_path / f"{name}-part"
        for rank_result in results:
            runs = rank_result[name]
            assert runs["rng_restored"], f"{name}: the checkpoint's RNG state did not come back"
            assert runs["full"]["steps"] == runs["resumed"]["steps"] == STEPS
            assert runs["full"]["strategy"] == runs["resumed"]["strategy"] == ("ring" if zero else "ulysses")
            # the same losses step by step: the resumed run saw the same samples in the same order
            assert runs["resumed"]["losses"] == runs["full"]["losses"][SAVE_AT:], name
        assert runs["full"]["losses"][-1] < runs["full"]["losses"][0], f"{name}: the loss did not go down"
        # the resumed run ends where the uninterrupted one does, parameters and optimizer state
        resumed = _params(part, STEPS, zero)
        for key, value in _params(full, STEPS, zero).items():
            assert torch.equal(value, resumed[key]), f"{name}: parameter {key} differs after resuming"
        if not zero:
            a = torch.load(full / "checkpoints" / f"step-{STEPS:08d}" / "state.pt", weights_only=False)
            b = torch.load(part / "checkpoints" / f"step-{STEPS:08d}" / "state.pt", weights_only=False)
            for i, s in a["optimizer"]["state"].items():
                assert all(torch.equal(s[k], b["optimizer"]["state"][i][k]) for k in s)
            assert a["scheduler"] == b["scheduler"]
        assert (part / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS:08d}"
        state = json.loads((part / "checkpoints" / f"step-{STEPS:08d}" / "trainer_state.json").read_text())
        assert state["micro_batches"] == STEPS * (2 if zero else 1)
        lines = [json.loads(ln) for ln in (part / "metrics.jsonl").read_text().splitlines()]
        assert [ln["step"] for ln in lines] == [4, 6]  # every 2nd step and the last
        assert all(ln["tokens_per_s"] > 0 and len(ln["peak_memory_per_rank"]) == 2 for ln in lines)
