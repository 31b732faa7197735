"""How far the calibrated matmul peak moves between calibrations on this machine.

    .venv/bin/python benchmarks/calibration_spread.py            # 6 runs in each of 3 processes
    .venv/bin/python benchmarks/calibration_spread.py --runs 4 --processes 2 --out /tmp/x

`measured.py` calibrates the profile just before each model and the planner predicts with
it, so a probe that swings makes the step-time error swing with it: in one run of it the
one-device f32 peak came out 168, 213, 293 and 447 Gflop/s within minutes, on a 2-core
Zen 4 whose peak is about 230. This runs `probes.matmul_curve` (the f32 curve
`jaxwap.calibrate` fits its peak to) several times in each of several fresh processes, one
CPU device on both cores, and records every peak and its spread.

Writes `benchmarks/results/calibration_spread_cpu.json` and `.md` (or `--out` + those
suffixes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SIZES = (64, 128, 256, 512)   # the sizes `calibrate_full` times the curve at


def worker(runs: int) -> None:
    """Print one JSON line: the peaks and per-size rates of `runs` matmul curves."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp

    from jaxwap import probes
    from jaxwap.progress import Progress

    dev = jax.devices()[0]
    out = []
    for _ in range(runs):
        r = probes.matmul_curve(dev, jnp.float32, SIZES, Progress(1, False, ""))
        out.append({"peak_flops": r["peak_flops"],
                    "rates": [w / t for w, t in zip(r["work_flops"], r["seconds"], strict=True)]})
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6, help="curves per process")
    ap.add_argument("--processes", type=int, default=3, help="fresh processes")
    ap.add_argument("--out", default=str(RESULTS / "calibration_spread_cpu"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.runs)
        return
    curves = []
    for p in range(args.processes):
        done = subprocess.run([sys.executable, __file__, "--worker", "--runs", str(args.runs)],
                              capture_output=True, text=True, check=True)
        got = json.loads(done.stdout.strip().splitlines()[-1])
        for k, c in enumerate(got):
            curves.append({"process": p, "run": k, **c})
            print(f"process {p} run {k}: peak {c['peak_flops'] / 1e9:6.1f} Gflop/s, rates "
                  f"{[round(x / 1e9) for x in c['rates']]}", flush=True)
    peaks = [c["peak_flops"] / 1e9 for c in curves]
    first = [c["peak_flops"] / 1e9 for c in curves if c["run"] == 0]
    summary = {"min_gflops": min(peaks), "max_gflops": max(peaks),
               "max_over_min": max(peaks) / min(peaks), "first_runs_gflops": first}
    print(f"peak over {len(peaks)} curves: {min(peaks):.1f}-{max(peaks):.1f} Gflop/s "
          f"({summary['max_over_min']:.2f}x)")
    record = {"command": "python benchmarks/calibration_spread.py "
                         + " ".join(sys.argv[1:]),
              "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "basis": "measured: probes.matmul_curve (f32, sizes 64-512), one CPU device on "
                       "both cores, each process fresh",
              "sizes": list(SIZES), "curves": curves, "summary": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"Measured on this machine's CPU, {record['date_utc']}: the f32 matmul peak "
             f"`probes.matmul_curve` fits, {args.runs} curves in each of {args.processes} "
             f"fresh processes (one device, both cores). Command: `{record['command']}`.", "",
             f"Peak: {min(peaks):.1f}-{max(peaks):.1f} Gflop/s "
             f"({summary['max_over_min']:.2f}x); each process's first curve: "
             + ", ".join(f"{x:.1f}" for x in first), "",
             "| process | run | peak Gflop/s | rate at " + " / ".join(map(str, SIZES)) + " |",
             "|---|---|---|---|"]
    lines += [f"| {c['process']} | {c['run']} | {c['peak_flops'] / 1e9:.1f} | "
              + " / ".join(f"{x / 1e9:.0f}" for x in c["rates"]) + " |" for c in curves]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
