"""The CI-sized form of `benchmarks/planning/published.py`: the smallest Megatron job
(GPT 1.7 B on 32 A100s, batch 512 x 2048), planned as its experts write it and as a
newcomer writes it. Both get a plan; the expert's stack keeps its own per-block remat and
is not restructured; the newcomer's unrolled loop, which does not fit as written, is
restructured with per-layer remat of its repeated blocks (not micro-batches); what the
other objectives pick comes from the plan's own candidates."""

from __future__ import annotations

import pytest

from benchmarks.planning import published


@pytest.fixture(scope="module")
def rows():
    return {r["written"]: r for r in published.main(["--quick", "--no-save"])["rows"]}


def test_both_writings_of_the_smallest_megatron_job_are_planned(rows):
    assert set(rows) == {"expert", "newcomer"}
    for r in rows.values():
        assert r["no_plan"] is None and r["devices"] == 32
        assert r["step_s"] > 0 and r["ratio"] == pytest.approx(
            r["step_s"] / r["published_step_s"])
        assert r["peak_memory_gb"] <= 80


def test_the_expert_stack_keeps_its_own_remat_and_the_newcomers_loop_gets_one(rows):
    assert (rows["expert"]["remat"], rows["expert"]["micro_batches"]) == ("none", 1)
    assert "remat" in rows["expert"]["model"]          # its nn.remat, in the model
    newcomer = rows["newcomer"]
    assert newcomer["remat"] in ("layer_dots", "layer_full")
    assert newcomer["micro_batches"] == 1 and newcomer["stages"] == 1
    assert "unrolled" in newcomer["model"]


def test_the_other_objectives_pick_among_the_plans_candidates(rows):
    for r in rows.values():
        for objective in ("balanced", "energy"):
            pick = r["objectives"][objective]
            assert 1 <= pick["devices"] <= 32 and pick["step_s"] > 0
        # energy never picks a point costing more energy than balanced's
        assert r["objectives"]["energy"]["energy_j"] <= \
            r["objectives"]["balanced"]["energy_j"] * (1 + 1e-9)


def test_the_llama3_405b_jobs_flop_count_is_of_the_model_it_plans():
    """The published step of Llama 3's 405B row comes from PaLM's flop count, 6N per
    token for the weights: N must be the parameter count of the model the planner is
    given (the zoo's Llama at that shape, untied embedding and head: 405.8 B), and the
    step what 430 TFLOP/s on each of 8,192 GPUs takes for 2,048 sequences of 8,192."""
    import jax
    import numpy as np

    job = published.llama3_jobs()[0]
    w = job.workload("expert", 8)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(w.params))
    assert n == pytest.approx(405.8e9, rel=1e-3)
    hd = job.hidden // job.heads
    flops = job.global_batch * published.palm_flops(n, job.layers, job.heads, hd, job.seq)
    assert job.published_step_s == pytest.approx(flops / (430e12 * job.gpus), rel=1e-6)
