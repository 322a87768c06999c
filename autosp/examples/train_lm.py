"""``python -m autosp.examples.train_lm``: train a causal LM on your own data with AutoSP, save and resume.

An example training script on the public API (`autosp.compile`, `autosp.prepare_inputs`,
`autosp.sequence_parallel_sampler`, `autosp.deepspeed_initialize`) and the model
presets and launcher helpers of `autosp.train`: copy it and put your model and data in place of these.  Launch it with torchrun (one process per GPU, or gloo ranks on CPU):

    torchrun --standalone --nproc-per-node 2 -m autosp.examples.train_lm \\
        --data corpus.txt --output-dir runs/demo --model tiny-llama --seq-len 256 --steps 20 --save-every 10
    # ... interrupted?  The same command with --resume continues from the latest checkpoint.

What it does, step by step (docs/guide.md, "Train on your data"):

- data: local files (``.txt`` and other text, ``.jsonl``, ``.npy``, or folders of them), tokenised with a
  byte-level tokenizer (ids 0..255, nothing to download) or a Hugging Face tokenizer from a local folder
  (``--tokenizer DIR``), or already token ids (``.npy``; ``.jsonl`` lines of ids);
- packing: documents are concatenated into samples of ``--seq-len`` tokens; each sample's position ids
  restart at every document, so the model attends within documents only, and a document's first token is
  not a target of the previous document's last (its label is -100).  A document that does not fit continues
  in the next sample as a new document; the tokens after the last full sample are dropped;
- every rank of an SP group trains the same samples (`autosp.sequence_parallel_sampler`), data-parallel
  replicas different ones, shuffled per epoch;
- AdamW with linear warm-up, gradient clipping, gradient accumulation; with ``--zero-stage`` DeepSpeed ZeRO
  0-2 through `autosp.deepspeed_initialize`;
- logs loss, tokens/s and every rank's peak memory, and writes them to ``OUTPUT_DIR/metrics.jsonl``;
- checkpoints every ``--save-every`` steps under ``OUTPUT_DIR/checkpoints/step-NNNNNNNN/`` (model, optimizer,
  learning-rate schedule, data position, step, every rank's RNG states); ``--resume`` continues from the one
  named in ``OUTPUT_DIR/checkpoints/latest``, and the resumed run's parameters equal an uninterrupted run's
  (``tests/autosp/test_train_script.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import autosp
from autosp import entry
from autosp.errors import AutoSPError
from autosp.presets import build_model, hf_config
from autosp.train import init_distributed, peak_memory

log = logging.getLogger("autosp.examples.train_lm")

IGNORE_INDEX = -100
TEXT_SPLITS = ("paragraph", "line", "file")
DATA_SUFFIXES = (".txt", ".md", ".text", ".jsonl", ".npy")
CHECKPOINTS = "checkpoints"
LATEST = "latest"  # the file naming the newest complete checkpoint (DeepSpeed's convention too)


# ----------------------------------------------------------------------------------------------- data

class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: no vocabulary file, nothing to download."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A Hugging Face tokenizer saved in a local folder (``tokenizer.save_pretrained(DIR)``)."""

    def __init__(self, path: str):
        import transformers

        self._tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]


def data_files(paths: list[str]) -> list[Path]:
    """The files named, folders expanded to their data files (sorted, recursively)."""
    files = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
            if not found:
                raise AutoSPError(f"--data {name}: the folder holds no data file ({', '.join(DATA_SUFFIXES)})")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise AutoSPError(f"--data {name}: no such file or folder")
    return files


def _ids(value, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise AutoSPError(f"{where}: expected a list of integer token ids")
    return value


def read_documents(paths: list[str], tokenizer, *, text_split: str = "paragraph") -> list[list[int]]:
    """Token ids of every document in ``paths``, in order.

    Text files are split into documents by ``text_split``: "paragraph" (at blank lines), "line" or "file".
    A ``.jsonl`` line is a list of ids, or an object with "input_ids" (ids) or "text" (tokenised).  A ``.npy``
    file is a 1-D integer array (one document) or a 2-D one (a document per row).  Empty documents are skipped.
    """
    documents: list[list[int]] = []
    for path in data_files(paths):
        if path.suffix == ".npy":
            array = np.load(path, allow_pickle=False)
            if array.ndim not in (1, 2) or not np.issubdtype(array.dtype, np.integer):
                raise AutoSPError(f"{path}: expected a 1-D or 2-D integer array of token ids, got {array.ndim}-D "
                                  f"{array.dtype}")
            documents += [row.tolist() for row in array.reshape(-1, array.shape[-1])]
        elif path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    where = f"{path} line {number}"
                    record = json.loads(line)
                    if isinstance(record, dict) and "input_ids" in record:
                        documents.append(_ids(record["input_ids"], where))
                    elif isinstance(record, dict) and isinstance(record.get("text"), str):
                        documents.append(tokenizer.encode(record["text"]))
                    elif isinstance(record, list):
                        documents.append(_ids(record, where))
                    else:
                        raise AutoSPError(f"{where}: expected a list of token ids or an object with 'input_ids' "
                                          "or 'text'")
        else:
            text = path.read_text(encoding="utf-8")
            if text_split == "file":
                parts = [text]
            elif text_split == "line":
                parts = text.splitlines()
            else:
                parts, current = [], []
                for line in text.splitlines():
                    if line.strip():
                        current.append(line)
                    elif current:
                        parts.append("\n".join(current))
                        current = []
                if current:
                    parts.append("\n".join(current))
            documents += [tokenizer.encode(part) for part in parts if part.strip()]
    return [doc for doc in documents if doc]


@dataclass
class PackedSamples(torch.utils.data.Dataset):
    """Samples of ``seq_len`` tokens packed from documents: ids, labels, and positions restarting per document."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index],
                "position_ids": self.position_ids[index]}


def pack(documents: list[list[int]], seq_len: int) -> PackedSamples:
    """Concatenate ``documents`` into samples of ``seq_len`` tokens (see the module docstring for the rules)."""
    ids: list[int] = []
    positions: list[int] = []
    for doc in documents:
        done = 0
        while done < len(doc):
            room = seq_len - len(ids) % seq_len  # a document that does not fit restarts in the next sample
            piece = doc[done:done + room]
            ids += piece
            positions += range(len(piece))
            done += len(piece)
    samples = len(ids) // seq_len
    if samples == 0:
        raise AutoSPError(f"the data holds {len(ids)} tokens, fewer than one sample of --seq-len {seq_len}: give "
                          "more data or a shorter --seq-len")
    dropped = len(ids) - samples * seq_len
    if dropped:
        log.info("packing: %d samples of %d tokens; the last %d tokens do not fill a sample and are left out",
                 samples, seq_len, dropped)
    input_ids = torch.tensor(ids[:samples * seq_len], dtype=torch.long).view(samples, seq_len)
    position_ids = torch.tensor(positions[:samples * seq_len], dtype=torch.long).view(samples, seq_len)
    labels = input_ids.clone()
    labels[position_ids == 0] = IGNORE_INDEX  # no target across a document border
    return PackedSamples(input_ids, labels, position_ids)


def micro_batch(dataset: PackedSamples, sampler, index: int, size: int) -> dict[str, torch.Tensor]:
    """Micro-batch number ``index`` of the whole run (epochs follow one another), ``size`` samples.

    The data position is this one number: a resumed run continues at the next index.
    """
    per_epoch = len(sampler) // size
    if per_epoch == 0:
        raise AutoSPError(f"one data-parallel replica gets {len(sampler)} samples per epoch, fewer than "
                          f"--micro-batch-size {size}: give more data or a shorter --seq-len")
    epoch, offset = divmod(index, per_epoch)
    sampler.set_epoch(epoch)
    chosen = list(sampler)[offset * size:(offset + 1) * size]
    rows = [dataset[i] for i in chosen]
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


# ----------------------------------------------------------------------------------------- checkpoints

def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint folder named by ``checkpoints/latest`` (written after the checkpoint is complete)."""
    latest = output_dir / CHECKPOINTS / LATEST
    if not latest.is_file():
        return None
    path = output_dir / CHECKPOINTS / latest.read_text().strip()
    if not path.is_dir():
        raise AutoSPError(f"{latest} names {path.name}, which does not exist; delete {latest} to start over or "
                          "point it at a complete checkpoint")
    return path


def save_checkpoint(output_dir: Path, step: int, state: dict, *, model, optimizer, scheduler, engine) -> Path:
    """Write checkpoint ``step`` (every rank calls this); ``latest`` names it once every rank has written."""
    tag = f"step-{step:08d}"
    root = output_dir / CHECKPOINTS
    path = root / tag
    rank = dist.get_rank()
    if engine is not None:  # DeepSpeed writes model, (partitioned) optimizer, schedule and our state itself
        engine.save_checkpoint(str(root), tag=tag, client_state={"trainer": state}, save_latest=False)
    elif rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "trainer": state}, path / "state.pt")
    dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path / f"rng-rank{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        (path / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
        tmp = root / f"{LATEST}.tmp"
        tmp.write_text(tag + "\n")
        tmp.replace(root / LATEST)
    dist.barrier()
    log.info("saved checkpoint %s", path)
    return path


def load_checkpoint(path: Path, *, model, optimizer, scheduler, engine) -> dict:
    """Restore what `save_checkpoint` wrote; returns the trainer state (step, data position)."""
    rank = dist.get_rank()
    if engine is not None:
        loaded, client = engine.load_checkpoint(str(path.parent), tag=path.name)
        if loaded is None:
            raise AutoSPError(f"DeepSpeed could not load the checkpoint {path}")
        state = client["trainer"]
    else:
        saved = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        state = saved["trainer"]
    rng_file = path / f"rng-rank{rank:05d}.pt"
    if not rng_file.is_file():
        raise AutoSPError(f"{path} has no RNG state of rank {rank}: resume with the world size it was saved with "
                          f"({state.get('world_size')} ranks)")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return state


# ------------------------------------------------------------------------------------------- training

def build_parser() -> argparse.ArgumentParser:
    p = entry.ArgumentParser(
        prog="python -m autosp.examples.train_lm", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a causal LM on local data with AutoSP (sequence parallelism): packed documents,\n"
                    "checkpoints, resume. Run it under torchrun (NCCL on GPUs, gloo on CPU) or plainly as one rank.\n"
                    "The model is a Hugging Face model from a preset or a config.json, random weights; nothing is\n"
                    "downloaded.",
        epilog="examples:\n"
               "  torchrun --standalone --nproc-per-node 2 -m autosp.examples.train_lm \\\n"
               "      --data corpus.txt --output-dir runs/demo --model tiny-llama --seq-len 256 --steps 20 \\\n"
               "      --save-every 10\n"
               "  # the same command with --resume continues from runs/demo/checkpoints/latest\n"
               "Outputs in OUTPUT_DIR: run.json (the settings), metrics.jsonl (loss, tokens/s, peak memory per\n"
               "rank), checkpoints/step-NNNNNNNN/ and checkpoints/latest.")
    data = p.add_argument_group("data")
    data.add_argument("--data", nargs="+", required=True, metavar="PATH",
                      help="data files or folders: text (.txt, .md, any other suffix), .jsonl (a list of ids, or "
                           "an object with input_ids or text, per line), .npy (integer token ids, 1-D: one "
                           "document, 2-D: one per row)")
    data.add_argument("--tokenizer", metavar="DIR",
                      help="a local folder with a Hugging Face tokenizer for text (default: bytes, ids 0..255)")
    data.add_argument("--text-split", choices=TEXT_SPLITS, default="paragraph",
                      help="where text files split into documents: paragraph (blank lines), line, or file "
                           "(default: %(default)s)")
    data.add_argument("--seq-len", type=int, default=1024,
                      help="tokens per packed sample, the full sequence before sharding (default: %(default)s)")
    model = p.add_argument_group("model and parallelism")
    entry.add_model_arguments(model)
    model.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3),
                       help="train through DeepSpeed with this ZeRO stage; 3: AutoSP's parameter shards, gathered "
                            "inside the compiled step, under DeepSpeed's engine (default: plain PyTorch, no DeepSpeed)")
    model.add_argument("--compiler", choices=("aot_eager", "inductor"), default="aot_eager",
                       help="backend AutoSP hands its graphs to; a packed sample runs under aot_eager either "
                            "way (AutoSP chooses it per batch: Inductor does not compile document masks yet), "
                            "so inductor only adds its compile time here (default: %(default)s)")
    entry.add_sp_arguments(
        model, strategy_help="how a sequence is split over its SP ranks: ulysses (attention heads), ring (zig-zag "
                             "ring attention: more SP ranks than key-value heads, or the longest sequences), hybrid "
                             "(Ulysses inside groups of --ulysses-size ranks, ring across them) or auto (the "
                             "planner chooses on the first batch) (default: ulysses)")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=100, help="optimizer steps in all (default: %(default)s)")
    train.add_argument("--micro-batch-size", type=int, default=1,
                       help="samples per SP group per micro-batch (default: %(default)s)")
    train.add_argument("--grad-accum", type=int, default=1,
                       help="micro-batches per optimizer step (default: %(default)s)")
    train.add_argument("--lr", type=float, default=3e-4, help="AdamW peak learning rate (default: %(default)s)")
    train.add_argument("--warmup", type=int, default=0,
                       help="steps of linear learning-rate warm-up from 0 (default: %(default)s)")
    train.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: %(default)s)")
    train.add_argument("--max-grad-norm", type=float, default=1.0,
                       help="clip the gradient norm to this; 0 turns clipping off (default: %(default)s)")
    train.add_argument("--seed", type=int, default=0,
                       help="seed of the weights and the data order (default: %(default)s)")
    out = p.add_argument_group("output")
    out.add_argument("--output-dir", required=True, metavar="DIR",
                     help="where run.json, metrics.jsonl and checkpoints/ go")
    out.add_argument("--save-every", type=int, default=0,
                     help="save a checkpoint every N steps, and after the last step (default: %(default)s: only "
                          "after the last step)")
    out.add_argument("--resume", action="store_true",
                     help="continue from OUTPUT_DIR/checkpoints/latest (start afresh if there is none)")
    out.add_argument("--log-interval", type=int, default=10, help="log every N steps (default: %(default)s)")
    entry.add_launcher_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    entry.require_at_least(p, args, ("seq_len", "steps", "micro_batch_size", "grad_accum", "log_interval", "sp_size",
                                     "num_layers"), 1)
    entry.require_at_least(p, args, ("save_every", "warmup", "max_grad_norm", "weight_decay"), 0)
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        p.error(f"--tokenizer {args.tokenizer}: not a folder (save a tokenizer with save_pretrained(DIR))")
    for name in args.data:
        if not os.path.exists(name):
            p.error(f"--data {name}: no such file or folder")
    return args


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def train(args: argparse.Namespace) -> dict:
    """The whole run on this rank; returns the summary (the same on every rank but its memory figures)."""
    device = _device() if dist.is_initialized() else init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    sp_size = args.sp_size or world
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    output_dir = Path(args.output_dir)
    resume_from = latest_checkpoint(output_dir) if args.resume else None
    if not args.resume and (output_dir / CHECKPOINTS / LATEST).exists():
        raise AutoSPError(f"{output_dir} holds checkpoints of an earlier run: pass --resume to continue it, or "
                          "another --output-dir")

    tokenizer = HFTokenizer(args.tokenizer) if args.tokenizer else ByteTokenizer()
    dataset = pack(read_documents(args.data, tokenizer, text_split=args.text_split), args.seq_len)
    config = hf_config(args.model, seq_len=args.seq_len, num_layers=args.num_layers)
    config.use_cache = False  # the packed-document mask is read from the position ids (docs/guide.md, "packed documents")
    top = int(dataset.input_ids.max())
    if top >= config.vocab_size:
        raise AutoSPError(f"the data holds token id {top}, outside the model's vocabulary of {config.vocab_size}: "
                          "use a tokenizer that fits the model, or a model config with a larger vocab_size")

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    model = build_model(config, device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / args.warmup) if args.warmup else 1.0)
    engine = None
    compile_options = {"compiler": args.compiler, **{name: value for name, value in (
        ("strategy", args.strategy), ("ulysses_size", args.ulysses_size)) if value is not None}}
    if args.zero_stage is not None:
        ds_config = {
            "train_micro_batch_size_per_gpu": args.micro_batch_size,
            "gradient_accumulation_steps": args.grad_accum,
            "sequence_parallel_size": sp_size,
            "zero_optimization": {"stage": args.zero_stage},
            "autosp": compile_options,
            "gradient_clipping": args.max_grad_norm,
            "bf16": {"enabled": dtype == torch.bfloat16},
            "steps_per_print": 10**9,
        }
        entry.announce_deepspeed_comm_build(log)  # a first run's C++ build, announced
        with entry.without_build_notices(log):
            engine, optimizer, _, scheduler = autosp.deepspeed_initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
        sp_model = engine.module
    else:
        sp_model = autosp.compile(model, sp_size=sp_size, **compile_options)
    groups = sp_model.groups
    sampler = autosp.sequence_parallel_sampler(dataset, groups, shuffle=True, seed=args.seed, drop_last=True)

    step, micro_batches = 0, 0
    if resume_from is not None:
        state = load_checkpoint(resume_from, model=model, optimizer=optimizer, scheduler=scheduler, engine=engine)
        step, micro_batches = state["step"], state["micro_batches"]
        log.info("resumed from %s: step %d, micro-batch %d", resume_from, step, micro_batches)
    elif args.resume:
        log.info("--resume: no checkpoint in %s, starting afresh", output_dir)

    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        settings = {**{k: v for k, v in vars(args).items() if k != "local_rank"}, "world_size": world,
                    "sp_size": groups.sp_size, "dp_size": groups.dp_size, "dtype": str(dtype).removeprefix("torch."),
                    "device": device.type, "samples": len(dataset), "parameters": sum(p.numel() for p in model.parameters())}
        (output_dir / "run.json").write_text(json.dumps(settings, indent=2) + "\n")
    log.info("%s: %d layers, world %d = SP %d x DP %d, %d samples of %d tokens, %s, %s, %s", args.model,
             config.num_hidden_layers, world, groups.sp_size, groups.dp_size, len(dataset), args.seq_len,
             f"ZeRO {args.zero_stage}" if engine is not None else "no DeepSpeed", args.compiler,
             str(dtype).removeprefix("torch."))

    tokens_per_step = groups.dp_size * args.micro_batch_size * args.grad_accum * args.seq_len  # sequences once
    if step < args.steps:
        entry.announce_first_compile(sp_model, log)
    window_start, window_steps, losses = time.perf_counter(), 0, []
    metrics = open(output_dir / "metrics.jsonl", "a") if rank == 0 else None  # noqa: SIM115 - closed below
    try:
        while step < args.steps:
            total = 0.0
            for _ in range(args.grad_accum):
                batch = {k: v.to(device) for k, v in micro_batch(dataset, sampler, micro_batches,
                                                                 args.micro_batch_size).items()}
                micro_batches += 1
                loss = sp_model(**autosp.prepare_inputs(batch["input_ids"], labels=batch["labels"],
                                                        position_ids=batch["position_ids"])).loss
                if engine is not None:
                    engine.backward(loss)
                    engine.step()
                else:
                    (loss / args.grad_accum).backward()
                total += loss.detach().item() / args.grad_accum
            if engine is None:  # gradients were reduced over the SP group by the model during backward
                if args.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            step += 1
            window_steps += 1
            losses.append(total)
            if step % args.log_interval == 0 or step == args.steps:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - window_start
                memory = [None] * world
                dist.all_gather_object(memory, peak_memory(device))
                record = {"step": step, "loss": total, "lr": scheduler.get_last_lr()[0],
                          "tokens_per_s": tokens_per_step * window_steps / elapsed, "peak_memory_per_rank": memory}
                log.info("step %d/%d  loss %.4f  %.1f tokens/s  peak memory per rank (MiB) %s", step, args.steps,
                         total, record["tokens_per_s"],
                         " ".join(f"{next(iter(m.values())) / 2**20:.0f}" for m in memory))
                if metrics is not None:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                window_start, window_steps = time.perf_counter(), 0
            if (args.save_every and step % args.save_every == 0) or step == args.steps:
                save_checkpoint(output_dir, step, {"step": step, "micro_batches": micro_batches, "world_size": world},
                                model=model, optimizer=optimizer, scheduler=scheduler, engine=engine)
    finally:
        if metrics is not None:
            metrics.close()
    return {"steps": step, "losses": losses, "samples": len(dataset), "sp_size": groups.sp_size,
            "dp_size": groups.dp_size, "strategy": sp_model.config.strategy, "output_dir": str(output_dir)}


def main(argv: list[str] | None = None) -> int:
    """The command; a refusal (`AutoSPError`) exits 2 with one line (`autosp.entry.run`), not a traceback."""
    args = parse_args(argv)
    entry.configure_logging()
    entry.run(lambda: train(args), debug=args.debug)
    return 0


if __name__ == "__main__":
    sys.exit(main())
