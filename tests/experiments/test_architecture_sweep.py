"""The architecture sweep (python -m experiments.architecture_sweep): its small configs, its classification, and
a fixed subset of Hugging Face causal LMs on 2 real gloo ranks, none silent-wrong and none crashing."""

from __future__ import annotations

import pytest
import torch

from experiments import architecture_sweep as sweep

SUBSET = ("llama", "qwen2", "mixtral", "glm4_moe", "deepseek_v3", "gpt2", "mamba")
"""Dense decoders with GQA, a mixture of experts with its router loss, one with a grouped top-k router (row-wise
gathers, and an in-place ``scatter_`` written as a statement), DeepSeek-V3 (multi-head latent attention: keys
assembled per token in a buffer made like another), GPT-2 (refused today: Hugging Face logs a
warning inside its forward) and a state-space model (refused: a convolution over the sequence)."""


def _arch(name: str) -> sweep.Architecture:
    return next(a for a in sweep.architectures() if a.name == name)


def test_architecture_sweep_lists_one_row_per_config_class_with_the_config_own_name():
    archs = sweep.architectures()
    names = [a.name for a in archs]
    assert len(set(a.config_class for a in archs)) == len(archs)
    assert {"llama", "gpt2", "mixtral", "bert"} <= set(names) and "gpt-sw3" not in names  # gpt-sw3 is GPT2Config


def test_architecture_sweep_small_config_shrinks_sizes_by_field_name():
    llama = sweep.small_config("llama")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads,
            llama.intermediate_size, llama.vocab_size) == (64, 2, 4, 2, 128, 256)
    assert llama.use_cache is False and llama.max_position_embeddings >= sweep.SEQ_LEN
    gpt2 = sweep.small_config("gpt2")  # other names of the same sizes, and dropouts
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head) == (64, 2, 4)
    assert gpt2.attn_pdrop == gpt2.resid_pdrop == gpt2.embd_pdrop == 0.0
    bert = sweep.small_config("bert")
    assert bert.is_decoder and bert.hidden_dropout_prob == 0.0 and bert.pad_token_id == 0
    mixtral = sweep.small_config("mixtral")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok, mixtral.output_router_logits) == (4, 2, True)
    deepseek = sweep.small_config("deepseek_v3")  # latent attention: no grouped kv heads, one dense layer
    assert deepseek.num_key_value_heads == deepseek.num_attention_heads and deepseek.first_k_dense_replace == 1


def test_architecture_sweep_per_layer_lists_keep_each_kind_of_layer():
    assert sweep._per_layer(["linear", "linear", "linear", "full"] * 3) == ["linear", "full"]
    assert sweep._per_layer(["a"] * 6) == ["a", "a"]
    assert sweep._per_layer([{"x": 1}, {"x": 2}, {"x": 3}]) == [{"x": 1}, {"x": 2}]
    hybrid = sweep.small_config("qwen3_next")  # 3 linear-attention layers to each full one, cut to 2 layers
    assert sorted(set(hybrid.layer_types)) == ["full_attention", "linear_attention"]


def test_architecture_sweep_multimodal_wrappers_are_not_built():
    with pytest.raises(sweep.NotBuilt, match="multimodal wrapper: needs vision_config"):
        sweep.small_config("gemma3")


def test_architecture_sweep_compare_checks_every_gradient_and_zero_ones_against_zero():
    ref = {"a": torch.tensor([1.0, 2.0]), "z": torch.zeros(2)}
    same = sweep.compare(torch.tensor(1.0), torch.tensor(1.0), {k: v.clone() for k, v in ref.items()}, ref)
    assert same["failures"] == []
    off = sweep.compare(torch.tensor(1.0), torch.tensor(1.0), {"a": torch.tensor([1.0, 2.1]), "z": torch.zeros(2)},
                        ref)
    assert len(off["failures"]) == 1 and off["largest"][0] == "a" and off["largest"][1] == pytest.approx(0.1)
    nonzero = sweep.compare(torch.tensor(1.0), torch.tensor(1.0), {"a": ref["a"], "z": torch.ones(2)}, ref)
    assert nonzero["failures"] and nonzero["largest"] == ("z", 1.0)
    missing = sweep.compare(torch.tensor(1.0), torch.tensor(1.0), {"a": ref["a"]}, ref)
    assert any("one side only" in f for f in missing["failures"])
    nan = sweep.compare(torch.tensor(float("nan")), torch.tensor(1.0), ref, ref)
    assert nan["failures"]


def _ran(rank, failures=(), loss=1.0, largest=("loss", 0.0)):
    return {"rank": rank, "seconds": 1.0 + rank, "stage": "ran",
            "compared": {"failures": list(failures), "largest": largest, "loss": loss, "ref_loss": 1.0}}


def test_architecture_sweep_classifies_each_outcome():
    arch = sweep.Architecture("x", "XConfig", "XForCausalLM")
    assert sweep.classify(arch, [_ran(0), _ran(1)]).outcome == "exact"
    assert sweep.classify(arch, [_ran(0), _ran(1)]).seconds == 2.0
    wrong = sweep.classify(arch, [_ran(0), _ran(1, ["w: mismatch"], largest=("w", 0.5))])
    assert wrong.outcome == "silent-wrong" and "0.5 in w" in wrong.reason
    assert sweep.classify(arch, [_ran(0, loss=1.0), _ran(1, loss=1.5)]).outcome == "silent-wrong"
    refused = [{"rank": r, "seconds": 0.1, "stage": "refused", "message": "no rule for cumsum\nmore"}
               for r in range(2)]
    row = sweep.classify(arch, refused)
    assert (row.outcome, row.reason) == ("refused", "no rule for cumsum")
    crashed = [{"rank": r, "seconds": 0.1, "stage": "crash", "message": "RuntimeError: boom"} for r in range(2)]
    assert sweep.classify(arch, crashed).outcome == "crash"
    split = sweep.classify(arch, [refused[0], _ran(1)])
    assert split.outcome == "crash" and split.reason.startswith("ranks disagree")
    not_built = [{"rank": r, "seconds": 0.1, "stage": "not built", "message": "needs pixels"} for r in range(2)]
    assert sweep.classify(arch, not_built).outcome == "not built"


def test_architecture_sweep_subset_on_two_ranks_has_no_silent_wrong_and_no_crash():
    archs = [_arch(name) for name in SUBSET]
    rows = sweep.run_sweep(archs, chunk=len(archs), model_timeout_s=120)
    by_name = {r.architecture: r for r in rows}
    assert list(by_name) == list(SUBSET)
    counts = sweep.counts(rows)
    assert counts["silent-wrong"] == 0 and counts["crash"] == 0, sweep.table(rows)
    assert sum(counts.values()) == len(SUBSET) and set(counts) == set(sweep.OUTCOMES)
    assert {by_name[n].outcome for n in ("llama", "qwen2", "mixtral", "glm4_moe", "deepseek_v3")} == {"exact"}, sweep.table(rows)
    assert by_name["gpt2"].outcome in ("exact", "refused")
    assert by_name["mamba"].outcome == "refused" and "conv1d" in by_name["mamba"].reason
    assert all(r.reason for r in rows if r.outcome != "exact") and all(not r.reason for r in rows
                                                                      if r.outcome == "exact")


def test_architecture_sweep_a_failed_launch_is_run_again_one_architecture_per_launch(monkeypatch):
    archs = [sweep.Architecture(n, f"{n}Config", f"{n}ForCausalLM") for n in ("a", "hangs", "b")]
    launches = []

    def fake_run_on_ranks(fn, world, batch, seq_len, **_):
        launches.append([a.name for a in batch])
        if any(a.name == "hangs" for a in batch):
            raise sweep.RankFailure("1 of 2 ranks failed running sweep_on_rank:\n--- rank 0 ---\nno result after 9 s")
        return [[_ran(rank) for _ in batch] for rank in range(world)]

    monkeypatch.setattr(sweep, "run_on_ranks", fake_run_on_ranks)
    rows = sweep.run_sweep(archs, chunk=3)
    assert launches == [["a", "hangs", "b"], ["a"], ["hangs"], ["b"]]
    assert [(r.architecture, r.outcome) for r in rows] == [("a", "exact"), ("hangs", "crash"), ("b", "exact")]
    assert rows[1].reason == "launch failed: no result after 9 s"
