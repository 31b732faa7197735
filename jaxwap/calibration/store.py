"""Where calibrations are kept on disk, and how the processes of a cluster share them.

A calibration is kept per device kind, driver, jax version and process count
(`calibration_path`): links between processes are not links inside one, so a cluster's
calibration has a file of its own. A bad file counts as none (`load_calibration`), and a
save that fails warns rather than losing the measurement. Under jax.distributed the
processes decide together: all reuse a cached record or all measure
(`reusable_calibration`), since a measuring process needs its peers for the collectives;
and after measuring, process 0 writes first, then only a process whose directory lacks
the same profile (another machine's disk), so processes sharing a disk never race on the
file (`store_calibration`).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import jax

from jaxwap.core.paths import default_cache_dir, driver_version
from jaxwap.hardware.calibration import Calibration
from jaxwap.runtime.distributed import all_processes


def calibration_path(device: Any, directory: Path | None = None,
                     num_processes: int | None = None) -> Path:
    """Where the calibration of this device kind, driver, jax version and process count
    (default: this run's) is kept. Links between processes are not links inside one, so a
    cluster's calibration has a file of its own; one process keeps the plain name."""
    base = Path(directory) if directory is not None else default_cache_dir()
    kind = "".join(c if c.isalnum() else "-" for c in device.device_kind.lower())
    procs = jax.process_count() if num_processes is None else int(num_processes)
    name = f"{device.platform}-{kind}-jax{jax.__version__}-driver{driver_version()}"
    return base / "calibration" / (name + (f"-{procs}proc" if procs > 1 else "") + ".json")


def load_calibration(device: Any, directory: Path | None = None,
                     num_processes: int | None = None) -> Calibration | None:
    """The cached calibration for this device kind and process count (default: this
    run's), or None (a bad file counts as none)."""
    path = calibration_path(device, directory, num_processes)
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_calibration(cal: Calibration, path: Path) -> None:
    """Write `cal` to `path` whole, or warn: a read-only cache must not lose the
    measurement. The warning names the caller of `calibrate_full` (`store_calibration`
    and `calibrate_full` are the two frames between)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a temporary name of this process's own; the rename is atomic (whole records)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cal.to_dict(), indent=1))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache must not lose the measurement
        warnings.warn(f"could not save the calibration to {path}: {e}", stacklevel=4)


def reusable_calibration(device: Any, directory: Path | None, num_devices: int,
                         num_processes: int) -> Calibration | None:
    """The cached calibration of `device` when it was measured across the same devices
    and processes, else None. In a cluster every process must call this (a collective):
    all reuse or all measure, since a measuring process needs its peers."""
    cached = load_calibration(device, directory, num_processes)
    hit = cached is not None and cached.num_devices == num_devices \
        and cached.num_processes == num_processes
    if num_processes > 1:  # all reuse or all measure: a measuring process needs its peers
        hit = all_processes(hit)
    return cached if hit and cached is not None else None


def store_calibration(cal: Calibration, device: Any, directory: Path | None) -> None:
    """Keep `cal`, measured on `device` (this process's own). In a cluster every process
    must call this (a collective): process 0 writes, and then (a barrier) only a process
    whose directory lacks the same profile (another machine's disk), so that processes
    sharing a disk never race on the file."""
    procs, me = cal.num_processes, jax.process_index()
    path = calibration_path(device, directory, procs)
    if procs == 1 or me == 0:
        save_calibration(cal, path)
    if procs > 1 and all_processes(True) and me != 0:
        there = load_calibration(device, directory, procs)
        if there is None or there.spec != cal.spec:
            save_calibration(cal, path)


__all__ = ["calibration_path", "load_calibration", "reusable_calibration", "save_calibration",
           "store_calibration"]
