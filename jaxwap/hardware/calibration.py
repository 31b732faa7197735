"""The record of a calibrated profile: the `DeviceSpec` measured on the devices present, what
it was measured on, and what was not measured. `jaxwap.calibration` makes and stores it;
cluster detection (`cluster.detect_cluster`) reads it, so the record sits here with the
hardware it describes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jaxwap.hardware.cluster import builtin_for_kind
from jaxwap.hardware.device import BACKEND_FLAGS, DeviceSpec

# 2: num_processes, measurements["link"] what was timed; 4: link latency and collective
# overhead from collectives inside a program; 5: the host's call of a step; 6: the Python
# calls of a step's pytrees (older records are calibrated afresh)
CALIBRATION_FORMAT = 6



@dataclass(frozen=True)
class Calibration:
    """A calibrated profile, what it was measured on, and what was not measured.

    `num_devices` is every device the links were measured across, over `num_processes`
    processes; the per-device figures come from one device per process (their median)."""

    spec: DeviceSpec
    device_kind: str
    platform: str
    num_devices: int
    jax_version: str
    driver: str
    measurements: dict[str, Any]
    notes: tuple[str, ...]
    num_processes: int = 1

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["spec"] = self.spec.to_dict()
        d["notes"] = list(self.notes)
        d["format"] = CALIBRATION_FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        if d.get("format") != CALIBRATION_FORMAT:
            raise ValueError("stale calibration format")
        spec, base = dict(d["spec"]), builtin_for_kind(d["device_kind"], d["platform"])
        spec.update({f: getattr(base, f) for f in BACKEND_FLAGS if f not in spec})
        return cls(DeviceSpec.from_dict(spec), d["device_kind"], d["platform"],
                   d["num_devices"], d["jax_version"], d["driver"], d["measurements"],
                   tuple(d["notes"]), int(d.get("num_processes", 1)))


__all__ = ["CALIBRATION_FORMAT", "Calibration"]
