"""One device: measured step time, power, energy and memory next to jaxwap's predictions.

    python -m benchmarks.gpu.gpu_sweep                    # on a GPU: AlexNet, VGG-16, GPT-2
    python -m benchmarks.gpu.gpu_sweep --no-power-limits  # a shared GPU: never set its limit
    .venv/bin/python -m benchmarks.gpu.gpu_sweep --quick  # CPU check of the code path

What runs is what `auto_shard` would run on one device: the planner's one-device candidate
(`make_plan`, analytic), compiled by `verify.compile_candidate` (the function `auto_shard`
compiles through, the state donated) and run on synthetic data as a training loop runs it,
each step's new state the next step's.

The device is calibrated first (`jaxwap.calibrate_full`, in a process of its own), and
every point is predicted three ways: the analytic model with the calibrated profile (what
`auto_shard` plans with on a calibrated machine), the same with the built-in profile of
the device's kind (what it plans with before calibration), and the calibrated model fed
XLA's figures of the compiled program (what verification ranks with). Measured: the median
of per-step times (each step blocks), power and energy from NVML over a window of at least
`--window` seconds (modeled, and labelled so, without NVML), the device's peak memory in
use (its allocator's figure; each model runs in a fresh process and its batches ascend, so
the peak is the point's own where it rose), and XLA's own memory analysis (compiled).

Each model runs in a child process with a time limit, its rows written as they come, so a
slow compile or an out-of-memory batch costs that model's remaining points, not the run.
Writes `benchmarks/results/gpu_sweep/<device>.json`, `.md` and `.png` (or under `--out`), and
its work folder `gpu_sweep_work/` beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

MODULE = "benchmarks.gpu.gpu_sweep"   # this script, as `python -m` runs it
RESULTS = harness.results_dir("gpu_sweep")
#: the power benchmark's workloads (`benchmarks/gpu/power.py`), AlexNet at a larger batch, and
#: ResNet-50 (batch norm, 1x1 convolutions)
POINTS = {"alexnet": (128, 512), "gpt2": (8,), "vgg16": (128,), "resnet50": (128,)}


# ---------------------------------------------------------------------------- workers
def workload(name: str, batch: int, dtype: str, quick: bool) -> Any:
    import jax.numpy as jnp

    from benchmarks.models import zoo

    kw = {"batch_size": batch, "dtype": jnp.dtype(dtype)}
    return zoo.small(name, **kw) if quick else zoo.WORKLOADS[name](**kw)


def predict_point(w: Any, cluster: Any, builtin: Any) -> tuple[Any, Any, Any]:
    """(planned, the one-device candidate, its prediction with the built-in profile): the
    planner's analytic one-device choice, as `auto_shard` plans it."""
    import jaxwap
    from jaxwap.planner import make_plan
    from jaxwap.search.solve import solve_mesh

    planned = make_plan(w.step, w.args, {}, params=w.params, options=jaxwap.PlanOptions(
        hardware=cluster, num_devices=1, verify=0, cache=False))
    r = next(x for x in planned.search.results if x.d * x.m == 1 and x.variant == "planner")
    budget = cluster.device.memory_bytes * 0.9
    return planned, r, solve_mesh(planned.graph, builtin, 1, 1, budget).predicted


def figures(x: Any) -> dict[str, float]:
    """A prediction's figures as the record keeps them."""
    return {"step_time_s": x.step_time_s, "avg_power_w": x.avg_power_w,
            "energy_per_sample_j": x.energy_per_sample_j, "memory_bytes": x.peak_memory_bytes,
            "compute_s": x.compute_time_s, "utilization": x.utilization}


def calibrate_worker(args: argparse.Namespace) -> None:
    """Calibrate the first device (never setting a power limit with --no-power-limits)."""
    import jax

    from jaxwap.calibration.calibrate import calibrate_full

    t0 = time.perf_counter()
    cal = calibrate_full(jax.devices()[:1], progress=False, quick=args.quick,
                         use_cache=False, set_power_limits=not args.no_power_limits)
    rec = {**cal.to_dict(), "calibration_s": time.perf_counter() - t0}
    Path(args.calibration).write_text(json.dumps(rec, indent=1) + "\n")
    s = cal.spec
    print(f"calibrated {cal.device_kind} in {rec['calibration_s']:.0f} s: "
          f"{s.peak_flops / 1e12:.1f} Tflop/s main, {(s.peak_flops_f32 or 0) / 1e12:.1f} f32, "
          f"{s.memory_bandwidth / 1e9:.0f} GB/s, kernel {s.kernel_overhead_s * 1e6:.1f} us, "
          f"{s.idle_watts:.0f}-{s.max_watts:.0f} W", flush=True)
    for n in cal.notes:
        print("  note:", n, flush=True)


def model_worker(args: argparse.Namespace) -> None:
    """Plan, compile and run one model's points, batches ascending; one JSON line each."""
    import jax
    import jax.numpy as jnp

    import jaxwap
    from jaxwap.cost.mesh_prediction import with_compiled
    from jaxwap.decide.measure import measure_step
    from jaxwap.decide.verify import compile_candidate
    from jaxwap.decide.xla_figures import library_calls
    from jaxwap.hardware.calibration import Calibration
    from jaxwap.hardware.cluster import builtin_for_kind

    device = jax.devices()[0]
    cal = Calibration.from_dict(json.loads(Path(args.calibration).read_text())) \
        if args.calibration and Path(args.calibration).exists() else None
    builtin = jaxwap.Cluster(builtin_for_kind(device.device_kind, device.platform), 1)
    cluster = jaxwap.Cluster(cal.spec, 1) if cal is not None else builtin
    rows = Path(args.rows)
    from benchmarks.models import zoo

    def peak() -> float | None:
        stats = device.memory_stats() or {}
        return stats.get("peak_bytes_in_use")

    for batch in sorted(int(b) for b in args.batches.split(",")):
        for dt in args.dtypes.split(","):
            w = workload(args.worker, batch, dt, args.quick)
            t0 = time.perf_counter()
            planned, r, on_builtin = predict_point(w, cluster, builtin)
            plan_s = time.perf_counter() - t0
            peak_before = peak()
            figs, cs = compile_candidate(w.step, planned.layout, r, [device], cluster)
            fed = with_compiled(r.predicted, figs, cluster, w.batch_size, 1, 1, r.r)
            data = w.synthetic(0)
            state = [jax.device_put(x, s) for x, s in
                     zip(jax.tree_util.tree_leaves(data), cs.in_shardings, strict=True)]
            del data

            run = zoo.step_runner(cs, planned.layout, state)

            t0 = time.perf_counter()
            run()
            first_s = time.perf_counter() - t0
            run()
            times = []
            t_end = time.perf_counter() + args.window
            while len(times) < args.steps or time.perf_counter() < t_end:
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            step_s = statistics.median(times)
            steps = max(args.steps, int(args.window / step_s) + 1)
            # the same steps queued without a wait between them (a loop that reads no
            # metric each step): the host's dispatch then hides behind the device's work
            t0 = time.perf_counter()
            for _ in range(steps - 1):
                run(block=False)
            jax.block_until_ready(run())
            queued_s = (time.perf_counter() - t0) / steps
            m = measure_step(run, [device], steps, r.predicted.avg_power_w)
            peak_after = peak()
            if args.trace:   # the model's first point's kernels: where its time goes,
                # beside the program they ran (each kernel's HLO op and its shapes)
                stem = Path(args.rows).parent / f"trace_{args.worker}_{batch}"
                trace(run, stem.with_suffix(".xplane.pb"))
                stem.with_suffix(".hlo.txt").write_text(cs.compiled.as_text())
                args.trace = False
            p = r.predicted

            row = {"model": args.worker if not args.quick else f"{args.worker}-small",
                   "batch": w.batch_size, "dtype": jnp.dtype(dt).name,
                   "layout": sorted({s.name for s in r.strategies}),
                   "predicted_calibrated": figures(p), "predicted_builtin": figures(on_builtin),
                   "predicted_with_xla_figures_s": fed.step_time_s,
                   "compiled": {"memory_bytes": figs.memory_bytes, "flops": figs.flops,
                                "compile_s": cs.compile_time_s,
                                "library_calls": library_calls(cs.compiled.as_text())},
                   "measured": {"step_time_s": step_s, "steps_timed": len(times),
                                "queued_step_time_s": queued_s,
                                "spread": (max(times) - min(times)) / step_s,
                                "window_step_time_s": m.step_time_s,
                                "avg_power_w": m.energy_per_step_j / m.step_time_s,
                                "energy_per_sample_j": m.energy_per_step_j / w.batch_size,
                                "energy_source": m.energy_source, "window_steps": m.steps,
                                "peak_bytes_in_use": peak_after,
                                "peak_is_this_points": (peak_after is not None and (
                                    peak_before is None or peak_after > peak_before)),
                                "first_step_s": first_s, "note": m.note},
                   "plan_s": plan_s}
            with rows.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(line(row), flush=True)
            del state, cs, run


def trace(run: Any, dest: Path, steps: int = 3) -> None:
    """Save `steps` steps' profiler trace (XLA's per-kernel events) as one xplane file."""
    import glob
    import shutil
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                run()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if files:
            shutil.copy(files[0], dest)


# ---------------------------------------------------------------------------- report
def _pct(pred: float, meas: float) -> str:
    return f"{100 * (pred / meas - 1):+.0f}%"


def _both(pred: float, m: dict[str, Any]) -> str:
    """Error against the step waited for, and against the queued step where recorded."""
    q = m.get("queued_step_time_s")
    return _pct(pred, m["step_time_s"]) + (f" / {_pct(pred, q)} q" if q else "")


def line(r: dict[str, Any]) -> str:
    m, c, b = r["measured"], r["predicted_calibrated"], r["predicted_builtin"]
    peak = m["peak_bytes_in_use"]
    return (f"{r['model']:13s} {r['dtype']:8s} {r['batch']:4d}  "
            f"{m['step_time_s'] * 1e3:8.2f} ms (queued {m['queued_step_time_s'] * 1e3:.2f})  "
            f"cal {c['step_time_s'] * 1e3:8.2f} "
            f"({_pct(c['step_time_s'], m['step_time_s'])})  built-in "
            f"{b['step_time_s'] * 1e3:8.2f} ({_pct(b['step_time_s'], m['step_time_s'])})  "
            f"xla-fed {_pct(r['predicted_with_xla_figures_s'], m['step_time_s'])}  "
            f"{m['avg_power_w']:5.0f} W vs {c['avg_power_w']:5.0f} "
            f"({_pct(c['avg_power_w'], m['avg_power_w'])}) [{m['energy_source']}]  mem "
            f"{c['memory_bytes'] / 2**30:.2f} / {r['compiled']['memory_bytes'] / 2**30:.2f} / "
            + (f"{peak / 2**30:.2f}" if peak else "-") + " GiB")


def markdown(rec: dict[str, Any]) -> str:
    cal = rec.get("calibration") or {}
    spec = cal.get("spec", {})
    lines = [f"# One {rec['device']}: measured against predicted", "",
             f"Command: `{rec['command']}` on {rec['date_utc']}, jax {rec['jax']}. "
             "**Measured** on the device named; **predicted** by jaxwap's analytic model with "
             "the profile calibrated there and then (cal) and with the built-in profile of "
             "the device's kind (built-in); **compiled** is XLA's memory analysis of the "
             "program run. What runs is the planner's one-device candidate compiled as "
             "`auto_shard` compiles it. Power is NVML's energy over the window divided by "
             "its length, unless the source column says modeled. Queued: the same steps "
             "dispatched without waiting for each (the host's dispatch hidden behind the "
             "device's work); measured: each step waited for, as a loop that reads its loss "
             "every step runs.", ""]
    if rec.get("repredicted"):
        lines += [f"Predictions re-made on {rec['repredicted']['date_utc']} "
                  f"(`{rec['repredicted']['command']}`): "
                  f"{rec['repredicted']['note']}.", ""]
    if spec:
        lines += [f"Calibrated: {spec.get('peak_flops', 0) / 1e12:.1f} Tflop/s main matmul, "
                  f"{(spec.get('peak_flops_f32') or 0) / 1e12:.1f} Tflop/s f32, "
                  f"{spec.get('memory_bandwidth', 0) / 1e9:.0f} GB/s, kernel "
                  f"{spec.get('kernel_overhead_s', 0) * 1e6:.1f} us, "
                  f"{spec.get('idle_watts', 0):.0f} W idle, {spec.get('max_watts', 0):.0f} W "
                  "matmul-bound.", ""]
        lines += [f"- note: {n}" for n in cal.get("notes", [])] + [""]
    lines += ["| model | dtype | batch | measured ms | queued ms | cal ms | built-in ms | "
              "XLA-fed | measured W | cal W | built-in W | source | mem predicted / compiled / "
              "peak GiB |", "|" + "---|" * 13]
    for r in rec["rows"]:
        m, c, b = r["measured"], r["predicted_calibrated"], r["predicted_builtin"]
        peak = m["peak_bytes_in_use"]
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['batch']} | {m['step_time_s'] * 1e3:.2f} | "
            f"{m.get('queued_step_time_s', float('nan')) * 1e3:.2f} | "
            f"{c['step_time_s'] * 1e3:.2f} ({_both(c['step_time_s'], m)}) | "
            f"{b['step_time_s'] * 1e3:.2f} ({_both(b['step_time_s'], m)}) | "
            f"{_pct(r['predicted_with_xla_figures_s'], m['step_time_s'])} | "
            f"{m['avg_power_w']:.0f} | {c['avg_power_w']:.0f} "
            f"({_pct(c['avg_power_w'], m['avg_power_w'])}) | {b['avg_power_w']:.0f} "
            f"({_pct(b['avg_power_w'], m['avg_power_w'])}) | {m['energy_source']} | "
            f"{c['memory_bytes'] / 2**30:.2f} / {r['compiled']['memory_bytes'] / 2**30:.2f} / "
            + (f"{peak / 2**30:.2f}{'' if m['peak_is_this_points'] else ' (earlier)'}"
               if peak else "-") + " |")
    for f in rec.get("failures", []):
        lines.append(f"\nNot measured: {f}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['model']}\n{r['dtype'][:4]} b{r['batch']}" for r in rows]
    x = range(len(rows))
    for ax, key, unit in ((axes[0], "step_time_s", 1e3), (axes[1], "avg_power_w", 1)):
        ax.plot(x, [r["measured"][key] * unit for r in rows], "o", label="measured")
        ax.plot(x, [r["predicted_calibrated"][key] * unit for r in rows], "x",
                label="predicted (calibrated)")
        ax.plot(x, [r["predicted_builtin"][key] * unit for r in rows], "+",
                label="predicted (built-in)")
        ax.set_xticks(list(x), labels, fontsize=6)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("ms per step")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("W")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def recorded_spec(calibration: dict[str, Any]) -> tuple[Any, list[str]]:
    """A recorded calibration's profile as the model at this commit reads it, and the
    figures it left out: the backend's flags are the model's knowledge of the compiler,
    not measured, so the current built-in's (a record keeps those of its day); a figure
    the model no longer has is left out and named."""
    from jaxwap.hardware.calibration import Calibration
    from jaxwap.hardware.cluster import builtin_for_kind
    from jaxwap.hardware.device import BACKEND_FLAGS, DeviceSpec

    known = {f.name for f in dataclasses.fields(DeviceSpec)}
    spec = calibration["spec"]
    cal = Calibration.from_dict(dict(calibration, spec={k: v for k, v in spec.items()
                                                        if k in known}))
    base = builtin_for_kind(cal.device_kind, cal.platform)
    return (dataclasses.replace(cal.spec, **{f: getattr(base, f) for f in BACKEND_FLAGS}),
            sorted(set(spec) - known))


def repredict(args: argparse.Namespace) -> None:
    """A recorded run's rows predicted again by the model as it is now (no device needed:
    planning takes abstract shapes), with the profile calibrated in that run and the
    built-in one. The measured figures stay as recorded; the predictions made at the run
    are kept beside the new ones (`predicted_at_run`), and the XLA-fed column, which needs
    the device's compiled program, is the run's."""
    import jaxwap
    from jaxwap.hardware.cluster import builtin_for_kind

    src = Path(args.repredict)
    rec = json.loads(src.read_text())
    builtin = jaxwap.Cluster(builtin_for_kind(rec["device"], rec["platform"]), 1)
    cluster, dropped = builtin, []
    if rec.get("calibration"):
        spec, dropped = recorded_spec(rec["calibration"])
        if args.drop_call:    # what the host's call adds: the same profile without it
            spec = dataclasses.replace(spec, call_cost=(), python_call_s=0.0)
        cluster = jaxwap.Cluster(spec, 1)
    for row in rec["rows"]:
        name = row["model"].removesuffix("-small")
        w = workload(name, row["batch"], row["dtype"], row["model"].endswith("-small"))
        _, r, on_builtin = predict_point(w, cluster, builtin)
        row.setdefault("predicted_at_run", {"calibrated": row["predicted_calibrated"],
                                            "builtin": row["predicted_builtin"]})
        row["predicted_calibrated"], row["predicted_builtin"] = \
            figures(r.predicted), figures(on_builtin)
        print(line(row), flush=True)
    rec["repredicted"] = {
        "command": harness.command(MODULE), "date_utc": harness.date_utc(),
        "note": "predicted columns re-made by the model at this commit from the recorded "
                "calibration (backend flags the current built-in's"
                + (f"; left out, not in the model now: {', '.join(dropped)}" if dropped else "")
                + ("; the host's call left out (--drop-call)" if args.drop_call else "")
                + "); measured and compiled columns and the XLA-fed column are the run's"}
    stem = Path(args.out) / (src.stem + ("_nocall" if args.drop_call else ""))
    harness.write_record(stem, rec, markdown(rec))
    plot(rec["rows"], stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .md, .png")


# ---------------------------------------------------------------------------- orchestrator
def child(argv: list[str], timeout: float, log: Any) -> str | None:
    """Run this script as a child; None, or why it failed."""
    cmd = harness.worker(MODULE, *argv)
    try:
        p = subprocess.run(cmd, timeout=timeout, stdout=log, stderr=subprocess.STDOUT,
                           cwd=harness.ROOT)
    except subprocess.TimeoutExpired:
        return f"{' '.join(argv[:2])}: over its {timeout:.0f} s limit"
    return None if p.returncode == 0 else f"{' '.join(argv[:2])}: exit status {p.returncode}"


def main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "gpu_sweep_work"
    work.mkdir(exist_ok=True)
    cal_path, rows_path = work / "calibration.json", work / "rows.jsonl"
    rows_path.unlink(missing_ok=True)
    common = ["--dtypes", args.dtypes, "--steps", str(args.steps), "--window",
              str(args.window), "--calibration", str(cal_path), "--rows", str(rows_path)]
    common += ["--quick"] if args.quick else []
    failures = []
    if not args.skip_calibration:
        why = child(["--calibrate-only", *common]
                    + (["--no-power-limits"] if args.no_power_limits else []),
                    args.calibration_timeout, sys.stdout)
        if why:
            failures.append(f"calibration ({why}): predicted with the built-in profile only")
            cal_path.unlink(missing_ok=True)
    t_start = time.perf_counter()
    for name in args.models.split(","):
        batches = args.batches or ",".join(str(b) for b in POINTS[name])
        left = args.total_timeout - (time.perf_counter() - t_start)
        if left < 20:
            failures.append(f"{name}: not started, the run's {args.total_timeout:.0f} s spent")
            continue
        why = child(["--worker", name, "--batches", batches, *common]
                    + (["--trace", name] if name in (args.trace or "").split(",") else []),
                    min(args.model_timeout, left), sys.stdout)
        if why:
            failures.append(why)
    rows = [json.loads(x) for x in rows_path.read_text().splitlines()] \
        if rows_path.exists() else []
    cal = json.loads(cal_path.read_text()) if cal_path.exists() else None
    import jax  # only now: the children had the device to themselves

    device = jax.devices()[0]
    kind = "".join(c if c.isalnum() else "-" for c in device.device_kind.lower())
    stem = out / f"{kind}{'_quick' if args.quick else ''}"
    rec = {"command": harness.command(MODULE), "date_utc": harness.date_utc(),
           "device": device.device_kind, "platform": device.platform,
           "host": platform.node(), "jax": jax.__version__, "calibration": cal,
           "basis": "measured = run on the device named (energy from NVML unless "
                    "energy_source says modeled); predicted_calibrated / predicted_builtin "
                    "= jaxwap's analytic model with the calibrated / built-in profile; "
                    "compiled = XLA's memory analysis of the program run",
           "rows": rows, "failures": failures}
    harness.write_record(stem, rec, markdown(rec))
    if rows:
        plot(rows, stem.with_suffix(".png"))
    print(markdown(rec))
    print(f"wrote {stem}.json, .md" + (", .png" if rows else ""))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--models", default=None,
                   help="comma-separated (default: alexnet,gpt2,vgg16,resnet50; with "
                        "--quick alexnet,gpt2)")
    p.add_argument("--batches", default=None,
                   help="comma-separated batch sizes (default: each model's POINTS)")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--steps", type=int, default=20, help="timed steps, at least")
    p.add_argument("--window", type=float, default=2.0,
                   help="seconds of steps timed, and of NVML's energy window, at least")
    p.add_argument("--no-power-limits", action="store_true",
                   help="calibrate without setting the GPU's power limit")
    p.add_argument("--skip-calibration", action="store_true",
                   help="predict with the built-in profile only")
    p.add_argument("--calibration-timeout", type=float, default=240)
    p.add_argument("--model-timeout", type=float, default=180)
    p.add_argument("--total-timeout", type=float, default=420,
                   help="seconds for all the models together")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--trace", metavar="MODELS",
                   help="comma-separated models whose first point's profiler trace is saved")
    p.add_argument("--quick", action="store_true",
                   help="CPU check: the CI-sized models, batches 8 and 16, float32")
    p.add_argument("--repredict", metavar="JSON",
                   help="predict a recorded run's rows again with the model as it is now "
                        "(no device needed); writes under --out")
    # internal: one child's job
    p.add_argument("--drop-call", action="store_true",
                   help="with --repredict: the calibrated profile without the host's call "
                        "(call_cost, python_call_s), written as <stem>_nocall.*")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--calibrate-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--calibration", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick and not (args.worker or args.calibrate_only):
        args.models = args.models or "alexnet,gpt2"
        args.batches, args.dtypes = args.batches or "8,16", "float32"
        args.steps, args.window = 2, 0.3
    args.models = args.models or "alexnet,gpt2,vgg16,resnet50"
    return args


if __name__ == "__main__":
    a = parse()
    if a.repredict:
        repredict(a)
    elif a.calibrate_only:
        calibrate_worker(a)
    elif a.worker:
        model_worker(a)
    else:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        main(a)
