from experiments.models import PAPER_MODELS
from experiments.paper_scale.config import PAPER_CONFIG, static_memory_bytes, training_config


def test_zero_stages_follow_the_system():
    assert PAPER_CONFIG.zero_stage("autosp") == 1
    assert PAPER_CONFIG.zero_stage("ulysses") == 1
    assert PAPER_CONFIG.zero_stage("zero3") == 3
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
