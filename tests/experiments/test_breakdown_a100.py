"""The A100 breakdown builds on a small model: its technique rows run the AutoSP paper's setting (ZeRO 1, no
optimizer offload), its planner row plans at the published AutoSP length, and the published lengths are the
paper's (not its numbers at scale: the table itself, README)."""

from __future__ import annotations

from experiments.paper_scale import alst, alst_breakdown, alst_longest, alst_planner, breakdown_a100
from experiments.paper_scale.simulate import TraceCache
from experiments.reproduction.breakdown_a100 import published_lengths
from tests.experiments.test_alst import SMALL


def test_published_lengths_are_the_papers_llama_3_1_8b_figures():
    assert published_lengths() == {"zero3": 8000, "ring": 15000, "ulysses": 15000, "autosp": 45000}
    assert set(breakdown_a100.PUBLISHED_SYSTEMS) - set(published_lengths()) == {"ulysses+ckpt"}  # no figure


def test_technique_rows_add_one_technique_at_a_time_under_the_papers_setting():
    rows = breakdown_a100.technique_rows()
    assert [r.name for r in rows] == [r.name for r in alst_breakdown.AUTOSP_ROWS]
    assert all(r.zero_stage == 1 and not r.offload_optimizer and r.sp_size == 8 for r in rows)
    techniques = [(r.tiled_loss, r.tiled_mlp, r.offload) for r in rows[:4]]
    assert techniques == [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
    cfg = alst.training_config(rows[0], SMALL)
    assert cfg.zero_stage == 1 and not cfg.offload_optimizer
    assert alst.training_config(alst_breakdown.AUTOSP_ROWS[0], SMALL).offload_optimizer  # ALST's rows keep CPU Adam


def test_breakdown_rows_and_footer_on_a_small_model():
    # Everything but the published systems (paper models only): the offload row and the planner at 4,096 tokens,
    # each searched with one probe (a small model fits: the ceiling).
    from autosp.plan import candidate_plans

    offload = breakdown_a100.technique_rows()[3]
    search = alst_longest.Search(granularity=1024, start=4096, high=4096, max_probes=1)
    plans = candidate_plans(checkpointing=("sac",), tiled_loss=("on",), tiled_mlp=("on",),
                            activation_offload=("off", "on"))
    rows = breakdown_a100.breakdown_rows({"autosp": 4096}, model=SMALL, systems=(), rows=[offload], search=search,
                                         plans=plans, cache=TraceCache(interpolate_lengths=True))
    technique, planner = rows
    assert technique["zero_stage"] == 1 and technique["activation_offload"] is True
    assert technique["simulated_tokens"] == 4096 and technique["stopped"] == "ceiling"
    assert technique["host_peak_gib"] > 0  # the offloaded activations, and no optimizer state on the host
    assert planner["row"] == alst_planner.PLANNER_ROW and planner["zero_stage"] == 1
    assert planner["published_tokens"] == 4096
    assert "objective fastest at 4,096 tokens chose " in planner["source"]
    assert planner["simulated_tokens"] == 4096 and 0 < planner["simulated_step_at_published_s"]
    assert "host-memory" not in planner["items"].split()  # ALST's node's item, not this machine's
    # The planner predicts at its own depth whatever the table's (autosp.compile's decision), and reproduces no run.
    assert planner["depth"] == "extrapolated" and "planner-depth" in planner["items"].split()
    assert planner["error_pct"] == ""
    lines = breakdown_a100.footer(rows)
    assert lines[0].startswith("Llama-3.1-8B on 8x A100-80GB (a100-80gb-sxm)")
    (line,) = [ln for ln in lines if ln.startswith("The planner (no AutoSP or DeepSpeed setting): autosp.plan.plan_job")]
    assert line.endswith("; longest 4,096 tokens, 1.00x the published 4,096.")
    assert "- this-pass: " + breakdown_a100.ITEMS["this-pass"] in lines
