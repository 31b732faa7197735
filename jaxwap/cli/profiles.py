"""`jaxwap profiles`: the built-in profiles, where each figure comes from, and the measured
runs they are made from.

    jaxwap profiles                          # the provenance table (Markdown)
    jaxwap profiles --add RECORD [...]       # add calibrations to the measured runs
    jaxwap profiles --docs docs/guide/profiles.md [--check]

A calibration on a lent GPU (`jaxwap calibrate --contribute`, or `--add` of its file or of
a `benchmarks/gpu/gpu_sweep.py` record) becomes shares of its datasheet in the committed
runs file (`jaxwap/hardware/measured_runs.json`), which every built-in profile of the
family reads (`measured_runs.carry`): the next user of an A100 gets what an H100 measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from jaxwap.hardware.builtin_profiles import build_profiles
from jaxwap.hardware.measured_runs import (
    RUNS_FILE,
    MeasuredRun,
    load_runs,
    run_from_calibration,
    save_runs,
)
from jaxwap.hardware.provenance import provenance_table, read_block, write_block


def add_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add `jaxwap profiles` to a command line's subparsers and return its parser."""
    c = subparsers.add_parser(
        "profiles", help="the built-in profiles' sources; add measured runs",
        description="Print where each figure of the built-in device profiles comes from, "
        "add calibrations of real GPUs to the measured runs the profiles are made from, or "
        "write the table into a docs page.")
    c.add_argument("--add", nargs="+", metavar="RECORD", type=Path, default=[],
                   help="calibration files (jaxwap calibrate's, or records holding one "
                        "under 'calibration') to add to the measured runs")
    c.add_argument("--runs-file", type=Path, default=RUNS_FILE, metavar="PATH",
                   help=f"the measured runs (default: the package's, {RUNS_FILE.name})")
    c.add_argument("--docs", type=Path, metavar="PAGE",
                   help="write the table into PAGE between its markers")
    c.add_argument("--check", action="store_true",
                   help="with --docs: change nothing; exit 1 when PAGE's table is stale")
    c.set_defaults(run=lambda args: run(args, c))
    return c


def contribute(record: dict[str, Any], source: str, runs_file: Path = RUNS_FILE,
               date_utc: str | None = None) -> MeasuredRun:
    """Add one calibration (`Calibration.to_dict()`) to `runs_file` as shares of its
    datasheet, replacing a run of the same source; the run added. ValueError (naming the
    device kind) for a device with no datasheet here."""
    date_utc = date_utc or datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    new = run_from_calibration(record, source, date_utc)
    save_runs([*load_runs(runs_file), new], runs_file)
    return new


def _calibration_of(path: Path) -> tuple[dict[str, Any], str]:
    d = json.loads(path.read_text())
    cal = d.get("calibration", d)
    if not isinstance(cal, dict) or "spec" not in cal or "device_kind" not in cal:
        raise ValueError(f"{path}: no calibration in it (a 'spec' and 'device_kind', at the "
                         f"top or under 'calibration')")
    return cal, str(d.get("date_utc", ""))


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """The profiles command on parsed `args`; `p` reports misuse."""
    if args.check and args.docs is None:
        p.error("--check goes with --docs PAGE")
    for path in args.add:
        try:
            cal, date = _calibration_of(path)
            added = contribute(cal, str(path), args.runs_file, date or None)
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--add {path}: {e}")
        print(f"added {added.device_kind} ({added.profile}): matmul {added.matmul_share:.3f}, "
              f"f32 {added.f32_share:.3f}, bandwidth {added.bandwidth_share:.3f} of the "
              f"datasheet; to {args.runs_file}")
    _, provenance = build_profiles(load_runs(args.runs_file))
    table = provenance_table(provenance)
    if args.docs is None:
        if not args.add:
            sys.stdout.write(table)
        return 0
    if args.check:
        if read_block(args.docs) != table:
            print(f"{args.docs}: the provenance table is stale; run jaxwap profiles --docs "
                  f"{args.docs}", file=sys.stderr)
            return 1
        print(f"{args.docs}: the provenance table is current")
        return 0
    changed = write_block(args.docs, table)
    print(f"{args.docs}: {'written' if changed else 'already current'}")
    return 0


__all__ = ["add_command", "contribute", "run"]
