"""What every benchmark script repeats: where its records go, how it names the command that
made them, the moment and machine it ran on, and writing the JSON + Markdown pair.

Imports no jax at module level, on purpose: several scripts must set `XLA_FLAGS` (the number
of simulated CPU devices) before jax is first imported, and they import this module before
that point. `environment()` imports jax when it is called, by which time the script has set
its flags.

A record lives at `benchmarks/results/<benchmark>/<device-or-variant>.{json,md}`: one folder
per benchmark, one file per device (or tagged variant), the latest run only (git keeps the
earlier ones), so a reader finds a record by what it measures rather than by a run number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the repository root: spawned workers run from here, so `-m benchmarks....` resolves
ROOT = Path(__file__).resolve().parent.parent
#: where every benchmark's records live, one folder per benchmark
RESULTS = ROOT / "benchmarks" / "results"


def results_dir(benchmark: str) -> Path:
    """The folder of one benchmark's records (`results/<benchmark>/`), not created here:
    a script that only reads a record must not leave an empty folder behind."""
    return RESULTS / benchmark


def parser(doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """An argument parser described by the first line of the script's docstring, the line
    that says which question the script answers (what `--help` should lead with)."""
    return argparse.ArgumentParser(description=(doc or "").splitlines()[0], **kwargs)


def command(module: str, argv: list[str] | None = None) -> str:
    """The command that reproduces this run, as a record states it: the module run with
    `python -m` from the repository root and the arguments given (`sys.argv[1:]` unless
    `argv` is passed, for a `main(argv)` called from a test)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python -m", module, *map(shlex.quote, args)]).strip()


def worker(module: str, *args: str) -> list[str]:
    """The argv of a worker process running `module` (its own script, usually) with `args`:
    `python -m` so that its package imports resolve; run it with `cwd=ROOT`. A parent run
    with `-P` (PYTHONPATH ahead of the repository root, to time an earlier checkout's
    jaxwap) passes it on, so the worker imports the same jaxwap."""
    return [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m", module, *args]


def date_utc(minutes: bool = False) -> str:
    """Now in UTC: ISO 8601 to the second, or `YYYY-MM-DD HH:MM` where a record has always
    stated it to the minute (the scripts keep the format their records already use)."""
    now = datetime.datetime.now(datetime.UTC)
    return now.strftime("%Y-%m-%d %H:%M") if minutes else now.isoformat(timespec="seconds")


def cpu_line(affinity: bool = False) -> str:
    """The host as the CPU records describe it: architecture and core count, and with
    `affinity` the cores this process may run on (a timing record pinned to fewer says so)."""
    line = f"{platform.machine()}, {os.cpu_count()} cores"
    return f"{line}, this process on {len(os.sched_getaffinity(0))}" if affinity else line


def environment(module: str, argv: list[str] | None = None) -> dict[str, Any]:
    """The run's setting for a new record: command, date, jax and jaxlib versions, the first
    device's kind and platform, the host and its CPU count. jax is imported here, so call
    this only after the script has set its `XLA_FLAGS`."""
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {"command": command(module, argv), "date_utc": date_utc(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "device": dev.device_kind, "platform": dev.platform,
            "python": platform.python_version(), "cpu": cpu_line()}


def write_record(stem: Path, record: Any, markdown: str | None = None, *,
                 indent: int | None = 1, newline: bool = True,
                 default: Callable[[Any], Any] | None = None) -> Path:
    """Write `stem.json` (and `stem.md` when `markdown` is given), creating the folder.

    `indent` and `newline` keep each script's own JSON layout (most write indent 1 and a
    final newline), so a regenerated record differs from the last one by its figures only;
    `default` is `json.dumps`'s, for records holding values JSON has no type for.
    Returns the JSON's path.
    """
    stem.parent.mkdir(parents=True, exist_ok=True)
    path = stem.with_name(stem.name + ".json")
    path.write_text(json.dumps(record, indent=indent, default=default) + ("\n" if newline else ""))
    if markdown is not None:
        stem.with_name(stem.name + ".md").write_text(markdown)
    return path
