import pytest

from experiments.models import PAPER_MODELS
from experiments.paper_scale.config import PAPER_CONFIG, static_memory_bytes, training_config


def test_zero_stages_follow_the_system():
    assert PAPER_CONFIG.zero_stage("autosp") == 1
    assert PAPER_CONFIG.zero_stage("ulysses") == 1
    assert PAPER_CONFIG.zero_stage("zero3") == 3
    with pytest.raises(ValueError, match="zero3"):  # another spelling is refused, not read as an SP system
        PAPER_CONFIG.zero_stage("ZeRO-3")
    assert PAPER_CONFIG.grad_accum_dtype is None


def test_static_memory_band_is_ordered_and_zero3_is_smaller():
    for model in PAPER_MODELS.values():
        cfg = training_config(model, "autosp")
        assert cfg.parameter_count > 1e9 and cfg.dp_world_size == PAPER_CONFIG.world_size
        low, nominal, high = (static_memory_bytes(model, "autosp", w) for w in ("low", "nominal", "high"))
        assert 0 < low <= nominal <= high
        assert static_memory_bytes(model, "zero3") < nominal


def test_peak_adds_activations_and_their_fragmentation_band():
    from experiments.paper_scale.config import peak_memory_bytes
    from simulator.device_reserve import UNCERTAIN

    model = PAPER_MODELS["llama-3.1-8b"]
    activations = 20 * 2**30
    frag = UNCERTAIN["fragmentation_fraction"]
    for which, fraction in (("low", frag.low), ("nominal", frag.nominal), ("high", frag.high)):
        added = peak_memory_bytes(model, "autosp", activations, which) - static_memory_bytes(model, "autosp", which)
        # the activations, their fragmentation share, and at most one 2 MiB segment of allocator rounding
        assert 0 <= added - activations * (1 + fraction) <= 2 * 2**20, which


def test_alternative_configuration_adds_bf16_optimizers_unpartitioned_fp32_gradients():
    from experiments.paper_scale.config import ALTERNATIVE_CONFIG

    model = PAPER_MODELS["llama-3.1-8b"]
    n = model.parameter_count()
    assert training_config(model, "autosp", ALTERNATIVE_CONFIG).wrapper == "BF16_Optimizer"
    assert training_config(model, "autosp").wrapper == "DeepSpeedZeroOptimizer"
    extra = static_memory_bytes(model, "autosp", config=ALTERNATIVE_CONFIG) - static_memory_bytes(model, "autosp")
    # fp32 buffer of every gradient (4 n) and the bf16 param.grad kept until the step (2 n), less the stated
    # configuration's partition gradients and ipg bucket (a few GB): between 4 n and 6 n bytes more
    assert 4 * n < extra < 6 * n


def test_public_configurations_split_the_node_and_name_their_source():
    from experiments.paper_scale.config import BAND_CONFIGS, PUBLIC_CONFIGS, SCRIPT_DEFAULT

    assert SCRIPT_DEFAULT in BAND_CONFIGS and set(BAND_CONFIGS) <= set(PUBLIC_CONFIGS)
    assert PUBLIC_CONFIGS[SCRIPT_DEFAULT].sp_size == 2 and PUBLIC_CONFIGS[SCRIPT_DEFAULT].sp_zero_stage == 0
    splits = {(c.sp_size, c.dp_size) for name, c in PUBLIC_CONFIGS.items() if name in BAND_CONFIGS}
    assert splits == {(8, 1), (4, 2), (2, 4)}
    model = PAPER_MODELS["llama-3.1-8b"]
    for name, config in PUBLIC_CONFIGS.items():
        assert config.provenance and config.sp_size * config.dp_size == config.world_size == 8, name
        # the fork's AutoSP shards over every rank, ZeRO-3 over none, the baselines over the configured SP
        assert config.sp_size_of("autosp", 8) == 8 and config.sp_size_of("zero3", 8) == 1
        assert config.sp_size_of("ulysses", 8) == config.sp_size_of("ring", 8) == config.sp_size
        # DeepSpeed partitions over every rank: the benchmark never hands it the SP groups
        cfg = training_config(model, "ulysses", config)
        assert cfg.dp_world_size == 8 and cfg.deepspeed == config.deepspeed
    assert training_config(model, "ulysses", PUBLIC_CONFIGS["fork-z0-sp8"]).wrapper == "BF16_Optimizer"
    assert training_config(model, "ulysses", PUBLIC_CONFIGS["fork-z1-sp4xdp2"]).wrapper == "DeepSpeedZeroOptimizer"
    assert training_config(model, "ulysses", PUBLIC_CONFIGS["current-z0-sp8"]).wrapper == "FP16_UnfusedOptimizer"
    assert training_config(model, "zero3", PUBLIC_CONFIGS["fork-z0-sp8"]).zero_stage == 3


def test_configuration_band_columns_and_closest():
    from experiments.paper_scale.config import configuration_band, consistent_configs

    published = [{"model": "m", "system": "ulysses", "value": "10000"},
                 {"model": "m", "system": "autosp", "value": "40000"}]
    lengths = {"a": {("m", "ulysses"): 6000, ("m", "autosp"): 41000},
               "b": {("m", "ulysses"): 13000, ("m", "autosp"): 90000},
               "c": {("m", "ulysses"): None, ("m", "autosp"): 20000},   # nothing fits: counted as 0 tokens
               "x": {("m", "ulysses"): 10000, ("m", "autosp"): 40000}}  # outside the band
    rows = configuration_band(published, lengths, band=("a", "b", "c"), script_default="b")
    assert [list(r)[:3] for r in rows] == [["model", "system", "published"]] * 2
    uly, asp = rows
    assert (uly["band_low"], uly["band_high"], uly["inside_band"]) == (0, 13000, "true")
    assert (uly["closest_config"], uly["closest_error"], uly["script_default"]) == ("b", "+30", 13000)
    assert uly["config:c"] == "" and uly["config:x"] == 10000
    assert (asp["band_low"], asp["band_high"], asp["closest_config"], asp["closest_error"]) == (20000, 90000, "a",
                                                                                                 "+2")
    tight = configuration_band(published, {"a": lengths["a"]}, band=("a",), script_default="a")
    assert tight[0]["inside_band"] == "false" and tight[1]["inside_band"] == "false"  # 41000 > 40000
    # a search's answer is the longest fitting multiple of its granularity: the band reaches the next one
    coarse = configuration_band(published, {"a": lengths["a"]}, band=("a",), script_default="a",
                                granularity={"ulysses": 4000, "autosp": 1024})
    assert [r["inside_band"] for r in coarse] == ["false", "false"]
    coarse = configuration_band(published, {"a": lengths["a"]}, band=("a",), script_default="a",
                                granularity={"ulysses": 4001, "autosp": 1024})
    assert [r["inside_band"] for r in coarse] == ["true", "false"]
    assert consistent_configs(rows, ("a", "b", "c", "x"), 0.2) == ["x"]
    assert consistent_configs(rows, ("a", "b"), 0.2) == []


def test_outside_evidence_names_the_ledger_items_at_the_probe_nearest_the_figure():
    from types import SimpleNamespace

    from experiments.paper_scale.config import configuration_band, outside_evidence

    model, capacity = PAPER_MODELS["llama-3.2-3b"], 80 * 2**30
    published = [{"model": model.name, "system": "ulysses", "value": "35000"}]
    rows = configuration_band(published, {"fork-z0-sp8": {(model.name, "ulysses"): 12288}}, band=("fork-z0-sp8",),
                              script_default="fork-z0-sp8")
    assert rows[0]["inside_band"] == "false"
    probes = {n: SimpleNamespace(dynamic_memory_bytes=n * 2**21) for n in (12288, 32768, 65536)}
    text = outside_evidence(rows[0], {"fork-z0-sp8": SimpleNamespace(steps=probes)}, model, capacity_bytes=capacity)
    # activations linear between the probes at 32768 and 65536 tokens: 70000 MiB at 35000 tokens
    assert "shorter maximum" in text and "35000 tokens (between its probes at 32768 and 65536)" in text
    assert "activations (simulated workload) 68.4 GiB" in text and "over the 80 GiB capacity" in text
    beyond = outside_evidence({**rows[0], "published": 70000}, {"fork-z0-sp8": SimpleNamespace(steps=probes)}, model,
                              capacity_bytes=capacity)
    assert "at 65536 tokens (its probe nearest 70000)" in beyond
    inside = {**rows[0], "inside_band": "true"}
    assert outside_evidence(inside, {"fork-z0-sp8": SimpleNamespace(steps=probes)}, model, capacity_bytes=capacity) \
        == ""


@pytest.mark.parametrize(("name", "hidden"), [("llama-3.2-3b", 96), ("llama-3.1-8b", 64), ("llama-2-13b", 64)])
def test_a_miniature_keeps_the_paper_models_proportions(name, hidden):
    """`experiments.models.miniature` (Note [Paper models in miniature]): vocabulary and MLP width divided by the
    hidden size's factor, the ratio of query to key-value heads and the tied head kept; the memory-cap table's
    model is the Llama-3.1-8B miniature."""
    from experiments.models import build_model, miniature

    paper = PAPER_MODELS[name]
    config = miniature(name, layers=1, hidden=hidden).config
    factor = paper.hidden_size / hidden
    assert (config.hidden_size, config.num_hidden_layers) == (hidden, 1)
    assert config.num_attention_heads >= 8 and hidden % config.num_attention_heads == 0
    assert abs(config.vocab_size - paper.vocab_size / factor) <= 0.5
    assert abs(config.intermediate_size - paper.intermediate_size / factor) <= 0.5
    assert config.num_attention_heads * paper.num_kv_heads == config.num_key_value_heads * paper.num_heads
    assert config.tie_word_embeddings == paper.tie_word_embeddings
    if name == "llama-3.1-8b":
        built = build_model("mini-llama-3.1-8b").config
        assert (built.vocab_size, built.intermediate_size, built.num_key_value_heads) == (2004, 224, 2)
    with pytest.raises(ValueError, match="query heads cannot keep"):
        miniature(name, hidden=hidden, heads=7)  # 7 keeps none of the three ratios and divides neither size
