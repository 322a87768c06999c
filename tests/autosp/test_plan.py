"""``python -m autosp.plan``: predictions for a model the project does not ship, on a cluster file, with one memory
definition (the ledger's lines plus the simulated activations), checked against a CPU measurement.

Small sizes: a Qwen2-style config of 2 layers (hidden 64) traced on fake tensors for SP 4 x DP 2; the measured
case runs the tiny-llama preset on 2 gloo ranks.  The paper-scale acceptance case (a Qwen2-1.5B-style config at
131,072 tokens) is timed outside the tests (see the helper's report in docs/design.md, "The planner CLI").
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from autosp.errors import AutoSPError
from autosp.plan import TrainingSetup, cluster_from_dict, load_cluster, predict
from autosp.plan.__main__ import build_parser, main, setup_from_args
from simulator.ledger import memory_ledger, summarize
from simulator.max_length import ledger_peak

QWEN2 = {  # a Qwen2-style config (biases on q/k/v, tied embeddings, GQA): not a model the project ships
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 160,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
    "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
    "hidden_act": "silu", "attention_dropout": 0.0,
}

TWO_NODES = {  # a cluster file: 2 nodes of 4 custom devices, a network given by its figures
    "name": "test-2x4", "nodes": 2, "devices_per_node": 4,
    "node": {"name": "test-gpu", "architecture": "hopper", "devices_per_node": 4, "intra_node_kind": "nvswitch",
             "device": {"name": "test gpu", "peak_flops_per_s": 5e14, "memory_bandwidth_bytes_per_s": 2e12,
                        "memory_bytes": 40 * 2**30, "kernel_launch_overhead_s": 4e-6, "fuses_pointwise": True,
                        "efficiency": {"matmul": {"flops": 0.7, "memory": 0.8},
                                       "other": {"flops": 0.06, "memory": 0.6}}},
             "intra_node": {"bandwidth_bytes_per_s": 2e11, "latency_s": 1e-6, "efficiency": 0.8},
             "host_link": {"bandwidth_bytes_per_s": 3.2e10, "latency_s": 5e-7}},
    "network": {"name": "test-ib", "nic": {"bandwidth_bytes_per_s": 2.5e10, "latency_s": 2.5e-6, "efficiency": 0.9},
                "switch_latency_s": 6e-7},
}


@pytest.fixture(scope="module")
def qwen2_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2") / "config.json"
    path.write_text(json.dumps(QWEN2))
    return path


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster") / "two_nodes.json"
    path.write_text(json.dumps(TWO_NODES))
    return path


@pytest.fixture(scope="module")
def answer(qwen2_config, cluster_file, tmp_path_factory):
    """The acceptance case's shape at small size, through the command line: ZeRO 2, SP 4 x DP 2, micro-batch 2, the
    options as given (``--memory-plan off``: the default plans the memory, as autosp.compile does)."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    argv = ["--model", str(qwen2_config), "--cluster", str(cluster_file), "--seq-len", "256", "--sp-size", "4",
            "--dp-size", "2", "--zero-stage", "2", "--micro-batch", "2", "--memory-plan", "off", "--json", str(out),
            "-q"]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_plan_answers_for_an_unshipped_hf_config_on_a_two_node_cluster_file(answer):
    assert answer["setup"]["zero_stage"] == 2 and answer["world_size"] == 8
    assert answer["cluster"]["nodes"] == 2 and answer["cluster"]["devices_per_node"] == 4
    assert answer["cluster"]["network"] == "test-ib"
    assert answer["capacity_bytes"] == 40 * 2**30
    assert answer["deepspeed_path"] == "DeepSpeedZeroOptimizer"
    assert answer["fits"] is True and answer["step_time_s"] > 0
    # the Qwen2 model itself: tied embeddings once, q/k/v biases (kv width = 64 / 4 heads x 2 kv heads = 32)
    h, kv, f, v = 64, 32, 160, 320
    layer = h * h + h + 2 * (kv * h + kv) + h * h + 3 * f * h + 2 * h
    assert answer["parameters"] == v * h + 2 * layer + h
    cats = answer["peak_by_category_bytes"]
    for category in ("parameters", "gradients", "optimizer", "activations", "communication buffers", "runtime"):
        assert cats[category] > 0, category


def test_plan_peak_is_the_ledger_lines_plus_the_simulated_activations(answer):
    """One memory definition: the peak is the sum of the ledger's lines inside backward (device reserve included),
    whose activations line is the simulated step's, i.e. simulator.max_length.ledger_peak."""
    lines = answer["ledger"]
    assert answer["peak_bytes"] == sum(ln["bytes"] for ln in lines)
    activations = [ln for ln in lines if ln["category"] == "activations"]
    assert [ln["bytes"] for ln in activations] == [answer["activation_bytes"]] and answer["activation_bytes"] > 0
    setup = TrainingSetup(**answer["setup"])
    from autosp.plan.model_source import ModelSource

    source = ModelSource(answer["model"])
    config = setup.training_config(source.parameter_numels(source.config(seq_len=setup.seq_len)))
    assert answer["peak_bytes"] == ledger_peak(config, answer["activation_bytes"])
    assert answer["peak_by_category_bytes"] == {
        c: v[1] for c, v in summarize(memory_ledger(config, at="backward", activation_bytes=answer["activation_bytes"]))
        .by_category.items() if v[2]}
    device_lines = {"CUDA context and kernel images", "NCCL communicator buffers", "cuBLAS workspaces",
                    "caching-allocator rounding", "fragmentation"}
    assert device_lines <= {ln["name"] for ln in lines}
    band = answer["peak_band_bytes"]
    assert band["low"] <= band["nominal"] == answer["peak_bytes"] <= band["high"]


def _measure(rank: int, world: int, seq_len: int, micro_batch: int) -> dict:
    """One AutoSP step of tiny-llama (fp32, aot_eager) after a first step and an AdamW step, with the gradients
    set to None as DeepSpeed's ``zero_grad`` does: the bytes held before it (parameters, optimizer state), the
    peak of the tensors it creates (activations, and the gradients that become ``param.grad``) and the gradients'
    bytes."""
    import torch

    import autosp
    from autosp.plan.model_source import ModelSource
    from experiments.cpu.peak_memory import PeakMemory, storage_bytes

    torch.manual_seed(0)
    source = ModelSource("tiny-llama")
    model = source.build(source.config(seq_len=seq_len), torch.float32)
    compiled = autosp.compile(model, sp_size=world, compiler="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len), generator=torch.Generator().manual_seed(1))

    def step():
        compiled(**autosp.prepare_inputs(ids, labels=ids)).loss.backward()

    step()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    with PeakMemory(static=params + state) as pm:
        step()
    return {"static": pm.static_bytes, "peak": pm.peak_bytes, "gradients": storage_bytes(p.grad for p in params)}


@pytest.mark.slow
def test_plan_prediction_matches_a_cpu_measurement():
    """The predicted peak without the GPU-only lines (CUDA context, NCCL, allocator) against a real step on 2
    gloo ranks (ZeRO 0, fp32, AdamW: DeepSpeed's path is the torch optimizer's): the ledger's static lines
    (parameters, param.grad, two moments, step counters) exactly; the whole peak, with the gradients held by the
    simulated program from the op that makes each (Note [Gradients the program holds] in
    simulator/training_step.py), to within the bytes of the batch's integer tensors (ids, labels, positions: the
    one thing a step holds that the prediction does not price)."""
    from simulator.cluster import Cluster
    from simulator.hardware import get_preset
    from tests.harness import run_on_ranks

    seq_len, micro_batch = 128, 2
    setup = TrainingSetup(seq_len=seq_len, sp_size=2, zero_stage=0, dtype="fp32", optimizer="adamw",
                          micro_batch=micro_batch, compiler="aot_eager")
    got = predict("tiny-llama", setup, Cluster.from_preset(get_preset("cpu-gloo")))
    measured = run_on_ranks(_measure, 2, seq_len, micro_batch, timeout_s=600.0)
    config = setup.training_config(_numels("tiny-llama", seq_len))
    assert summarize(memory_ledger(config, at="backward", device=False)).nominal == max(
        m["static"] + m["gradients"] for m in measured)
    predicted_cpu = summarize(memory_ledger(config, at="backward", device=False,
                                            activation_bytes=got.step.dynamic_memory_bytes)).nominal
    peak = max(m["peak"] for m in measured)
    logging.getLogger(__name__).info("predicted %d (activations %d), measured %d: %+.1f %%", predicted_cpu,
                                     got.step.dynamic_memory_bytes, peak, 100 * (predicted_cpu - peak) / peak)
    batch_bytes = 3 * 8 * micro_batch * seq_len  # int64 input_ids, labels and position_ids of the full sample
    assert abs(predicted_cpu - peak) <= batch_bytes < max(m["gradients"] for m in measured) // 10
    assert got.peak_bytes == sum(ln.bytes for ln in got.lines) == predicted_cpu  # a CPU process: no device reserve


def _numels(model: str, seq_len: int) -> tuple[int, ...]:
    from autosp.plan.model_source import ModelSource

    source = ModelSource(model)
    return source.parameter_numels(source.config(seq_len=seq_len))


@pytest.mark.parametrize("argv, message", [
    (["--zero-stage", "3", "--strategy", "ring"], "priced under --strategy ulysses only"),
    (["--offload", "optimizer", "--zero-stage", "0"], "ZeRO feature"),
    (["--offload", "optimizer", "--zero-stage", "2", "--grad-accum", "2"], "through host memory"),
    (["--zero-stage", "1", "--grad-accum", "4"], "unreduced gradient"),
    (["--seq-len", "1001", "--sp-size", "4"], "not divisible"),
    (["--world-size", "6", "--sp-size", "4"], "not a multiple"),
])
def test_plan_refuses_what_it_cannot_predict_before_any_work(argv, message):
    base = {"--model": "tiny-llama", "--cluster": "h100-sxm", "--seq-len": "1024"}
    for flag in argv[::2]:
        base.pop(flag, None)
    args = build_parser().parse_args([x for kv in base.items() for x in kv] + argv)
    with pytest.raises(AutoSPError, match=message):
        setup_from_args(args)


def test_plan_max_length_answers_the_peak_by_category_at_the_longest_length_and_keeps_the_simulated_step():
    """What the max_sequence_length notebook plots: every probe, and the ledger by category at the longest length,
    with the same memory definition as the answer at --seq-len; the simulated step is kept for simulator.plots."""
    from simulator.result import Result

    setup = TrainingSetup(seq_len=256, sp_size=2, dtype="fp32", compiler="aot_eager")
    found = predict("tiny-llama", setup, load_cluster("a100-80gb-sxm", world_size=2), max_length=True,
                    max_length_high=512, granularity=256, max_probes=3)
    assert isinstance(found.step.simulated, Result) and found.step.simulated.step_time_s == found.step.step_time_s
    m = found.max_length
    assert (m["max_seq_len"], m["stopped"]) == (512, "ceiling")  # a tiny model fits an A100 at any length here
    longest = found.max_length_step
    assert longest.seq_len == 512 and isinstance(longest.simulated, Result)
    assert longest.dynamic_memory_bytes > found.step.dynamic_memory_bytes
    probes = {p["seq_len"]: p for p in m["probes"]}
    assert set(probes) == {256, 512} and all(p["fits"] for p in probes.values())
    # at --seq-len the probe's peak is the answer's; at the longest length it is the sum of the categories there
    assert probes[256]["peak_bytes"] == found.peak_bytes == sum(found.by_category.values())
    assert probes[512]["peak_bytes"] == sum(m["peak_by_category_bytes"].values())
    grown = {c for c, b in m["peak_by_category_bytes"].items() if b != found.by_category[c]}
    assert "activations" in grown and "parameters" not in grown
    peak_there = sum(m["peak_by_category_bytes"].values()) / 2**30
    assert f"at max      peak {peak_there:.2f} GiB per rank" in found.format()


def test_plan_offload_optimizer_answers_the_device_peak_the_host_peak_and_the_step_with_cpu_adam():
    """--offload optimizer: the device peak is still ledger_peak (device lines plus simulated activations), the host
    peak is the ledger's host lines, a host-memory OOM is reported as such, and the step has the host copies and the
    CPU Adam time (an assumption) in it."""
    from simulator.training_step import host_optimizer_time_s

    setup = TrainingSetup(seq_len=256, sp_size=2, zero_stage=2, offload="optimizer", compiler="aot_eager")
    cluster = load_cluster("h100-sxm", world_size=2)
    found = predict("tiny-llama", setup, cluster)
    config = setup.training_config(_numels("tiny-llama", 256))
    assert config.offload_optimizer and found.wrapper == "DeepSpeedZeroOptimizer"
    activations = found.step.dynamic_memory_bytes
    assert found.peak_bytes == ledger_peak(config, activations) == sum(found.by_category.values())
    assert "optimizer" not in found.by_category  # fp32 master and Adam moved to the host
    host = summarize(memory_ledger(config, at="backward", activation_bytes=activations), "host")
    assert found.host_peak_bytes == host.nominal > 0 and host.by_category["optimizer"][1] > 0
    assert found.host_capacity_bytes == 2 * 2**40 // 8 and found.fits and found.host_fits
    ops = found.step.simulated.timelines[0].compiled.program.ops
    assert {op.collective.kind for op in ops if op.collective is not None} >= {"to_host", "from_host"}
    assert found.step.step_time_s == pytest.approx(found.step.simulated.step_time_s + host_optimizer_time_s(config))
    doc = found.to_dict()
    assert doc["host_peak_bytes"] == found.host_peak_bytes and doc["host_fits"] is True
    assert "host memory" in found.format() and "optimizer step on the CPU" in found.format()
    tight = dataclasses.replace(found, host_capacity_bytes=found.host_peak_bytes - 1)
    assert not tight.fits and not tight.host_fits and tight.peak_bytes <= tight.capacity_bytes
    assert "host-memory OOM" in tight.format()
    from simulator.cluster import Cluster
    from simulator.hardware import get_preset

    linkless = Cluster.from_preset(dataclasses.replace(get_preset("cpu-gloo"), host_memory_link=None))
    with pytest.raises(AutoSPError, match="no link to host memory"):
        predict("tiny-llama", setup, linkless)


def test_plan_world_is_sp_times_dp():
    args = build_parser().parse_args(["--model", "tiny-llama", "--cluster", "h100-sxm", "--seq-len", "1024",
                                      "--sp-size", "4", "--world-size", "16"])
    assert setup_from_args(args).dp_size == 4


def test_plan_cluster_file_builds_the_simulator_cluster(cluster_file):
    cluster = load_cluster(str(cluster_file), world_size=8)
    assert (cluster.nodes, cluster.devices_per_node, cluster.world_size) == (2, 4, 8)
    assert cluster.device.memory_bytes == 40 * 2**30 and cluster.device.fuses_pointwise
    assert cluster.preset.host_link.bandwidth_bytes_per_s == 3.2e10
    assert cluster.network.nic.effective_bandwidth_bytes_per_s == pytest.approx(2.5e10 * 0.9)
    # presets by name: a node preset gets as many nodes as the ranks need; a cluster preset is itself
    assert load_cluster("h100-sxm", world_size=16).nodes == 2
    assert load_cluster("a100-80gb-sxm-2x8", world_size=8).world_size == 16
    # a preset node, a named network and a memory override
    small = cluster_from_dict({"node": "a100-80gb-sxm", "nodes": 2, "network": "ib-hdr-200", "memory_gib": 40})
    assert small.device.memory_bytes == 40 * 2**30 and small.network.name == "ib-hdr-200"
    # host memory: the preset's, or a node's own figures, or a top-level override (GiB per node)
    assert small.host_memory_per_rank_bytes == 2 * 2**40 // 8
    assert cluster_from_dict({"node": "a100-80gb-sxm", "host_memory_gib": 512}).host_memory_per_rank_bytes == 64 * 2**30
    own = cluster_from_dict({**TWO_NODES, "node": {**TWO_NODES["node"], "host_memory_gib": 256,
                                                   "host_memory_link": {"bandwidth_bytes_per_s": 3.2e10,
                                                                        "latency_s": 5e-6, "efficiency": 0.8}}})
    assert own.host_memory_per_rank_bytes == 64 * 2**30 and own.preset.host_memory_kind == "pcie"
    assert own.preset.host_memory_link.effective_bandwidth_bytes_per_s == pytest.approx(2.56e10)
    assert own.topology.host_path(5, to_host=True)


@pytest.mark.parametrize("document, message", [
    ({"node": "a100-80gb-sxm", "nodez": 2}, "unknown field"),
    ({"nodes": 2}, "missing field 'node'"),
    ({"node": "a100-80gb", "nodes": 1}, "unknown hardware preset"),
    ({**TWO_NODES, "network": None}, "need a network"),
    ({**TWO_NODES, "node": {k: v for k, v in TWO_NODES["node"].items() if k != "host_link"}}, "host_link"),
    ({**TWO_NODES, "node": {**TWO_NODES["node"], "device": {"name": "x"}}}, "malformed"),
    ({**TWO_NODES, "network": {"nic": {"latency_s": 1e-6}, "switch_latency_s": 1e-6}}, "bandwidth_bytes_per_s"),
    ({**TWO_NODES, "host_memory_gib": -1}, "host_memory_gib must be a positive"),
    ({**TWO_NODES, "node": {**TWO_NODES["node"], "host_memory_link": {"latency_s": 1e-6}}}, "host_memory_link"),
    ({**TWO_NODES, "node": {**TWO_NODES["node"], "host_memory_kind": "cxl"}}, "host_memory_kind"),
])
def test_plan_cluster_file_errors_name_the_field(document, message):
    with pytest.raises(AutoSPError, match=message):
        cluster_from_dict(document)


def test_plan_refuses_a_cluster_smaller_than_the_ranks(qwen2_config):
    setup = TrainingSetup(seq_len=256, sp_size=4, dp_size=4)
    with pytest.raises(AutoSPError, match="needs 16"):
        predict(str(qwen2_config), setup, cluster_from_dict(TWO_NODES))


def test_simulator_cli_reports_the_same_memory_definition_or_says_what_it_leaves_out(tmp_path, capsys):
    """``python -m simulator W.json``: with the training configuration in the workload's metadata its peak is the
    planner's (the ledger plus the simulated activations); without it, the output names what is left out."""
    import dataclasses

    from simulator.__main__ import main as simulator_main
    from simulator.ledger import TrainingConfig
    from simulator.max_length import step_metadata
    from simulator.synthetic import LlamaShape, llama_ulysses_workload

    shape = LlamaShape(layers=1, hidden=256, heads=8, kv_heads=8, ffn_hidden=512, vocab=1000)
    workload = llama_ulysses_workload(seq_len=4096, sp_degree=8, shape=shape, ops_per_layer=(20, 30))
    config = TrainingConfig.from_parameter_count(10**8, zero_stage=1, dp_world_size=8)
    plain, described = tmp_path / "plain.json", tmp_path / "described.json"
    workload.to_json(plain)
    dataclasses.replace(workload, metadata={**workload.metadata, **step_metadata(
        model="m", system="s", seq_len=4096, layers=1, model_layers=1, config=config)}).to_json(described)
    assert simulator_main([str(plain), "--cluster", "h100-sxm", "--out", str(tmp_path / "a"), "--no-plots"]) == 0
    assert "without the device reserve (CUDA context, NCCL" in capsys.readouterr().out
    assert simulator_main([str(described), "--cluster", "h100-sxm", "--out", str(tmp_path / "b"), "--no-plots"]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "b" / "result.json").read_text())
    activations = max(r["peak_memory_bytes"] - r["static_memory_bytes"] for r in result["ranks"])
    assert f"{ledger_peak(config, activations) / 2**30:.2f} GiB" in out and "device reserve included" in out


def test_parameter_counts_are_built_once_per_configuration_and_equal_the_built_models():
    """`ModelSource.parameter_numels` keeps each configuration's counts: what it returns, first or again, is what a
    model built for that configuration holds, for every depth and length asked."""
    from autosp.plan.model_source import ModelSource

    source = ModelSource("llama-3.2-1b")
    configs = [source.config(seq_len=s, num_layers=n) for s, n in ((4096, 1), (4096, 2), (8192, 2), (4096, None))]
    built = [source._built_numels(c) for c in configs]
    assert len({len(b) for b in built}) == 3 and built[1] == built[2]  # the depth changes them, the length not
    for _ in range(2):  # first built, then kept
        assert [source.parameter_numels(c) for c in configs] == built
    assert sum(key in source._numels for key in (c.to_json_string(use_diff=False) for c in configs)) == 4


def test_presets_are_predicted_without_a_kv_cache_and_a_config_json_as_it_says(tmp_path):
    """A preset is traced without a KV cache (as ``python -m autosp.train`` and a Trainer train it); a config.json
    keeps its ``use_cache``, and the cache it keeps (every layer's keys and values of this rank's tokens, to the end
    of the step) is exactly what it adds to the predicted activation peak here."""
    from autosp.plan.model_source import ModelSource

    assert ModelSource("llama-3.1-8b").config(seq_len=1024).use_cache is False
    cluster = load_cluster("a100-80gb-sxm", world_size=2)
    setup = TrainingSetup(seq_len=512, sp_size=2, zero_stage=0)
    peaks = {}
    for use_cache in (True, False):
        path = tmp_path / f"cache-{use_cache}.json"
        path.write_text(json.dumps({**QWEN2, "use_cache": use_cache}))
        assert ModelSource(str(path)).config(seq_len=512).use_cache is use_cache
        lines = predict(str(path), setup, cluster).lines
        peaks[use_cache] = sum(ln.bytes for ln in lines if ln.category == "activations")
    # each layer's K and V of this rank's 256 tokens: 2 KV heads of 16 (hidden 64 over 4 heads), bf16
    cache = QWEN2["num_hidden_layers"] * 2 * 2 * 16 * 256 * 2
    assert peaks[True] - peaks[False] == cache, peaks


def test_memory_per_category_along_the_step_tops_out_at_the_predicted_peaks(tmp_path, qwen2_config):
    """`simulator.plots.memory_by_category` of a prediction with activation offload: every ledger category held
    through the step, the activations following the simulated step; the stack's highest top is the predicted
    device peak, and on the host the predicted host peak."""
    from simulator.plots import memory_by_category, plot_memory_by_category

    setup = TrainingSetup(seq_len=256, sp_size=2, zero_stage=2, offload="optimizer")
    prediction = predict(str(qwen2_config), setup, load_cluster("h100-sxm", world_size=2),
                         options={"activation_offload": "on"})
    result = prediction.step.simulated
    for pool, peak in (("device", prediction.peak_bytes), ("host", prediction.host_peak_bytes)):
        times, stacks = memory_by_category(result, prediction.lines, pool)
        assert all(len(series) == len(times) for series in stacks.values())
        assert max(map(sum, zip(*stacks.values(), strict=True))) == peak, pool
        assert max(stacks["activations"]) > 0 and min(stacks["activations"]) >= 0
    plot_memory_by_category(result, prediction.lines, tmp_path / "categories.png")
    assert (tmp_path / "categories.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
