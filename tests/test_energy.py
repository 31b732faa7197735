"""EnergyMeter against a fake NVML: counter present, counter absent, and failures.

The fake stands in for pynvml so the three measurement paths (energy counter, power polling,
modeled fallback) are exercised on CPU-only CI, including the failures that must never crash
a training run.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import jax
import pytest

from jaxwap.energy.meter import EnergyMeter, EnergyReading, measure_energy

WATTS = 300.0


@dataclass(frozen=True)
class FakeGpu:
    """Just enough of a jax GPU device for the meter: no pci_bus_id, like real jax devices."""

    id: int
    local_hardware_id: int
    platform: str = "gpu"


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """A pynvml stand-in whose devices draw a constant WATTS.

    counter: whether nvmlDeviceGetTotalEnergyConsumption is supported.
    counter_period_s: the counter only advances in steps of this (like the real ~20-100 ms).
    fail_init: nvmlInit raises (no driver).
    fail_after_s: every device query after this long raises (permission lost mid-window).
    """

    NVMLError = FakeNVMLError

    def __init__(
        self,
        *,
        counter: bool = True,
        counter_period_s: float = 0.0,
        fail_init: bool = False,
        fail_after_s: float | None = None,
        watts: float = WATTS,
    ) -> None:
        self.counter = counter
        self.counter_period_s = counter_period_s
        self.fail_init = fail_init
        self.fail_after_s = fail_after_s
        self.watts = watts
        self.t_base = time.perf_counter()
        self.inits = 0
        self.shutdowns = 0
        self.power_calls = 0
        self._called = threading.Condition()

    def _elapsed(self) -> float:
        t = time.perf_counter() - self.t_base
        if self.fail_after_s is not None and t > self.fail_after_s:
            raise FakeNVMLError("Insufficient Permissions")
        return t

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise FakeNVMLError("Driver Not Loaded")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> tuple[str, int]:
        return ("handle", index)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: object) -> int:
        t = self._elapsed()
        if not self.counter:
            raise FakeNVMLError("Not Supported")
        if self.counter_period_s:
            t = math.floor(t / self.counter_period_s) * self.counter_period_s
        return int(self.watts * 1000 * t)  # mJ

    def nvmlDeviceGetPowerUsage(self, handle: object) -> int:
        self._elapsed()
        with self._called:
            self.power_calls += 1
            self._called.notify_all()
        return int(self.watts * 1000)  # mW

    def wait_for_power_calls(self, n: int, timeout_s: float = 60.0) -> None:
        """Until the meter has sampled `n` times: the test waits for the behaviour, not a
        fixed time a loaded machine may not give the polling thread. The timeout is a
        safety net whose expiry is the failure."""
        with self._called:
            assert self._called.wait_for(lambda: self.power_calls >= n, timeout_s), \
                f"the meter sampled power {self.power_calls} times in {timeout_s} s, not {n}"


GPUS = [FakeGpu(0, 0), FakeGpu(1, 1)]


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _poll_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "jaxwap-energy-poll" and t.is_alive()]


def _assert_plausible(reading: EnergyReading, n: int, watts: float = WATTS) -> None:
    # 20%: the fake's clock and the meter's are read microseconds apart at each end of the
    # window, so only a stall of a fifth of the window between two adjacent calls could
    # break it; a wrong unit (mJ against J, mW against W) or a lost device is off 1000x
    assert len(reading.joules) == n
    for j in reading.joules:
        assert j == pytest.approx(watts * reading.seconds, rel=0.2)
    assert reading.total_j == pytest.approx(sum(reading.joules))
    assert reading.avg_power_w == pytest.approx(reading.total_j / reading.seconds)


def test_counter_present() -> None:
    fake = FakeNVML(counter=True)
    with EnergyMeter(GPUS, nvml=fake) as meter:
        time.sleep(0.25)
    r = meter.reading
    assert r is not None and r.source == "nvml-energy-counter"
    assert meter.available and meter.reason == ""
    assert r.seconds >= 0.25
    _assert_plausible(r, 2)
    assert "local_hardware_id" in r.note  # says how devices were matched to NVML
    assert fake.inits == 1 and fake.shutdowns == 1
    assert fake.power_calls == 0  # the counter path does not poll


def test_counter_short_window_is_not_reported_as_zero() -> None:
    fake = FakeNVML(counter=True, counter_period_s=10.0)  # never ticks during the test
    with EnergyMeter(GPUS, nvml=fake) as meter:
        time.sleep(0.01)
    r = meter.reading
    assert r is not None and r.source == "nvml-energy-counter"
    assert "window shorter than the counter's update period" in r.note
    assert all(j > 0 for j in r.joules)
    _assert_plausible(r, 2)


def test_counter_absent_polls_power_and_thread_stops() -> None:
    fake = FakeNVML(counter=False)
    with EnergyMeter(GPUS, nvml=fake, poll_interval_s=0.01) as meter:
        assert len(_poll_threads()) == 1
        # sampled repeatedly while the body runs, not just at the ends (2 devices x 6)
        fake.wait_for_power_calls(2 + 2 * 6)
    r = meter.reading
    assert r is not None and r.source == "nvml-power-polling"
    assert meter.available
    assert "Not Supported" in r.note
    _assert_plausible(r, 2)
    assert meter._thread is None and _poll_threads() == []
    calls = fake.power_calls
    time.sleep(0.05)
    assert fake.power_calls == calls  # nothing samples after exit
    assert fake.shutdowns == 1


def test_init_failure_falls_back_to_modeled() -> None:
    fake = FakeNVML(fail_init=True)
    with EnergyMeter(GPUS, nvml=fake, modeled_power_w=250.0) as meter:
        time.sleep(0.05)
    r = meter.reading
    assert r is not None and r.source == "modeled"
    assert not meter.available and "Driver Not Loaded" in meter.reason
    assert r.note.startswith("NVML unavailable:") and "250 W x 2 devices" in r.note
    _assert_plausible(r, 2, watts=250.0)
    assert fake.shutdowns == 0  # never initialised, so not shut down


@pytest.mark.parametrize("counter", [True, False])
def test_permission_error_mid_window_falls_back(counter: bool) -> None:
    fake = FakeNVML(counter=counter, fail_after_s=0.05)
    with EnergyMeter(GPUS, nvml=fake, modeled_power_w=WATTS, poll_interval_s=0.01) as meter:
        time.sleep(0.15)
    r = meter.reading
    assert r is not None and r.source == "modeled"
    assert "Insufficient Permissions" in meter.reason and "mid-window" in meter.reason
    _assert_plausible(r, 2)
    assert _poll_threads() == []
    assert fake.shutdowns == 1


def test_modeled_without_power_model_reports_zero_with_note() -> None:
    with EnergyMeter(GPUS, nvml=FakeNVML(fail_init=True)) as meter:
        pass
    r = meter.reading
    assert r is not None and r.source == "modeled"
    assert r.joules == (0.0, 0.0) and r.total_j == 0.0
    assert "no modeled_power_w" in r.note


def test_broken_nvml_object_never_raises() -> None:
    class Broken:
        NVMLError = FakeNVMLError

        def nvmlInit(self) -> None:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    with EnergyMeter(GPUS, nvml=Broken(), modeled_power_w=100.0) as meter:
        pass
    assert meter.reading is not None and meter.reading.source == "modeled"
    assert "libnvidia-ml" in meter.reason

    with EnergyMeter(GPUS, nvml=object(), modeled_power_w=100.0) as meter:  # no API at all
        pass
    assert meter.reading is not None and meter.reading.source == "modeled"


def test_cpu_devices_are_modeled() -> None:
    devices = jax.devices("cpu")[:2]
    fake = FakeNVML()
    with EnergyMeter(devices, nvml=fake, modeled_power_w=WATTS) as meter:
        time.sleep(0.05)
    r = meter.reading
    assert r is not None and r.source == "modeled"
    assert meter.reason == "devices are cpu"
    assert r.total_j == pytest.approx(WATTS * r.seconds * len(devices))
    assert f"modeled at 300 W x {len(devices)} devices" in r.note
    assert fake.inits == 0  # NVML is not even tried for CPU devices


def test_default_devices_and_real_pynvml_never_raise() -> None:
    # Default devices are the (CPU) test devices; with fake GPUs the real pynvml is tried and,
    # without a driver, must fail softly.
    with EnergyMeter(modeled_power_w=10.0) as meter:
        pass
    assert meter.reading is not None and meter.reading.source == "modeled"
    with EnergyMeter(GPUS[:1], modeled_power_w=10.0) as meter:
        pass
    assert meter.reading is not None
    assert meter.reading.source in {"modeled", "nvml-energy-counter", "nvml-power-polling"}


def test_body_exception_propagates_but_reading_is_set() -> None:
    fake = FakeNVML(counter=False)
    meter = EnergyMeter(GPUS, nvml=fake, poll_interval_s=0.01)
    with pytest.raises(ValueError), meter:
        raise ValueError("training step failed")
    assert meter.reading is not None and meter.reading.source == "nvml-power-polling"
    assert _poll_threads() == [] and fake.shutdowns == 1


def test_measure_energy_repeats_until_window_is_long_enough() -> None:
    fake = FakeNVML(counter=True, counter_period_s=0.05)
    calls: list[int] = []

    def step() -> None:  # a fast step: far shorter than the counter's update period
        calls.append(1)
        time.sleep(0.002)

    reading, n = measure_energy(step, GPUS, min_window_s=0.1, nvml=fake)
    assert n == len(calls) and n > 1
    assert reading.seconds >= 0.1
    assert reading.source == "nvml-energy-counter"
    assert all(j > 0 for j in reading.joules)
    assert "shorter than the counter" not in reading.note
    _assert_plausible(reading, 2, watts=WATTS)


def test_measure_energy_blocks_on_jax_output_and_caps_repeats() -> None:
    x = jax.numpy.ones((8, 8))
    reading, n = measure_energy(
        lambda: x @ x, jax.devices("cpu")[:1], min_window_s=10.0, max_repeats=3,
        modeled_power_w=50.0,
    )
    assert n == 3
    assert reading.source == "modeled" and len(reading.joules) == 1


def test_accelerator_probes_run_on_any_device_and_power_needs_nvml():
    """The accelerator probes (`jaxwap.calibration.accel_probes`) are plain functions of a device:
    on a CPU the bandwidth is a positive rate, the loads run and return their arrays, and
    without NVML the power probe says so (None) rather than inventing watts."""
    from jaxwap.calibration import accel_probes

    dev = jax.devices()[0]
    bw = accel_probes.stream_bandwidth(dev, 2**22)
    assert math.isfinite(bw) and bw > 1e8
    compute, memory = accel_probes.power_loads(dev, 64, 2**16, chain=2)
    assert compute().shape == (64, 64) and memory().shape == (2**14,)
    assert accel_probes.power([dev], compute, memory, window_s=0.01) is None
