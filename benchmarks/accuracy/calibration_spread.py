"""How far the calibrated matmul peak moves between calibrations on this machine.

    .venv/bin/python -m benchmarks.accuracy.calibration_spread   # 6 runs in each of 3 processes
    .venv/bin/python -m benchmarks.accuracy.calibration_spread --runs 4 --processes 2 --out /tmp/x
    .venv/bin/python -m benchmarks.accuracy.calibration_spread --dense   # the dense-layer curve

`measured.py` calibrates the profile just before each model and the planner predicts with
it, so a probe that swings makes the step-time error swing with it: in one run of it the
one-device f32 peak came out 168, 213, 293 and 447 Gflop/s within minutes, on a 2-core
Zen 4 whose peak is about 230. This runs `probes.matmul_curve` (the f32 curve
`jaxwap.calibrate` fits its peak to) several times in each of several fresh processes, one
CPU device on both cores, and records every peak and its spread. With `--dense`, the same
for `probes.matmul_training` (the dense layers in a step's three forms the efficiency curve
`matmul_efficiency` is made of), at the calibration's sizes: each size's rate and its
spread.

Writes `benchmarks/results/calibration_spread/cpu.json` and `.md` (`cpu_dense.*` with
`--dense`; or `--out` + those suffixes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from benchmarks import harness

RESULTS = harness.results_dir("calibration_spread")
MODULE = "benchmarks.accuracy.calibration_spread"   # this script, as `python -m` runs it
SIZES = (64, 128, 256, 512)   # the sizes `calibrate_full` times the curve at


def worker(runs: int, dense: bool) -> None:
    """Print one JSON line: the peaks and per-size rates of `runs` matmul curves (with
    `dense`, the dense-layer curve's per-size rates; its peak, the best of them)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp

    from jaxwap.calibration import probes
    from jaxwap.core.progress import Progress

    dev = jax.devices()[0]
    out = []
    for _ in range(runs):
        if dense:
            timed = probes.matmul_training(dev, jnp.float32, dense_sizes(),
                                           Progress(1, False, ""))
            rates = [w / t for w, t in timed]
            out.append({"peak_flops": max(rates), "rates": rates})
            continue
        r = probes.matmul_curve(dev, jnp.float32, SIZES, Progress(1, False, ""))
        out.append({"peak_flops": r["peak_flops"],
                    "rates": [w / t for w, t in zip(r["work_flops"], r["seconds"], strict=True)]})
    print(json.dumps(out))


def dense_sizes() -> list[int]:
    """The dense-layer sizes `calibrate_full` times on a CPU."""
    from jaxwap.calibration import probes

    return probes.sizes_for(True, False)[1]


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--runs", type=int, default=6, help="curves per process")
    ap.add_argument("--processes", type=int, default=3, help="fresh processes")
    ap.add_argument("--out", default=str(RESULTS / "cpu"))
    ap.add_argument("--dense", action="store_true",
                    help="the dense-layer curve (matmul_efficiency) instead of the peak")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dense and args.out == ap.get_default("out"):
        args.out = str(RESULTS / "cpu_dense")
    if args.worker:
        worker(args.runs, args.dense)
        return
    sizes = dense_sizes() if args.dense else list(SIZES)
    curves = []
    for p in range(args.processes):
        done = subprocess.run(harness.worker(MODULE, "--worker", "--runs", str(args.runs),
                                             *(["--dense"] if args.dense else [])),
                              capture_output=True, text=True, check=True, cwd=harness.ROOT)
        got = json.loads(done.stdout.strip().splitlines()[-1])
        for k, c in enumerate(got):
            curves.append({"process": p, "run": k, **c})
            print(f"process {p} run {k}: peak {c['peak_flops'] / 1e9:6.1f} Gflop/s, rates "
                  f"{[round(x / 1e9) for x in c['rates']]}", flush=True)
    peaks = [c["peak_flops"] / 1e9 for c in curves]
    first = [c["peak_flops"] / 1e9 for c in curves if c["run"] == 0]
    by_size = list(zip(*(c["rates"] for c in curves), strict=True))
    summary = {"min_gflops": min(peaks), "max_gflops": max(peaks),
               "max_over_min": max(peaks) / min(peaks), "first_runs_gflops": first,
               "max_over_min_by_size": [max(r) / min(r) for r in by_size]}
    print(f"peak over {len(peaks)} curves: {min(peaks):.1f}-{max(peaks):.1f} Gflop/s "
          f"({summary['max_over_min']:.2f}x)")
    record = {"command": harness.command(MODULE), "date_utc": harness.date_utc(),
              "basis": f"measured: probes.{'matmul_training' if args.dense else 'matmul_curve'} "
                       f"(f32, sizes {sizes[0]}-{sizes[-1]}), one CPU device on both cores, "
                       f"each process fresh",
              "sizes": sizes, "curves": curves, "summary": summary}
    out = Path(args.out)
    what = ("the f32 dense-layer curve `probes.matmul_training` measures (its peak: the "
            "best size)" if args.dense else "the f32 matmul peak `probes.matmul_curve` fits")
    lines = [f"Measured on this machine's CPU, {record['date_utc']}: {what}, {args.runs} "
             f"curves in each of {args.processes} fresh processes (one device, both cores). "
             f"Command: `{record['command']}`.", "",
             f"Peak: {min(peaks):.1f}-{max(peaks):.1f} Gflop/s "
             f"({summary['max_over_min']:.2f}x); each process's first curve: "
             + ", ".join(f"{x:.1f}" for x in first) + "; each size's max / min: "
             + ", ".join(f"{n} {r:.2f}x" for n, r in zip(
                 sizes, summary["max_over_min_by_size"], strict=True)), "",
             "| process | run | peak Gflop/s | rate at " + " / ".join(map(str, sizes)) + " |",
             "|---|---|---|---|"]
    lines += [f"| {c['process']} | {c['run']} | {c['peak_flops'] / 1e9:.1f} | "
              + " / ".join(f"{x / 1e9:.0f}" for x in c["rates"]) + " |" for c in curves]
    harness.write_record(out, record, "\n".join(lines) + "\n")
    print(f"wrote {out}.md")


if __name__ == "__main__":
    main()
