"""Activation offload at the full depth without tracing it: the program of a six-layer trace with its middle layer
replicated (Note [Unrolling a traced workload to the model's depth] in simulator/depth_unroll.py) equals the
program traced at eight layers, op for op, and so does its simulated step.

Small configs on fake tensors over 2 SP ranks (no downloads): a Llama (GQA, untied head) and a Qwen2-style model
(q/k/v biases, tied embeddings), each with activation offload under a checkpointing setting that tags every layer
alike.  Everything is compared exactly: the unrolled program is the traced one, so the simulator's answer is too.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest

from autosp.plan import TrainingSetup, load_cluster
from autosp.plan.model_source import ModelSource
from autosp.plan.step import _simulated, simulate_step
from autosp.plan.traces import trace_step
from simulator.depth_unroll import UNROLL_LAYERS, unroll_depth
from simulator.engine import simulate
from simulator.max_length import DepthExtrapolationError
from simulator.training_step import add_training_step
from simulator.validate import validate_workload

LAYERS = 8
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 4096, "attention_dropout": 0.0, "tie_word_embeddings": False,
}
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 160,
    "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
    "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
    "hidden_act": "silu", "attention_dropout": 0.0,
}
SETUP = TrainingSetup(seq_len=512, sp_size=2, zero_stage=2, compiler="aot_eager")


def _model(tmp_path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


_TRACED: dict[tuple, tuple] = {}


def _traced(tmp_path_factory, config: dict, checkpointing: str):
    """(source, training config, six-layer trace, full trace) with activation offload, traced once per module."""
    key = (config["model_type"], checkpointing)
    if key not in _TRACED:
        source = ModelSource(_model(tmp_path_factory.mktemp(config["model_type"]), config))
        training = SETUP.training_config(source.parameter_numels(source.config(seq_len=SETUP.seq_len)))
        options = {"activation_offload": "on", "checkpointing": checkpointing}
        _TRACED[key] = (source, training, *(trace_step(source, SETUP, seq_len=SETUP.seq_len, layers=layers,
                                                       config=training, options=options)
                                            for layers in (UNROLL_LAYERS, None)))
    return _TRACED[key]


def _canonical(workload) -> list[tuple]:
    """Every op but its name's counters and its collective's key (named by first appearance instead)."""
    keys: dict[str, int] = {}
    found = []
    for op in workload.program(0).ops:
        c = op.collective
        found.append((re.sub(r"(_\d+)?(@\d+)?$", "", op.name), op.kind, op.op_class, op.phase, op.flops,
                      op.bytes_read, op.bytes_written, op.attention_scores, op.deps, op.allocates, op.frees,
                      None if c is None else (c.kind, c.group, c.message_bytes, keys.setdefault(c.key, len(keys)))))
    return found


@pytest.mark.parametrize(("config", "checkpointing"), [(LLAMA, "none"), (QWEN2, "layer")])
def test_unrolled_program_and_step_equal_the_traced_full_depth(tmp_path_factory, config, checkpointing):
    _, training, shallow, full = _traced(tmp_path_factory, config, checkpointing)
    assert full.backward.program(0).host_tensors  # offload moved something
    unrolled, gradients = unroll_depth(shallow.backward, traced_layers=UNROLL_LAYERS, layers=LAYERS,
                                       gradients=shallow.gradients,
                                       static_memory=full.backward.program(0).static_memory)
    validate_workload(unrolled)
    ours, theirs = unrolled.program(0), full.backward.program(0)
    assert len(ours.ops) > len(shallow.backward.program(0).ops)
    assert _canonical(unrolled) == _canonical(full.backward)
    assert (ours.tensors, ours.host_tensors) == (theirs.tensors, theirs.host_tensors)
    assert sorted(map(dataclasses.astuple, gradients[0])) == sorted(map(dataclasses.astuple, full.gradients[0]))
    step = add_training_step(unrolled, gradients, training, group="dp", group_instances=[[0, 1]])
    cluster = load_cluster("h100-sxm", world_size=SETUP.world_size)
    a, b = simulate(step, cluster), simulate(full.step, cluster)
    assert (a.step_time_s, a.host_peak_memory_bytes) == (b.step_time_s, b.host_peak_memory_bytes)
    assert [r.peak_memory_bytes for r in a.ranks] == [r.peak_memory_bytes for r in b.ranks]


def test_the_planner_unrolls_activation_offload_and_predicts_the_full_depth(tmp_path_factory):
    """`autosp.plan.step.simulate_step` under ``depth="extrapolated"``: unrolled from six layers, not traced at
    eight, and the same step time and device and host activations as the eight-layer trace simulated."""
    source, training, _, full = _traced(tmp_path_factory, LLAMA, "none")
    cluster = load_cluster("h100-sxm", world_size=SETUP.world_size)
    fast = simulate_step(source, dataclasses.replace(SETUP, depth="extrapolated"), cluster, training, LAYERS,
                         SETUP.seq_len, {"activation_offload": "on", "checkpointing": "none"})
    step_s, _, dynamic, _, host = _simulated(full, SETUP, cluster, None)
    assert fast.unrolled_from == UNROLL_LAYERS and fast.extrapolated_from is None
    assert (fast.step_time_s, fast.dynamic_memory_bytes, fast.host_dynamic_memory_bytes) == (step_s, dynamic, host)
    assert host > 0


def test_a_trace_without_the_layer_structure_is_refused(tmp_path_factory):
    shallow = _traced(tmp_path_factory, LLAMA, "none")[2]
    program = shallow.backward.program(0)
    attention = next(i for i, op in enumerate(program.ops) if op.op_class == "attention")
    ops = list(program.ops)
    ops[attention] = dataclasses.replace(ops[attention], op_class="matmul")  # one layer without its attention
    broken = dataclasses.replace(shallow.backward, ranks={0: dataclasses.replace(program, ops=tuple(ops))})
    with pytest.raises(DepthExtrapolationError, match="attention ops"):
        unroll_depth(broken, traced_layers=UNROLL_LAYERS, layers=LAYERS)


def test_sac_tagged_as_the_full_model_unrolls_to_the_traced_full_depth(tmp_path):
    """Under SAC (the planner's default) the six-layer trace takes the full model's decision (Note [Shallow traces
    checkpointed for the full depth] in autosp/plan/depth.py); the eight-layer trace tagged with the same pattern is
    what each of the planner's bracketing programs stands for, and the unrolled program equals it."""
    import copy

    from autosp.joint_template import partition_at, propagate_fake
    from autosp.plan.depth import EVERY, FullDepthTagger
    from autosp.plan.traces import CaptureKeeper, partitioned_steps

    source = ModelSource(_model(tmp_path, LLAMA))
    training = SETUP.training_config(source.parameter_numels(source.config(seq_len=SETUP.seq_len)))
    options = {"activation_offload": "on"}
    captured = {}
    for layers in (2, UNROLL_LAYERS, LAYERS):
        into = CaptureKeeper()
        trace_step(source, SETUP, seq_len=SETUP.seq_len, layers=layers, config=training, options=options,
                   capture_into=into)
        captured[layers] = into
    tags = FullDepthTagger(model_layers=LAYERS, recompute_limit=captured[2].facts.compiled_with.sac_recompute_limit,
                           memory_budget=None)

    def program(layers: int):
        capture, facts = captured[layers].capture, captured[layers].facts
        with warnings.catch_warnings():  # deep-copying the graph's pytree codegen warns about a deprecated spelling
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
            joint = dataclasses.replace(capture, graph=copy.deepcopy(capture.graph))
        report = partition_at(joint, facts.compiled_with, tag_joint=tags.tagger(EVERY),
                              propagated=propagate_fake(capture))
        return partitioned_steps(source, SETUP, report, facts, seq_len=SETUP.seq_len, layers=layers, config=training,
                      options=options, rewrites_here=False)[("sac", None)]

    program(2)  # decides for the full depth
    shallow, full = program(UNROLL_LAYERS), program(LAYERS)
    assert full.backward.program(0).host_tensors
    unrolled, gradients = unroll_depth(shallow.backward, traced_layers=UNROLL_LAYERS, layers=LAYERS,
                                       gradients=shallow.gradients)
    assert _canonical(unrolled) == _canonical(full.backward)
    assert unrolled.program(0).tensors == full.backward.program(0).tensors
    assert sorted(map(dataclasses.astuple, gradients[0])) == sorted(map(dataclasses.astuple, full.gradients[0]))




@pytest.mark.parametrize("zero3", [{"zero_stage": 3}, {"zero_stage": 3, "engine": "deepspeed", "offload": "optimizer"}],
                         ids=["shards", "deepspeed-offload"])
def test_activation_offload_under_zero_3_unrolls_to_the_traced_full_depth(tmp_path_factory, zero3):
    """ZeRO 3 (each layer's parameters gathered at their use, gradients reduce-scattered in the program: ops named
    by their module, ``model.layers.K``) with activation offload, under a plain optimizer and under DeepSpeed's
    engine with the optimizer offloaded: unrolled from six layers, the same step time and device and host
    activations as the eight-layer trace simulated, and less on the device than without offload."""
    source = ModelSource(_model(tmp_path_factory.mktemp("zero3"), LLAMA))
    setup = dataclasses.replace(SETUP, **zero3)
    training = setup.training_config(source.parameter_numels(source.config(seq_len=setup.seq_len)))
    options = {"activation_offload": "on", "checkpointing": "none"}
    full = trace_step(source, setup, seq_len=setup.seq_len, layers=None, config=training, options=options)
    cluster = load_cluster("h100-sxm", world_size=setup.world_size)
    fast = simulate_step(source, dataclasses.replace(setup, depth="extrapolated"), cluster, training, LAYERS,
                         setup.seq_len, options)
    step_s, _, dynamic, _, host = _simulated(full, setup, cluster, None)
    assert fast.unrolled_from == UNROLL_LAYERS
    assert (fast.step_time_s, fast.dynamic_memory_bytes, fast.host_dynamic_memory_bytes) == (step_s, dynamic, host)
    assert host > 0
    kept = simulate_step(source, dataclasses.replace(setup, depth="full"), cluster, training, LAYERS, setup.seq_len,
                         {**options, "activation_offload": "off"})
    assert dynamic < kept.dynamic_memory_bytes
