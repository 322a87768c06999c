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
