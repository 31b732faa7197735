"""Capping GPU power with NVML, undone whatever happens.

The planner's energy model needs to know how much a power cap slows a compute-bound step;
the published curves are generic, so calibration measures it by capping the board and timing
a kernel (`clock_curve`). A cap outlives the process that set it (it is driver state), so a
cap left behind by a crashed run silently slows every later job on that GPU.
``PowerLimitGuard`` therefore remembers the limits it found and puts them back on every exit
path: ``close()``, the end of a ``with`` block (also when the body raises), garbage
collection and interpreter exit. ``limit_range_w`` reads the limits a GPU accepts.

Setting a limit needs root. Where it is refused (or NVML is missing, or the devices are not
GPUs) the guard warns once, says why in ``reason``, and the work runs uncapped: a capped run
is an optimisation, never a requirement, so nothing here stops training.

Usage::

    with PowerLimitGuard(jax.local_devices(), 250.0) as guard:
        jax.block_until_ready(step(state, batch))   # capped at 250 W if guard.applied
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxwap.energy.meter import _describe, _error_types, nvml_handle

__all__ = ["PowerLimitGuard", "device_label", "limit_range_or_reason", "limit_range_w"]


def device_label(device: Any) -> str:
    """Short name of a device for messages ("gpu:1"), readable for real and fake devices."""
    return f"{getattr(device, 'platform', 'unknown')}:{getattr(device, 'id', '?')}"


def _import_nvml(nvml: Any) -> Any:
    """The NVML module to use: the one given (tests pass a fake), else pynvml (lazily)."""
    if nvml is not None:
        return nvml
    import pynvml  # lazy: CPU-only installs need not have it

    return pynvml


def _not_gpus(devices: Sequence[Any]) -> str:
    """Why these devices cannot be power-capped, or "" if they are all GPUs."""
    if not devices:
        return "no devices"
    platforms = sorted({str(getattr(d, "platform", "unknown")) for d in devices})
    return "" if platforms == ["gpu"] else f"devices are {'/'.join(platforms)}, not GPUs"


@dataclass
class _CapState:
    """What undoing a cap needs, and nothing more.

    The guard's finalizer holds this instead of the guard itself (a finalizer that referenced
    the guard would keep it alive forever). It is mutable on purpose: ``changed`` grows as
    each device is capped, so a failure halfway through ``apply`` undoes exactly the devices
    already changed, and it is emptied as they are restored, which makes undoing idempotent.
    """

    nvml: Any
    opened: bool = False  # nvmlInit succeeded and nvmlShutdown is still owed
    changed: list[tuple[str, Any, int]] = field(default_factory=list)  # (label, handle, old mW)


def _undo(state: _CapState) -> list[str]:
    """Put back every changed limit and close NVML; return the failures instead of raising.

    Runs from finalizers and ``__exit__``, where an exception would either be lost or mask
    the caller's own, so every failure becomes a message for one warning.
    """
    failures = []
    while state.changed:
        label, handle, previous_mw = state.changed.pop()
        try:
            state.nvml.nvmlDeviceSetPowerManagementLimit(handle, previous_mw)
        except Exception as err:  # keep restoring the other devices
            failures.append(
                f"{label}: could not restore {previous_mw / 1000:g} W ({_describe(err)})"
            )
    if state.opened:
        state.opened = False
        try:
            state.nvml.nvmlShutdown()
        except Exception:  # the limits are back; a shutdown failure changes nothing
            pass
    return failures


def _undo_and_warn(state: _CapState) -> None:
    """Finalizer body: undo, and warn loudly if a GPU may still be capped."""
    failures = _undo(state)
    if failures:
        warnings.warn(
            "PowerLimitGuard could not restore the power limit of "
            + "; ".join(failures)
            + "; the GPU may still be capped (reset it with `nvidia-smi -pl`)",
            RuntimeWarning,
            stacklevel=2,
        )


class PowerLimitGuard:
    """Caps the power of ``devices`` at ``watts`` and guarantees the previous limits return.

    ``apply()`` reads each device's current limit and allowed range, raises ``ValueError``
    (naming the device and its range) before changing anything if ``watts`` is outside it,
    then sets the cap on every device. If NVML refuses (no permission, not supported, missing,
    non-GPU devices) it restores the devices already capped, warns once (``RuntimeWarning``;
    ``warn=False`` for callers that report ``reason`` themselves), and returns False: the work
    then runs uncapped. Failures while restoring are warned about, never raised.
    """

    reason: str

    def __init__(
        self, devices: Sequence[Any], watts: float, *, nvml: Any = None, warn: bool = True
    ) -> None:
        watts = float(watts)
        if not watts > 0 or watts == float("inf"):
            raise ValueError(
                f"PowerLimitGuard: watts must be a positive finite number, got {watts}"
            )
        self.devices = list(devices)
        self.watts = watts
        self.reason = ""
        self._nvml_arg = nvml
        self._warn = warn
        self._refused = False
        self._state: _CapState | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def applied(self) -> bool:
        """Whether the cap is in force now (set by apply(), not yet restored)."""
        return self._state is not None and bool(self._state.changed)

    # ----------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> PowerLimitGuard:
        self.apply()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()  # returns None: an exception from the body propagates

    def close(self) -> None:
        """Restore the previous limits (same as restore(); for ``contextlib.closing``)."""
        self.restore()

    def restore(self) -> None:
        """Put back the limits read by apply(); idempotent, never raises (failures warn)."""
        if self._finalizer is not None:
            self._finalizer()  # runs _undo_and_warn once; later calls do nothing

    # ---------------------------------------------------------------------------------- apply

    def apply(self) -> bool:
        """Cap every device; True if all are capped, False (with ``reason``) if refused.

        Calling it again while applied does nothing (re-reading would record the cap as the
        "previous" limit); after a refusal it returns False again without retrying.
        """
        if self.applied:
            return True
        if self._refused:
            return False
        why = _not_gpus(self.devices)
        if why:
            return self._refuse(why)
        try:
            nvml = _import_nvml(self._nvml_arg)
        except ImportError as err:
            return self._refuse(f"pynvml not importable ({_describe(err)})")
        state = _CapState(nvml)
        try:
            nvml.nvmlInit()
            state.opened = True
            found = [self._read(nvml, d) for d in self.devices]
        except Exception as err:  # NVML missing or unsupported: run uncapped
            _undo(state)
            return self._refuse(f"NVML power limits unavailable ({_describe(err)})")
        except BaseException:
            _undo(state)
            raise
        target_mw = round(self.watts * 1000)
        bad = [(label, lo, hi) for label, _, _, lo, hi in found if not lo <= target_mw <= hi]
        if bad:
            _undo(state)
            ranges = ", ".join(
                f"{label} allows {lo / 1000:g}-{hi / 1000:g} W" for label, lo, hi in bad
            )
            raise ValueError(
                f"PowerLimitGuard: {self.watts:g} W is outside the allowed power-limit range "
                f"({ranges}); nothing was changed. Pick a limit inside the range "
                "(limit_range_w(device) reports it)."
            )
        self._state = state
        self._finalizer = weakref.finalize(self, _undo_and_warn, state)  # atexit=True default
        why = self._set_all(state, found, target_mw)
        return self._refuse(why) if why else True

    def _read(self, nvml: Any, device: Any) -> tuple[str, Any, int, int, int]:
        """(label, handle, current mW, min mW, max mW) of one device."""
        handle, _ = nvml_handle(nvml, device)
        current = int(nvml.nvmlDeviceGetPowerManagementLimit(handle))
        lo, hi = nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
        return device_label(device), handle, current, int(lo), int(hi)

    def _set_all(
        self, state: _CapState, found: list[tuple[str, Any, int, int, int]], target_mw: int
    ) -> str:
        """Set the cap device by device; "" when all are set, else why not (for _refuse, which
        undoes the devices already set)."""
        errors = _error_types(state.nvml)
        for label, handle, current, _, _ in found:
            state.changed.append((label, handle, current))  # before the call: see BaseException
            try:
                state.nvml.nvmlDeviceSetPowerManagementLimit(handle, target_mw)
            except errors as err:  # NVML reported the refusal: this device is unchanged
                state.changed.pop()
                return f"cannot cap {label} at {self.watts:g} W ({_describe(err)})"
            except Exception as err:  # unknown failure: restore this device too, to be safe
                return f"capping {label} at {self.watts:g} W failed ({_describe(err)})"
            except BaseException:  # KeyboardInterrupt and the like: undo, then let it through
                _undo_and_warn(state)
                raise
        self.reason = ""
        return ""

    def _refuse(self, reason: str) -> bool:
        """Undo whatever was set, record why, warn once per guard, and report False."""
        failures = _undo(self._state) if self._state is not None else []
        if failures:
            reason += "; and could not restore " + "; ".join(failures)
        self.reason = reason
        if self._warn and not self._refused:
            warnings.warn(
                f"PowerLimitGuard: power limit of {self.watts:g} W not applied ({reason}); "
                "the step runs uncapped",
                RuntimeWarning,
                stacklevel=3,
            )
        self._refused = True
        return False


# ------------------------------------------------------------------------- the allowed range


def limit_range_or_reason(device: Any, nvml: Any) -> tuple[float, float, float] | str:
    """(min, max, default) W of one device, or why they cannot be read."""
    why = _not_gpus([device])
    if why:
        return why
    try:
        nvml = _import_nvml(nvml)
    except ImportError as err:
        return f"pynvml not importable ({_describe(err)})"
    opened = False
    try:
        nvml.nvmlInit()
        opened = True
        handle, _ = nvml_handle(nvml, device)
        lo, hi = nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
        default = nvml.nvmlDeviceGetPowerManagementDefaultLimit(handle)
        return float(lo) / 1000, float(hi) / 1000, float(default) / 1000
    except Exception as err:  # NVML missing or unsupported: callers fall back
        return f"NVML power limits unavailable on {device_label(device)} ({_describe(err)})"
    finally:
        if opened:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass


def limit_range_w(device: Any, *, nvml: Any = None) -> tuple[float, float, float] | None:
    """(min, max, default) power limit of a GPU in watts, or None without NVML or a GPU."""
    found = limit_range_or_reason(device, nvml)
    return None if isinstance(found, str) else found
