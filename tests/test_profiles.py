"""The built-in profiles: every figure has a source, the docs' table is the profiles' own,
measured shares are carried to unmeasured GPUs by the stated rules, and a new calibration
improves its family (`jaxwap/hardware/{datasheets,measured_runs,builtin_profiles}.py`)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from jaxwap.cli.main import main as cli
from jaxwap.hardware.builtin_profiles import BUILTIN_PROFILES, PROVENANCE, build_profiles
from jaxwap.hardware.datasheets import DATASHEETS, PUBLISHED_GEMM, SOURCE_KINDS
from jaxwap.hardware.device import DeviceSpec
from jaxwap.hardware.measured_runs import (
    RUNS_FILE,
    load_runs,
    run_from_calibration,
    save_runs,
)
from jaxwap.hardware.provenance import provenance_table, read_block

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "guide" / "profiles.md"
RUNS = load_runs()


def test_every_field_of_every_profile_has_a_source_holding_its_value():
    fields = [f.name for f in dataclasses.fields(DeviceSpec)]
    assert set(PROVENANCE) == set(BUILTIN_PROFILES)
    for name, spec in BUILTIN_PROFILES.items():
        assert list(PROVENANCE[name]) == fields, name
        for field, src in PROVENANCE[name].items():
            assert src.kind in SOURCE_KINDS and src.rule, (name, field)
            assert src.value == getattr(spec, field), (name, field)


def test_the_docs_table_is_the_profiles_own():
    """docs/guide/profiles.md holds exactly what `jaxwap profiles` renders now (rerun
    `jaxwap profiles --docs docs/guide/profiles.md` after changing a profile)."""
    assert read_block(DOCS) == provenance_table()


def test_the_committed_runs_regenerate_from_their_records():
    """Each run in the committed file is what its recorded calibration gives."""
    assert len(RUNS) >= 4
    for run in RUNS:
        record = json.loads((ROOT / run.source).read_text())
        again = run_from_calibration(record["calibration"], run.source, record["date_utc"])
        assert again == run


def _median(field, runs):
    return statistics.median(getattr(r, field) for r in runs)


def test_hopper_profiles_are_datasheets_times_the_shares_measured_on_hopper():
    hopper = [r for r in RUNS if r.generation == "hopper"]
    for name in ("h100-sxm", "h200"):
        spec, ds = BUILTIN_PROFILES[name], DATASHEETS[name]
        own = [r for r in RUNS if r.profile == name]
        assert spec.peak_flops == pytest.approx(ds.peak_flops * _median("matmul_share", hopper))
        assert spec.peak_flops_f32 == pytest.approx(ds.peak_flops_f32
                                                    * _median("f32_share", hopper))
        # bandwidth: the GPU's own runs (its memory), not the generation's
        assert spec.memory_bandwidth == pytest.approx(ds.memory_bandwidth
                                                      * _median("bandwidth_share", own))
        assert spec.conv_efficiency == pytest.approx(_median("conv_efficiency", hopper))
        assert PROVENANCE[name]["peak_flops"].kind == "measured"
        assert 0.6 < spec.peak_flops / ds.peak_flops < 0.8    # below the datasheet


def test_unmeasured_generations_take_published_gemm_shares_or_carried_ones():
    hopper = [r for r in RUNS if r.generation == "hopper"]
    a100, ds = BUILTIN_PROFILES["a100-sxm-80gb"], DATASHEETS["a100-sxm-80gb"]
    bf16, tf32, _ = PUBLISHED_GEMM["a100-sxm-80gb"]
    assert a100.peak_flops == pytest.approx(ds.peak_flops * bf16)
    assert a100.peak_flops_f32 == pytest.approx(ds.peak_flops_f32 * tf32)
    assert PROVENANCE["a100-sxm-80gb"]["peak_flops"].kind == "published"
    # the rest of the compute figures are Hopper's, carried
    assert a100.conv_efficiency == pytest.approx(_median("conv_efficiency", hopper))
    assert a100.kernel_overhead_s == pytest.approx(_median("kernel_overhead_s", hopper))
    assert PROVENANCE["a100-sxm-80gb"]["conv_efficiency"].kind == "carried"
    assert a100.memory_bandwidth == pytest.approx(ds.memory_bandwidth
                                                  * _median("bandwidth_share", hopper))
    # Volta has no TF32: its float32 matmuls take its 16-bit share, not Hopper's TF32 one
    v100, vds = BUILTIN_PROFILES["v100-sxm2"], DATASHEETS["v100-sxm2"]
    share = v100.peak_flops / vds.peak_flops
    assert share == pytest.approx(_median("matmul_share", hopper))
    assert v100.peak_flops_f32 == pytest.approx(vds.peak_flops_f32 * share)
    assert "no TF32" in PROVENANCE["v100-sxm2"]["peak_flops_f32"].rule


def _a100_record(matmul: float = 280e12, conv: float = 0.66) -> dict:
    """A calibration as `jaxwap calibrate` would record it on an A100 80GB."""
    source = next(r.source for r in RUNS if r.source.endswith("nvidia-h200.json"))
    h200 = json.loads((ROOT / source).read_text())["calibration"]   # the current format
    spec = dict(h200["spec"], peak_flops=matmul, peak_flops_f32=140e12,
                memory_bandwidth=1.8e12, conv_efficiency=conv, kernel_overhead_s=2e-6)
    return dict(h200, spec=spec, device_kind="NVIDIA A100-SXM4-80GB")


def test_a_calibrated_gpu_improves_its_family_and_the_nearest_generation():
    new = run_from_calibration(_a100_record(), "a100-run.json", "2026-11-28")
    assert new.profile == "a100-sxm-80gb" and new.generation == "ampere"
    assert new.matmul_share == pytest.approx(280 / 312)
    specs, src = build_profiles([*RUNS, new])
    # the A100s now read Ampere's measured run, no longer the published GEMM
    for name in ("a100-sxm-80gb", "a100-sxm-40gb"):
        assert specs[name].peak_flops == pytest.approx(280e12)
        assert specs[name].conv_efficiency == pytest.approx(0.66)
    assert src["a100-sxm-80gb"]["peak_flops"].kind == "measured"
    assert src["a100-sxm-40gb"]["peak_flops"].kind == "carried"   # the 80 GB card's run
    assert specs["a100-sxm-40gb"].memory_bandwidth == pytest.approx(1.555e12 * 1.8 / 2.039)
    # Volta is nearer Ampere than Hopper: it now carries the A100's shares
    assert specs["v100-sxm2"].peak_flops == pytest.approx(125e12 * 280 / 312)
    assert "from ampere to volta" in src["v100-sxm2"]["peak_flops"].rule
    # Hopper keeps its own runs
    assert specs["h100-sxm"] == BUILTIN_PROFILES["h100-sxm"]


def test_a_cpu_calibration_is_refused_naming_the_kind():
    record = dict(_a100_record(), device_kind="cpu", platform="cpu")
    with pytest.raises(ValueError, match="'cpu'.*no GPU datasheet"):
        run_from_calibration(record, "cpu.json")


def test_profiles_command_adds_a_run_and_keeps_the_docs_current(tmp_path, capsys):
    runs = tmp_path / "runs.json"
    save_runs(RUNS, runs)
    record = tmp_path / "a100.json"
    record.write_text(json.dumps(_a100_record()))
    assert cli(["profiles", "--add", str(record), "--runs-file", str(runs)]) == 0
    assert "a100-sxm-80gb" in capsys.readouterr().out
    assert len(load_runs(runs)) == len(RUNS) + 1
    assert cli(["profiles", "--add", str(record), "--runs-file", str(runs)]) == 0
    assert len(load_runs(runs)) == len(RUNS) + 1          # the same source replaces
    page = tmp_path / "profiles.md"
    page.write_text("# Profiles\n\nprose kept\n")
    assert cli(["profiles", "--docs", str(page), "--runs-file", str(runs)]) == 0
    assert page.read_text().startswith("# Profiles\n\nprose kept\n")
    assert cli(["profiles", "--docs", str(page), "--check", "--runs-file", str(runs)]) == 0
    # against the committed runs the page is stale (the A100 run is not among them)
    assert cli(["profiles", "--docs", str(page), "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli(["profiles", "--add", str(tmp_path / "missing.json"), "--runs-file", str(runs)])
    assert e.value.code == 2
    assert "missing.json" in capsys.readouterr().err
    assert RUNS == load_runs(RUNS_FILE)                   # the package's file untouched


def test_calibrate_contribute_adds_the_gpu_run_and_refuses_a_cpu(tmp_path, monkeypatch, capsys):
    """`jaxwap calibrate --contribute RUNS` after measuring: a GPU's calibration (here a
    recorded A100 one, the measurement stubbed) joins the runs file; a CPU's is refused
    with exit status 1, naming the kind, and its calibration is still saved."""
    import jaxwap.cli.calibrate as cal_cli
    from jaxwap.hardware.calibration import Calibration

    def calibrated(record):
        spec = DeviceSpec.from_dict(record["spec"])
        return Calibration(spec, record["device_kind"], record.get("platform", "gpu"), 1,
                           "0.11.2", "580", {}, ())

    runs = tmp_path / "runs.json"
    save_runs(RUNS, runs)
    monkeypatch.setattr(cal_cli, "calibrate_full", lambda **kw: calibrated(_a100_record()))
    assert cli(["calibrate", "--contribute", str(runs)]) == 0
    assert "contributed" in capsys.readouterr().out
    assert [r.profile for r in load_runs(runs)].count("a100-sxm-80gb") == 1
    cpu = dict(_a100_record(), device_kind="cpu", platform="cpu")
    monkeypatch.setattr(cal_cli, "calibrate_full", lambda **kw: calibrated(cpu))
    assert cli(["calibrate", "--contribute", str(runs)]) == 1
    assert "not contributed" in capsys.readouterr().err
    assert len(load_runs(runs)) == len(RUNS) + 1
