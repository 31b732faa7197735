"""`jaxwap calibrate`: the command that measures and caches this machine's profile
(`calibrate.calibrate_full`), on one process or, with a coordinator, as one process of a
jax.distributed cluster (run once per process). Its own module so that the measurement
(`calibration/calibrate.py`) keeps to measuring; `cli.main` builds its command from
`add_command`."""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jaxwap.calibration.calibrate import calibrate_full
from jaxwap.calibration.store import calibration_path
from jaxwap.cli.profiles import contribute
from jaxwap.core.progress import from_interrupt, interrupted
from jaxwap.hardware.measured_runs import RUNS_FILE
from jaxwap.runtime.distributed import start_distributed


def add_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add `jaxwap calibrate` to a command line's subparsers (`add_subparsers()`'s
    result) and return its parser. Its options are defined here once: `main` below and
    the full command line (`jaxwap.cli.main`) both build the command from this. The parsed
    arguments carry `run`, the command's implementation."""
    c = subparsers.add_parser("calibrate", help="measure the device profile and cache it",
                              description="Measure this machine's device profile (matmul "
                              "rates, memory bandwidth, kernel overhead, links, power) and "
                              "cache it; planning for the devices present then uses it.")
    c.add_argument("--quick", action="store_true", help="smaller sizes (seconds)")
    c.add_argument("--fresh", action="store_true", help="ignore a cached calibration")
    c.add_argument("--no-power-limits", action="store_true",
                   help="never set a GPU's power limit (the power-limit curve is then the "
                        "built-in profile's)")
    c.add_argument("--coordinator", metavar="HOST:PORT", help="a cluster: process 0's address")
    c.add_argument("--num-processes", type=int, metavar="N", help="processes in the cluster")
    c.add_argument("--process-id", type=int, metavar="I", help="this process's id, 0..N-1")
    c.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="give up on the cluster after this long (default 60)")
    c.add_argument("--contribute", nargs="?", const=RUNS_FILE, type=Path, metavar="RUNS",
                   help="add the measured shares of the GPU's datasheet to the measured runs "
                        "the built-in profiles of its family read (default: the package's "
                        "committed file; `jaxwap profiles` shows what changed)")
    c.set_defaults(run=lambda args: run(args, c))
    return c


def main(argv: Sequence[str] | None = None) -> int:
    """`jaxwap calibrate [options]` (`add_command`): measure, cache and print the profile.
    `argv` starts with "calibrate", as on the command line; the whole command line is
    `jaxwap.cli.main.main`, this entry point is for calibration alone (a cluster's workers)."""
    p = argparse.ArgumentParser(prog="jaxwap", description="jaxwap command line")
    add_command(p.add_subparsers(dest="command", required=True))
    return run_command(p.parse_args(argv))


# what a command cut short leaves behind: each writes only once its work is complete
LEFT_SAVED = {"calibrate": "nothing was saved (a calibration is written once complete)",
              "plan": "no plan was saved or cached"}


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command; Ctrl-C ends it with one line and exit status 130."""
    try:
        return args.run(args)
    except (KeyboardInterrupt, SystemError) as e:
        if not from_interrupt(e):
            raise
        return interrupted(f"jaxwap {args.command}",
                           LEFT_SAVED.get(args.command, "nothing was saved"))


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """The calibrate command on parsed `args` (see `add_command`); `p` reports misuse.

    With a coordinator, this process first joins a jax.distributed cluster (run the same
    command once per process); when the cluster cannot start within the timeout it says
    why and calibrates its own devices instead (exit status 0)."""
    cluster = (args.coordinator, args.num_processes, args.process_id)
    notes: list[str] = []
    started = False
    if any(v is not None for v in cluster):
        if any(v is None for v in cluster):
            p.error("--coordinator, --num-processes and --process-id go together")
        try:  # before any other jax use
            reason = start_distributed(args.coordinator, args.num_processes,
                                       args.process_id, args.timeout,
                                       heartbeat_timeout_s=max(10, math.ceil(args.timeout)))
        except ValueError as e:
            p.error(str(e))
        where = (f"process {args.process_id} of {args.num_processes}, coordinator "
                 f"{args.coordinator}, timeout {args.timeout:g} s")
        if reason is None:
            started = True
        else:
            print(f"jaxwap calibrate: jax.distributed did not start ({where}): {reason}. "
                  f"Falling back to this process's own devices.", file=sys.stderr, flush=True)
            notes.append(f"fell back to one process: jax.distributed did not start "
                         f"({where}): {reason}")
    try:
        cal = calibrate_full(quick=args.quick, use_cache=not args.fresh, notes=notes,
                             set_power_limits=not args.no_power_limits)
    except Exception:
        if not started:
            raise
        # a peer died mid-way: at exit jax would wait for it (the shutdown barrier) until
        # the heartbeat timeout and then abort; say why and leave now instead
        traceback.print_exc()
        print("jaxwap calibrate: the cluster failed after it started (did a process die?); "
              "leaving now rather than waiting for it", file=sys.stderr, flush=True)
        os._exit(1)
    prefix = f"process {jax.process_index()}: " if cal.num_processes > 1 else ""
    s = cal.spec
    print(prefix + f"{s.name}: {s.peak_flops / 1e12:.3g} Tflop/s bf16, "
          f"{(s.peak_flops_f32 or 0) / 1e12:.3g} Tflop/s f32, "
          f"{s.memory_bandwidth / 1e9:.3g} GB/s, kernel {s.kernel_overhead_s * 1e6:.1f} us, "
          f"half-efficiency at {s.efficiency_half_flops or 0:.3g} flop, links "
          f"{s.link_bandwidth / 1e9:.3g} GB/s / {s.link_latency_s * 1e6:.1f} us, "
          f"{s.idle_watts:.0f}-{s.max_watts:.0f} W (measured on {cal.num_devices} x "
          f"{cal.device_kind} in {cal.num_processes} process(es))")
    for n in cal.notes:
        print(prefix + "note:", n)
    saved = calibration_path(jax.local_devices()[0], None, cal.num_processes)
    print(prefix + "saved:", saved)
    if args.contribute is not None and jax.process_index() == 0:
        try:
            added = contribute(cal.to_dict(), str(saved), args.contribute)
        except (ValueError, OSError) as e:   # no datasheet; a read-only installed package
            print(f"jaxwap calibrate: not contributed to {args.contribute}: {e} (the "
                  f"calibration is saved; `--contribute PATH` writes another runs file)",
                  file=sys.stderr)
            return 1
        print(f"contributed to {args.contribute}: {added.profile} matmul "
              f"{added.matmul_share:.3f}, bandwidth {added.bandwidth_share:.3f} of the datasheet")
    return 0
