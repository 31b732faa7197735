"""PowerLimitGuard and the clock-curve measurement against a fake NVML.

A power cap is driver state that outlives the process, so the point of these tests is that
every exit path (close, ``with``, an exception, garbage collection, interpreter exit, a
failure halfway through ``apply``) leaves each fake GPU at exactly the limit it had before.
No GPU, pynvml or root is needed; nothing sleeps.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from jaxwap.energy.clock_curve import measure_clock_curve
from jaxwap.energy.power_limit import PowerLimitGuard, limit_range_w

pytestmark = pytest.mark.filterwarnings("error")  # an unexpected warning fails the test

DEFAULT_MW = 300_000
MIN_MW = 100_000
MAX_MW = 400_000


@dataclass(frozen=True)
class FakeGpu:
    """Just enough of a jax GPU device: NVML finds it by ``id`` (no pci_bus_id)."""

    id: int
    platform: str = "gpu"


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """A pynvml stand-in holding each GPU's power limit in mW.

    start_mw: the limit each device has before the test (may differ from the default).
    refuse: every set raises NVMLError("Insufficient Permissions"), like a non-root user.
    crash_on: {index: exception} raised by the first set on that device.
    fail_restore_on: devices whose sets succeed once, then raise (restore fails).
    """

    NVMLError = FakeNVMLError

    def __init__(
        self,
        n: int = 2,
        *,
        start_mw: int = DEFAULT_MW,
        refuse: bool = False,
        crash_on: dict[int, BaseException] | None = None,
        fail_restore_on: frozenset[int] = frozenset(),
    ) -> None:
        self.limits = {i: start_mw for i in range(n)}
        self.refuse = refuse
        self.crash_on = dict(crash_on or {})
        self.fail_restore_on = fail_restore_on
        self.sets: list[tuple[int, int]] = []  # (index, mW) of every successful set
        self.inits = 0
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetPowerManagementLimit(self, h: int) -> int:
        return self.limits[h]

    def nvmlDeviceGetPowerManagementLimitConstraints(self, h: int) -> tuple[int, int]:
        return MIN_MW, MAX_MW

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: int) -> int:
        return DEFAULT_MW

    def nvmlDeviceSetPowerManagementLimit(self, h: int, mw: int) -> None:
        if self.refuse:
            raise FakeNVMLError("Insufficient Permissions")
        if h in self.crash_on:
            raise self.crash_on.pop(h)
        if h in self.fail_restore_on and any(i == h for i, _ in self.sets):
            raise FakeNVMLError("GPU is lost")
        self.limits[h] = mw
        self.sets.append((h, mw))


GPUS = [FakeGpu(0), FakeGpu(1)]


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_apply_sets_milliwatts_and_close_restores_original_limits() -> None:
    fake = FakeNVML(start_mw=280_000)
    guard = PowerLimitGuard(GPUS, 200.0, nvml=fake)
    assert guard.apply() is True
    assert guard.applied and guard.reason == ""
    assert fake.limits == {0: 200_000, 1: 200_000}
    guard.close()
    assert fake.limits == {0: 280_000, 1: 280_000}  # what was there, not the default
    assert not guard.applied
    assert (fake.inits, fake.shutdowns) == (1, 1)


def test_out_of_range_request_raises_naming_device_and_range_and_changes_nothing() -> None:
    fake = FakeNVML()
    guard = PowerLimitGuard(GPUS, 450.0, nvml=fake)
    with pytest.raises(ValueError, match=r"450 W.*gpu:0 allows 100-400 W, gpu:1 allows 100-400"):
        guard.apply()
    assert fake.sets == []
    assert not guard.applied
    assert fake.shutdowns == fake.inits == 1


def test_refused_set_warns_once_at_caller_returns_false_and_changes_nothing() -> None:
    fake = FakeNVML(refuse=True)
    guard = PowerLimitGuard(GPUS, 200.0, nvml=fake)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert guard.apply() is False
        assert guard.apply() is False  # asking again neither retries nor warns again
        guard.restore()
    assert len(caught) == 1
    assert caught[0].category is RuntimeWarning
    assert caught[0].filename == __file__  # points at the caller of apply()
    assert "Insufficient Permissions" in str(caught[0].message)
    assert "uncapped" in str(caught[0].message)
    assert "gpu:0" in guard.reason and "Insufficient Permissions" in guard.reason
    assert fake.limits == {0: DEFAULT_MW, 1: DEFAULT_MW} and fake.sets == []
    assert not guard.applied


def test_failure_on_second_device_restores_first_before_warning() -> None:
    fake = FakeNVML(crash_on={1: RuntimeError("device fell off the bus")})
    guard = PowerLimitGuard(GPUS, 200.0, nvml=fake)
    with pytest.warns(RuntimeWarning, match="gpu:1.*fell off the bus"):
        assert guard.apply() is False
    assert fake.limits == {0: DEFAULT_MW, 1: DEFAULT_MW}
    assert fake.sets == [(0, 200_000), (0, DEFAULT_MW)]
    assert fake.shutdowns == 1


def test_unexpected_error_in_set_restores_every_touched_device() -> None:
    # Not an NVML error: the in-flight device may or may not be capped, so it is restored too.
    fake = FakeNVML(crash_on={1: ZeroDivisionError("bug in the bindings")})
    guard = PowerLimitGuard(GPUS, 200.0, nvml=fake)
    with pytest.warns(RuntimeWarning, match="bug in the bindings"):
        assert guard.apply() is False
    assert fake.limits == {0: DEFAULT_MW, 1: DEFAULT_MW}
    assert sorted(fake.sets[1:]) == [(0, DEFAULT_MW), (1, DEFAULT_MW)]


def test_keyboard_interrupt_during_apply_restores_and_propagates() -> None:
    fake = FakeNVML(crash_on={1: KeyboardInterrupt()})
    guard = PowerLimitGuard(GPUS, 200.0, nvml=fake)
    with pytest.raises(KeyboardInterrupt):
        guard.apply()
    assert fake.limits == {0: DEFAULT_MW, 1: DEFAULT_MW}
    assert not guard.applied


def test_with_block_restores_when_body_raises_and_exception_propagates() -> None:
    fake = FakeNVML()
    with pytest.raises(ZeroDivisionError):
        with PowerLimitGuard(GPUS, 150.0, nvml=fake) as guard:
            assert fake.limits == {0: 150_000, 1: 150_000}
            1 / 0  # noqa: B018
    assert fake.limits == {0: DEFAULT_MW, 1: DEFAULT_MW}
    assert not guard.applied


def test_garbage_collection_restores_limits() -> None:
    fake = FakeNVML()
    guard = PowerLimitGuard(GPUS, 150.0, nvml=fake)
    guard.apply()
    assert fake.limits == {0: 150_000, 1: 150_000}
    del guard
    gc.collect()
    assert fake.limits == {0: DEFAULT_MW, 1: DEFAULT_MW}
    assert fake.shutdowns == 1


def test_restore_is_idempotent() -> None:
    fake = FakeNVML()
    guard = PowerLimitGuard(GPUS, 150.0, nvml=fake)
    guard.apply()
    guard.restore()
    guard.restore()
    guard.close()
    assert fake.sets == [(0, 150_000), (1, 150_000), (1, DEFAULT_MW), (0, DEFAULT_MW)]
    assert fake.shutdowns == 1


def test_apply_twice_keeps_the_original_limit_to_restore() -> None:
    fake = FakeNVML()
    guard = PowerLimitGuard(GPUS, 150.0, nvml=fake)
    assert guard.apply() and guard.apply()
    guard.restore()
    assert fake.limits == {0: DEFAULT_MW, 1: DEFAULT_MW}


def test_failed_restore_warns_naming_device_and_does_not_raise() -> None:
    fake = FakeNVML(fail_restore_on=frozenset({1}))
    guard = PowerLimitGuard(GPUS, 150.0, nvml=fake)
    guard.apply()
    with pytest.warns(RuntimeWarning, match=r"gpu:1: could not restore 300 W.*GPU is lost"):
        guard.restore()
    assert fake.limits[0] == DEFAULT_MW  # the other device is still restored
    assert fake.shutdowns == 1


def test_finalizer_is_registered_for_interpreter_exit() -> None:
    guard = PowerLimitGuard(GPUS, 150.0, nvml=FakeNVML())
    guard.apply()
    assert guard._finalizer is not None and guard._finalizer.atexit is True
    guard.restore()


def test_interpreter_exit_restores_limits(tmp_path: Path) -> None:
    log = tmp_path / "sets.txt"
    script = textwrap.dedent(
        f"""
        from dataclasses import dataclass
        from jaxwap.energy.power_limit import PowerLimitGuard

        @dataclass(frozen=True)
        class Gpu:
            id: int
            platform: str = "gpu"

        class Nvml:
            NVMLError = RuntimeError
            def nvmlInit(self): pass
            def nvmlShutdown(self): pass
            def nvmlDeviceGetHandleByIndex(self, i): return i
            def nvmlDeviceGetPowerManagementLimit(self, h): return 300000
            def nvmlDeviceGetPowerManagementLimitConstraints(self, h): return 100000, 400000
            def nvmlDeviceSetPowerManagementLimit(self, h, mw):
                with open({str(log)!r}, "a") as f:
                    f.write(f"{{h}} {{mw}}\\n")

        GUARD = PowerLimitGuard([Gpu(0)], 150.0, nvml=Nvml())  # module global: never collected
        assert GUARD.apply()
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert log.read_text().split("\n") == ["0 150000", "0 300000", ""]


def test_cpu_devices_are_not_capped_and_say_why() -> None:
    fake = FakeNVML()
    guard = PowerLimitGuard([FakeGpu(0, platform="cpu")], 150.0, nvml=fake)
    with pytest.warns(RuntimeWarning, match="devices are cpu"):
        assert guard.apply() is False
    assert "devices are cpu" in guard.reason
    assert fake.inits == 0 and fake.sets == []


def test_missing_pynvml_is_not_applied_with_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    guard = PowerLimitGuard(GPUS, 150.0)
    with pytest.warns(RuntimeWarning, match="pynvml not importable"):
        assert guard.apply() is False
    assert guard.reason.startswith("pynvml not importable")


def test_nonpositive_watts_raise_naming_the_value() -> None:
    with pytest.raises(ValueError, match="got -5.0"):
        PowerLimitGuard(GPUS, -5.0, nvml=FakeNVML())


def test_limit_range_w_reports_min_max_default_watts_or_none() -> None:
    assert limit_range_w(GPUS[0], nvml=FakeNVML()) == (100.0, 400.0, 300.0)
    assert limit_range_w(FakeGpu(0, platform="cpu"), nvml=FakeNVML()) is None


class FakeClock:
    """A timer that only moves when the fake kernel 'runs'."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _kernel_on(fake: FakeNVML, clock: FakeClock) -> tuple[list[int], object]:
    """A fake kernel taking 300 W / limit seconds: slower under a cap, faster above 300 W."""
    calls: list[int] = []

    def run() -> None:
        calls.append(fake.limits[0])
        clock.now += DEFAULT_MW / fake.limits[0]

    return calls, run


def test_measure_clock_curve_returns_time_ratios_and_restores_limit() -> None:
    fake = FakeNVML(1, start_mw=350_000)
    clock = FakeClock()
    calls, run = _kernel_on(fake, clock)
    curve = measure_clock_curve(
        GPUS[0], [150.0, 225.0, 380.0], run, nvml=fake, repeats=3, timer=clock
    )
    # The kernel runs faster at 380 W than at the default, but a fraction never passes 1.
    assert isinstance(curve, tuple)
    assert [w for w, _ in curve] == [150.0, 225.0, 300.0, 380.0]
    assert [f for _, f in curve] == pytest.approx([0.5, 0.75, 1.0, 1.0])
    assert curve[-1][1] == 1.0
    assert len(calls) == 4 * (1 + 3)  # one warm-up and three timed runs per limit
    assert fake.limits == {0: 350_000}  # the limit found, not the default


def test_measure_clock_curve_returns_reason_when_refused() -> None:
    fake = FakeNVML(1, refuse=True)
    clock = FakeClock()
    calls, run = _kernel_on(fake, clock)
    result = measure_clock_curve(GPUS[0], [150.0], run, nvml=fake, timer=clock)
    assert isinstance(result, str) and "Insufficient Permissions" in result
    assert calls == [] and fake.limits == {0: DEFAULT_MW}


def test_measure_clock_curve_rejects_limits_outside_range() -> None:
    fake = FakeNVML(1)
    with pytest.raises(ValueError, match=r"\[50.0\] W are outside gpu:0's allowed range 100-400"):
        measure_clock_curve(GPUS[0], [50.0], lambda: None, nvml=fake)
    assert fake.sets == []


def test_calibration_profile_leaves_limits_alone_when_told() -> None:
    """`calibrate(set_power_limits=False)`'s path: the limits are read, never set, and the
    curve is the built-in profile's, with a note saying why."""
    from jaxwap.energy.clock_curve import measured_power_profile
    from jaxwap.hardware.builtin_profiles import device_spec

    base = device_spec("h100-sxm")
    fake = FakeNVML(1)
    notes: list[str] = []
    prof = measured_power_profile(base, GPUS[0], [70.0, 650.0], 400.0, lambda: None, notes,
                                  set_limits=False, nvml=fake)
    assert fake.sets == [] and fake.limits == {0: DEFAULT_MW}
    assert prof is not None and prof.clock_curve == base.power_profile().clock_curve
    assert prof.limit_range_w == (100.0, 400.0) and prof.default_limit_w == 300.0
    assert prof.matmul_watts == 650.0 and prof.memory_watts == 400.0
    assert any("set_power_limits=False" in n for n in notes)


def test_calibration_profile_measures_the_curve_by_setting_limits(monkeypatch) -> None:
    """The default path: five limits below the default are set in turn, the measured
    curve replaces the built-in one, and the limit found is restored."""
    import functools

    import jaxwap.energy.clock_curve as pl
    from jaxwap.hardware.builtin_profiles import device_spec

    base = device_spec("h100-sxm")
    fake = FakeNVML(1, start_mw=350_000)
    clock = FakeClock()
    _, run = _kernel_on(fake, clock)
    notes: list[str] = []
    monkeypatch.setattr(pl, "measure_clock_curve",
                        functools.partial(pl.measure_clock_curve, timer=clock))
    prof = pl.measured_power_profile(base, GPUS[0], [70.0, 650.0], 400.0, run, notes,
                                     nvml=fake)
    assert prof is not None and prof.clock_curve != base.power_profile().clock_curve
    assert {mw for _, mw in fake.sets} >= {100_000, 140_000, 180_000, 220_000, 260_000}
    assert fake.limits == {0: 350_000}
    assert notes == []
