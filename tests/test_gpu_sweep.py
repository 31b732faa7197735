"""The GPU benchmark's code path, run on this CPU (`python -m benchmarks.gpu.gpu_sweep --quick`).

A lent GPU comes rarely and for minutes, and the benchmark then runs blind: this runs the
same orchestration here (a calibration child, a model child, the trace, the record) so a
change that breaks it fails in CI, not on the GPU. The figures are this CPU's, not checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "benchmarks.gpu.gpu_sweep"   # run with -m from the repository root


def _run(*args: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)   # one CPU device, as the script sees a GPU machine's one
    subprocess.run([sys.executable, "-m", SCRIPT, *args], check=True, env=env, cwd=ROOT,
                   timeout=600, capture_output=True)


def test_gpu_sweep_records_measured_and_predicted_rows_and_repredicts_them(tmp_path):
    _run("--quick", "--models", "alexnet", "--batches", "8", "--trace", "alexnet",
         "--out", str(tmp_path))
    record = json.loads((tmp_path / "cpu_quick.json").read_text())
    assert record["failures"] == [] and record["calibration"] is not None
    (row,) = record["rows"]
    assert row["model"] == "alexnet-small" and row["batch"] == 8
    m = row["measured"]
    assert m["step_time_s"] > 0 and m["queued_step_time_s"] > 0
    assert m["energy_source"] == "modeled"          # no NVML on a CPU, and it says so
    for key in ("predicted_calibrated", "predicted_builtin"):
        assert row[key]["step_time_s"] > 0 and row[key]["memory_bytes"] > 0
    assert row["compiled"]["memory_bytes"] > 0 and row["compiled"]["library_calls"] == {}
    assert (tmp_path / "gpu_sweep_work" / "trace_alexnet_8.xplane.pb").stat().st_size > 0
    assert "ENTRY" in (tmp_path / "gpu_sweep_work" / "trace_alexnet_8.hlo.txt").read_text()
    assert (tmp_path / "cpu_quick.md").read_text().count("| alexnet-small |") == 1

    # predictions re-made from the recorded calibration, with no device run: the same
    # model, the same figures; the run's kept beside them
    again = tmp_path / "again"
    again.mkdir()
    _run("--repredict", str(tmp_path / "cpu_quick.json"), "--out", str(again))
    (redone,) = json.loads((again / "cpu_quick.json").read_text())["rows"]
    assert redone["predicted_calibrated"] == row["predicted_calibrated"]
    assert redone["predicted_at_run"]["calibrated"] == row["predicted_calibrated"]
    assert redone["measured"] == row["measured"]

    # the session's convolution probe on the same path: toy sizes timed here, then each row
    # predicted by the model with that run's calibration (no device run)
    probe, probed = "benchmarks.gpu.conv_probe", tmp_path / "conv_probe"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    subprocess.run([sys.executable, "-m", probe, "--quick", "--batches", "2", "--dtype",
                    "float32", "--out", str(probed)], check=True, env=env, cwd=ROOT,
                   timeout=300, capture_output=True)
    rec = json.loads((probed / "cpu_quick.json").read_text())
    assert {r["family"] for r in rec["rows"]} == {"3x3 wide", "3x3 bottleneck", "1x1",
                                                  "first layer"}
    assert all(r["seconds"] > 0 and r["flops"] > 0 and r["share"] > 0 for r in rec["rows"])
    subprocess.run([sys.executable, "-m", probe, "--predict",
                    str(probed / "cpu_quick.json"), "--calibration",
                    str(tmp_path / "cpu_quick.json"), "--out", str(again / "conv_probe")],
                   check=True, env=env, cwd=ROOT, timeout=300, capture_output=True)
    predicted = json.loads((again / "conv_probe" / "cpu_quick.json").read_text())
    assert all(r["predicted_s"] > 0 for r in predicted["rows"])
    assert "predicted ms" in (again / "conv_probe" / "cpu_quick.md").read_text()
