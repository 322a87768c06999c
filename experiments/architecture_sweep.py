"""Every causal-LM architecture of the installed Hugging Face transformers under AutoSP: exact, or refused.

    python -m experiments.architecture_sweep                      # every architecture (minutes)
    python -m experiments.architecture_sweep --only llama mixtral --json sweep.json
    python -m experiments.architecture_sweep --list

Each architecture of ``transformers.MODEL_FOR_CAUSAL_LM_MAPPING`` (config class -> model class, one row per
config class) is built from its config class's defaults shrunk by one generic table of field names
(`SMALL`: hidden 64, 2 layers, 4 heads and 2 kv heads, MLP 128, vocabulary 256, 4 experts with top-2,
dropout 0, no cache; `small_config`), with SDPA attention where the model class supports it, random weights
and nothing downloaded.  One training step on a 64-token sample (batch 1, labels = the input ids) runs on one
device over the whole sequence (the reference: loss and every gradient), and the same step of a deep copy
compiled by ``autosp.compile(model, sp_size=2, compiler="aot_eager")`` (default options) on 2 gloo ranks.  Each
architecture gets one outcome:

- exact: the loss and every gradient equal the reference on every rank (fp32 rtol 1e-4 / atol 1e-6, the
  project's tolerance, `TOL`);
- refused: autosp raised an AutoSPError (its first line is the reason);
- silent-wrong: it ran without an error and a loss or gradient differs (the largest difference and where);
- crash: any other exception, or ranks that hung, died or disagreed (type and first line);
- not built: the model cannot be built or run on one device from a small config without downloads (a
  multimodal wrapper that needs pixel or audio inputs, a config that refuses the small sizes, ...): not AutoSP's
  outcome, not counted among the four.

Many architectures share one launch of the ranks (``--chunk``), each in its own try/except with
torch._dynamo.reset() between them; a launch that fails (a rank hung or died) is run again one architecture
per launch, so one bad model costs its own launch and no other model's result.  Prints the table and the
counts; ``--json PATH`` writes them.  Exit status 1 when an architecture is silent-wrong or crashes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
import time
from dataclasses import dataclass

from experiments import cli
from experiments.gpu_validate.section_exactness import compare_with_reference
from experiments.launch import RankFailure, run_on_ranks

log = logging.getLogger(__name__)

SEQ_LEN = 64
SP_SIZE = 2
DEPTH = 2
"""Layers of every small config."""
TOL = {"rtol": 1e-4, "atol": 1e-6}
"""fp32 tolerance of the loss and every gradient: the project's (docs/guarantees.md, tests/autosp/test_equivalence.py)."""
SPECIAL_IDS = 4
"""Token ids 0..3 are the small config's special tokens (`SPECIAL_TOKENS`); the sample draws from the rest."""
OUTCOMES = ("exact", "refused", "silent-wrong", "crash", "not built")
FAILURES = ("silent-wrong", "crash")

SMALL = {
    # width
    **dict.fromkeys(("hidden_size", "n_embd", "n_embed", "d_model", "embed_dim", "emb_dim", "embedding_dim", "dim",
                     "word_embed_proj_dim", "embedding_size", "input_embedding_size", "output_embedding_size",
                     "hidden_size_global"), 64),
    # depth
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
                     "num_decoder_layers", "num_encoder_layers", "num_blocks"), DEPTH),
    # attention heads
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
                     "decoder_attention_heads", "encoder_attention_heads", "num_decoder_attention_heads",
                     "num_encoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads", "num_query_groups",
                     "multi_query_group_num"), 2),
    **dict.fromkeys(("head_dim", "d_head", "dim_head", "kv_channels", "attention_head_size", "attention_head_dim"),
                    16),
    "rotary_dim": 8,  # partial rotary embeddings (GPT-J, CodeGen): half of each head
    # multi-head latent attention (DeepSeek-style): its rotary part is head_dim wide
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 32,
    # MLP
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "d_ff", "dff",
                     "d_inner", "ffn_hidden_size", "dim_ff", "feed_forward_size", "intermediate_size_mlp",
                     "dense_intermediate_size"), 128),
    # mixture of experts: 4 experts, top-2, one shared expert and one expert group, every layer but the first sparse
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k",
                     "num_selected_experts"), 2),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group", "n_shared_experts"), 1),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_experts_intermediate_size",
                     "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size", "shared_intermediate_size"), 64),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers"), 1),
    "output_router_logits": True,  # the router's auxiliary loss in the loss, as MoE training runs
    "num_kv_shared_layers": 0,  # layers that reuse an earlier layer's keys and values need more than 2 layers
    "vocab_size": 256,
    # lengths
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
                     "context_length", "seq_length", "max_sequence_length"), 4 * SEQ_LEN),
    # training set-up
    "use_cache": False,
    "is_decoder": True,  # the BERT family's causal-LM heads are causal only as decoders (their own warning says so)
}
"""Config field -> its small value, applied to every config (and sub-config) that has the field."""

_DROPOUT = re.compile(r"dropout|pdrop|drop_prob|drop_rate|jitter")
"""Float fields that draw random numbers in training: set to 0 (`_small_value`)."""
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
"""Special token ids inside the small vocabulary; any other ``*_token_id`` or ``*_token_index`` beyond it is 3."""


DEPTH_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers")
"""Fields that hold a config's depth: a list field as long as the default depth is per layer (`_per_layer`)."""


def _small_value(key: str, value, depth: int | None = None):
    """The small value of config field ``key`` (default ``value``; ``depth``: the default config's depth), or
    ``value`` itself: `SMALL`, then the rules for per-layer lists, dropouts, vocabularies and special tokens."""
    if key in SMALL:
        return SMALL[key]
    if isinstance(value, bool):
        return value
    if isinstance(value, list) and depth is not None and depth > DEPTH and len(value) == depth:
        return _per_layer(value)
    if key == "mlp_only_layers" and isinstance(value, list):  # dense layers by index: at most the first
        return [i for i in value if i < 1]
    if isinstance(value, float) and _DROPOUT.search(key):
        return 0.0
    if isinstance(value, int) and "vocab" in key and value > SMALL["vocab_size"]:
        return SMALL["vocab_size"]
    if key in SPECIAL_TOKENS and value is not None:
        return [SPECIAL_TOKENS[key]] if isinstance(value, list) else SPECIAL_TOKENS[key]
    if (key.endswith(("_token_id", "_token_index")) and isinstance(value, int)
            and value >= SMALL["vocab_size"]):
        return SPECIAL_IDS - 1
    return value


def _per_layer(values: list) -> list:
    """A per-layer list cut to `DEPTH` layers: the first layer of each kind, in order (so that a hybrid keeps
    both of its kinds of layer), then the first layers."""
    try:
        kinds = list(dict.fromkeys(values))
    except TypeError:  # unhashable entries (per-layer dicts): the first layers
        kinds = []
    picked = [values.index(kind) for kind in kinds][:DEPTH]
    picked += [i for i in range(len(values)) if i not in picked][:DEPTH - len(picked)]
    return [values[i] for i in sorted(picked)]


def _shrunk(config) -> dict:
    """The fields of ``config`` (a default config) that `_small_value` changes, with their small values."""
    values = config.to_dict()
    depth = next((values[k] for k in DEPTH_FIELDS if isinstance(values.get(k), int)), None)
    out = {k: small for k, v in values.items() if (small := _small_value(k, v, depth)) is not v and small != v}
    if "kv_lora_rank" in values and "num_key_value_heads" in values:
        out["num_key_value_heads"] = SMALL["num_attention_heads"]  # latent attention has no grouped kv heads
    return out


OVERRIDES = {
    # Models whose small config needs one more field than `SMALL` gives (each a fact of the model, not a choice):
    "mamba2": {"num_heads": 8},  # its SSM heads x head_dim must equal 2 x hidden (128 = 8 x 16)
    "zaya": {"num_experts_per_tok": 1},  # the config refuses any other top-k
    "zamba": {"layers_block_type": ["hybrid", "hybrid"]},  # its shared block is tied across hybrid layers: two
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [8, 8]},  # sums to hidden 64, 8 x 8 = 64 tokens
    # Default configs that do not build their own model (the released configs give these fields):
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
}
"""Architecture -> config fields set over `SMALL`'s (a dict merges into a sub-config's)."""


MULTIMODAL = ("vision", "audio", "image", "video", "speech", "vq")
"""A sub-config whose name holds one of these is another modality's tower: the wrapper is not built."""


class NotBuilt(Exception):
    """The architecture cannot be built and run on one device from a small config without downloads."""


@dataclass(frozen=True)
class Architecture:
    name: str
    """The model type (``"llama"``): the config class's own where several names share it."""
    config_class: str
    model_class: str


def architectures() -> list[Architecture]:
    """The causal-LM architectures of the installed transformers (``MODEL_FOR_CAUSAL_LM_MAPPING``: config class
    -> model class), one per config class, named by the config's own model type where several names share it
    (gpt-sw3 is GPT2Config: gpt2), sorted by name.  Imports the config classes only."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    by_config: dict[type, Architecture] = {}
    for name, model_class in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        model_class = model_class if isinstance(model_class, str) else model_class[0]
        config_class = CONFIG_MAPPING[name]
        if config_class not in by_config or name == config_class.model_type:
            by_config[config_class] = Architecture(name, config_class.__name__, model_class)
    return sorted(by_config.values(), key=lambda a: a.name)


def small_config(name: str, *, sdpa: bool = True):
    """The config of architecture ``name``: its class's defaults with `SMALL` applied, sub-configs included.

    Raises `NotBuilt` for a multimodal wrapper (a vision or audio sub-config) and for a config class that
    refuses the small sizes."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[name]
    towers = sorted(k for k in (getattr(config_class, "sub_configs", None) or {})
                    if any(word in k for word in MULTIMODAL))
    if towers:
        raise NotBuilt(f"multimodal wrapper: needs {', '.join(towers)} inputs")
    try:
        defaults = config_class()
    except Exception as err:  # noqa: BLE001 - any refusal of its own defaults is a reason not to build
        raise NotBuilt(f"its default config does not build: {_first_line(err)}") from err
    overrides = _shrunk(defaults)
    for key in getattr(config_class, "sub_configs", None) or {}:
        sub = getattr(defaults, key, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        # Only what changes, over the sub-config class's own defaults (its derived fields, such as per-layer
        # lists, follow the new sizes); an AutoConfig sub-config is named by its model type.
        sub_overrides = {**_shrunk(sub), **OVERRIDES.get(name, {}).get(key, {})}
        overrides[key] = {"model_type": sub.model_type, **sub_overrides} if sub_overrides else sub
    overrides.update({k: v for k, v in OVERRIDES.get(name, {}).items() if k not in overrides
                      or not isinstance(overrides[k], dict)})
    if sdpa:
        overrides["attn_implementation"] = "sdpa"
    try:
        return config_class(**overrides)
    except Exception as err:  # noqa: BLE001
        raise NotBuilt(f"the small config is refused: {_first_line(err)}") from err


def build(arch: Architecture):
    """A freshly initialised model of ``arch`` from `small_config`, in training mode (the caller seeds)."""
    import transformers

    model_class = getattr(transformers, arch.model_class, None)
    if model_class is None:
        raise NotBuilt(f"transformers has no {arch.model_class}")
    sdpa = bool(getattr(model_class, "_supports_sdpa", False))
    config = small_config(arch.name, sdpa=sdpa)
    try:
        model = model_class(config)
    except Exception as err:  # noqa: BLE001
        raise NotBuilt(f"{arch.model_class}(small config) fails: {_first_line(err)}"
                       f"{_default_also_fails(arch, model_class)}") from err
    languages = getattr(config, "languages", None)
    if hasattr(model, "set_default_language") and languages:  # X-MOD's adapters: the first language's
        model.set_default_language(languages[0])
    model.train()
    return model


def _default_also_fails(arch: Architecture, model_class) -> str:
    """" (so does its default config)" when the model does not build from its class's default config either
    (on the meta device: no memory)."""
    import torch
    from transformers import CONFIG_MAPPING

    try:
        with torch.device("meta"):
            model_class(CONFIG_MAPPING[arch.name]())
    except Exception:  # noqa: BLE001
        return " (so does its default config)"
    return ""


def sample(vocab: int, seq_len: int = SEQ_LEN):
    """One row of token ids drawn from the non-special ids (fixed seed); the labels are the ids."""
    import torch

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(SPECIAL_IDS, vocab, (1, seq_len), generator=g)
    return ids, ids.clone()


def _first_line(err: BaseException) -> str:
    """``Type: first line`` of an exception (with the line after it when the first one ends with a colon)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(err).__name__}: {text}"[:300]


def _loss(output):
    return output if hasattr(output, "backward") else output.loss


def compare(loss, ref_loss, grads: dict, ref_grads: dict) -> dict:
    """The loss and every gradient against the reference within `TOL` (`compare_with_reference`, as the
    project's tests compare them), a gradient the reference has as zero against zero; with the largest absolute
    difference and the tensor it is in."""
    import torch

    zero = {n for n, g in ref_grads.items() if not bool(g.abs().max() > 0)}
    checked = compare_with_reference(loss, ref_loss, {n: g for n, g in grads.items() if n not in zero},
                                     {n: g for n, g in ref_grads.items() if n not in zero}, TOL)
    failures = [f for f in checked["failures"] if "on one side only" not in f]
    if grads.keys() != ref_grads.keys():
        failures.append(f"gradients of {sorted(set(grads) ^ set(ref_grads))} on one side only")
    largest = ("loss", abs(float(loss) - float(ref_loss)))
    for name, ref in ref_grads.items():
        got = grads.get(name)
        if got is None:
            continue
        diff = float((got.detach().double() - ref.detach().double()).abs().max())
        if name in zero and diff > TOL["atol"]:
            failures.append(f"{name}: the single-device gradient is zero, this one reaches {diff:.3g}")
        if not diff <= largest[1]:  # NaN counts as largest
            largest = (name, diff)
    if not torch.isfinite(torch.as_tensor(float(loss))):
        failures.append(f"loss is {float(loss)}")
    return {"failures": failures, "largest": largest, "loss": float(loss), "ref_loss": float(ref_loss)}


@dataclass
class Reference:
    """A built model's single-device step: what AutoSP's step is compared with."""

    model: object
    candidate: object
    """A deep copy of the model taken before its step: what AutoSP compiles."""
    ids: object
    labels: object
    loss: object
    grads: dict


def reference_step(arch: Architecture, seq_len: int = SEQ_LEN) -> Reference:
    """Build ``arch`` (seed 0), copy it, and run one single-device step over the whole sample; a step that fails
    is `NotBuilt`."""
    import copy

    import torch

    torch.manual_seed(0)
    model = build(arch)
    candidate = copy.deepcopy(model)
    ids, labels = sample(model.config.get_text_config().vocab_size, seq_len)
    try:
        loss = _loss(model(input_ids=ids, labels=labels))
        loss.backward()
    except Exception as err:  # noqa: BLE001
        raise NotBuilt(f"the single-device step fails: {_first_line(err)}") from err
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Reference(model, candidate, ids, labels, loss.detach(), grads)


def _one_on_rank(arch: Architecture, world: int, seq_len: int) -> dict:
    """One architecture on this rank: the single-device reference step, the AutoSP step, compared."""
    import warnings

    import torch

    import autosp
    from autosp.errors import AutoSPError

    torch._dynamo.reset()
    warnings.filterwarnings("ignore")
    try:
        try:
            ref = reference_step(arch, seq_len)
        except NotBuilt as err:
            return {"stage": "not built", "message": str(err)}
        except Exception as err:  # noqa: BLE001 - the model's own problem, before AutoSP
            return {"stage": "not built", "message": f"building it fails: {_first_line(err)}"}
        try:
            compiled = autosp.compile(ref.candidate, sp_size=world, compiler="aot_eager")
            loss = _loss(compiled(**autosp.prepare_inputs(ref.ids, labels=ref.labels)))
            loss.backward()
        except AutoSPError as err:
            return {"stage": "refused", "message": str(err)}
        except Exception as err:  # noqa: BLE001 - a raw crash is an outcome
            return {"stage": "crash", "message": _first_line(err)}
        grads = {n: p.grad.detach().clone() for n, p in ref.candidate.named_parameters() if p.grad is not None}
        return {"stage": "ran", "compared": compare(loss.detach(), ref.loss, grads, ref.grads)}
    finally:
        torch._dynamo.reset()


def sweep_on_rank(rank: int, world: int, archs: list[Architecture], seq_len: int = SEQ_LEN) -> list[dict]:
    """Every architecture of ``archs`` on this rank, one after another (launched by `run_on_ranks`)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the small configs' warnings (token ids, unused fields) on every rank
    out = []
    for arch in archs:
        start = time.perf_counter()
        result = _one_on_rank(arch, world, seq_len)
        out.append({**result, "rank": rank, "seconds": time.perf_counter() - start})
    return out


@dataclass
class Row:
    architecture: str
    model_class: str
    outcome: str
    seconds: float
    reason: str = ""
    """exact: empty; refused: the AutoSPError's first line; silent-wrong: the largest difference and where;
    crash: the exception's type and first line; not built: why."""


def classify(arch: Architecture, per_rank: list[dict]) -> Row:
    """The outcome of one architecture from every rank's result (`_one_on_rank`)."""
    seconds = max(r["seconds"] for r in per_rank)
    stages = {r["stage"] for r in per_rank}

    def row(outcome, reason):
        return Row(arch.name, arch.model_class, outcome, seconds, reason)

    if len(stages) > 1:
        told = "; ".join(f"rank {r['rank']} {r['stage']}: {_head(r.get('message', ''))}" for r in per_rank)
        return row("crash", f"ranks disagree: {told}")
    stage = stages.pop()
    if stage in ("not built", "refused", "crash"):
        return row(stage, _head(per_rank[0]["message"]))
    failures = [f"rank {r['rank']}: {f}" for r in per_rank for f in r["compared"]["failures"]]
    losses = {r["compared"]["loss"] for r in per_rank}
    if len(losses) > 1:
        failures.append(f"the loss differs between ranks: {sorted(losses)}")
    if failures:
        worst = max((r["compared"]["largest"] for r in per_rank), key=lambda w: (w[1] != w[1], w[1]))
        return row("silent-wrong", f"largest difference {worst[1]:.3g} in {worst[0]}; {len(failures)} failures, "
                                   f"first: {failures[0]}"[:500])
    return row("exact", "")


def _head(message: str) -> str:
    lines = [line for line in str(message).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def counts(rows: list[Row]) -> dict[str, int]:
    return {outcome: sum(r.outcome == outcome for r in rows) for outcome in OUTCOMES}


def run_sweep(archs: list[Architecture], *, chunk: int = 8, model_timeout_s: float = 300.0,
              seq_len: int = SEQ_LEN, world: int = SP_SIZE) -> list[Row]:
    """Every architecture of ``archs`` on ``world`` gloo ranks, ``chunk`` per launch; a launch that fails is
    run again one architecture per launch, where a failure is that architecture's crash."""
    rows: list[Row] = []
    pending = list(archs)
    while pending:
        batch, pending = pending[:chunk], pending[chunk:]
        start = time.perf_counter()
        try:
            per_rank = run_on_ranks(sweep_on_rank, world, batch, seq_len, timeout_s=60 + model_timeout_s * len(batch),
                                    collective_timeout_s=model_timeout_s)
        except RankFailure as err:
            if len(batch) == 1:
                rows.append(_logged(Row(batch[0].name, batch[0].model_class, "crash", time.perf_counter() - start,
                                        f"launch failed: {_launch_story(err)}")))
                continue
            log.warning("a launch of %d architectures failed (%s); running them one per launch",
                        len(batch), _launch_story(err))
            rows += run_sweep(batch, chunk=1, model_timeout_s=model_timeout_s, seq_len=seq_len, world=world)
            continue
        for i, arch in enumerate(batch):
            rows.append(_logged(classify(arch, [r[i] for r in per_rank])))
    return rows


def _launch_story(err: RankFailure) -> str:
    """The last informative line of a failed launch (a rank's exception, or why it stopped)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith("---")]
    return lines[-1][:300] if lines else "no story"


def _logged(row: Row) -> Row:
    log.info("%-28s %-12s %6.1f s  %s", row.architecture, row.outcome, row.seconds, row.reason[:160])
    return row


def table(rows: list[Row]) -> str:
    width = max([len("architecture"), *(len(r.architecture) for r in rows)])
    lines = [f"{'architecture':<{width}}  {'outcome':<12}  {'seconds':>7}  reason"]
    lines += [f"{r.architecture:<{width}}  {r.outcome:<12}  {r.seconds:7.1f}  {_short(r.reason)}" for r in rows]
    lines.append("counts: " + ", ".join(f"{k} {v}" for k, v in counts(rows).items()))
    return "\n".join(lines)


def _short(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("experiments.architecture_sweep", __doc__)
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="run only these architectures (model types as --list shows them)")
    parser.add_argument("--list", action="store_true", help="list the architectures that would run, and exit")
    parser.add_argument("--json", metavar="PATH", help="write the rows and the counts to this JSON file "
                                                       "(nothing is written without it)")
    parser.add_argument("--chunk", type=int, default=8, help="architectures per launch of the ranks")
    parser.add_argument("--model-timeout", type=float, default=300.0,
                        help="seconds one architecture may take before its launch counts as hung")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.chunk < 1 or args.model_timeout <= 0:
        parser.error("--chunk must be at least 1 and --model-timeout positive")
    archs = architectures()
    if args.only:
        known = {a.name: a for a in archs}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            parser.error(f"--only: no causal-LM architecture named {', '.join(unknown)} (see --list)")
        archs = [known[n] for n in dict.fromkeys(args.only)]
    if args.list:
        for a in archs:
            print(f"{a.name:<28} {a.model_class}")
        return 0
    import transformers

    start = time.perf_counter()
    rows = run_sweep(archs, chunk=args.chunk, model_timeout_s=args.model_timeout)
    print(table(rows))
    print(f"transformers {transformers.__version__}, {len(rows)} architectures in {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transformers": transformers.__version__, "seq_len": SEQ_LEN, "sp_size": SP_SIZE,
                       "tolerance": TOL, "counts": counts(rows), "rows": [dataclasses.asdict(r) for r in rows]},
                      f, indent=1)
    return 1 if any(r.outcome in FAILURES for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
