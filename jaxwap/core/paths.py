"""Where jaxwap keeps files between runs (plans, calibrations).

A module of its own, importing nothing of jaxwap, so that any layer (the plan cache,
calibration) can find the directory without importing the layers above it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

ENV_VAR = "JAXWAP_CACHE_DIR"


def default_cache_dir() -> Path:
    """`$JAXWAP_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxwap`, else `~/.cache/jaxwap`.

    Empty variables count as unset, and a relative XDG_CACHE_HOME is ignored, as the XDG
    base-directory specification says. Read at each call, not at import, so a test or a
    program may set the variable after importing jaxwap.
    """
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "jaxwap"
    return Path.home() / ".cache" / "jaxwap"


@functools.lru_cache(maxsize=1)
def driver_version() -> str:
    """The GPU driver's version (NVML), part of a calibration file's name: a new driver
    is new kernels. "none" without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML: the driver is not part of the key
        return "none"


__all__ = ["ENV_VAR", "default_cache_dir", "driver_version"]
