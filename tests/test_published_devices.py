"""`benchmarks/accuracy/published_devices.py` in its CI-sized form: two published runs
(a V100 training ResNet-50 in FP32, the Zeus trace; Megatron-LM's GPT 1.7B on 32 A100s)
planned with the built-in profiles, laid out as they ran, each prediction within the
benchmark's worst-case goal of the published figure. The full table is run by hand."""

from __future__ import annotations

from benchmarks.accuracy import published_devices


def test_two_published_runs_are_predicted_within_the_worst_case_goal():
    record = published_devices.main(["--quick", "--no-save"])
    rows = {r["job"].split(",")[0]: r for r in record["rows"]}
    assert set(rows) == {"ResNet-50 FP32", "GPT 1.7B"}
    zeus, gpt = rows["ResNet-50 FP32"], rows["GPT 1.7B"]
    # laid out as they ran: one V100 PCIe; Megatron's TP1 x DP32 on A100-80GB nodes of 8
    assert (zeus["hardware"], zeus["mesh"]) == ("v100-pcie", {"data": 1, "model": 1})
    assert gpt["hardware"] == "a100-sxm-80gb"
    assert gpt["mesh"] == {"data": 32, "model": 1} and gpt["gpus"] == 32
    for r in (zeus, gpt):
        assert r["predicted"] is not None and r["unit"] in ("img/s", "Tflop/s per GPU")
        assert abs(r["error"]) <= published_devices.GOAL_WORST, r
    assert record["summary"]["rows"] == 2 and record["summary"]["no_plan"] == 0
