"""Convolutions by shape against the calibrated matmul rate: which share of it each runs at.

    python -m benchmarks.gpu.conv_probe --calibration CAL.json --out DIR  # on a GPU
    .venv/bin/python -m benchmarks.gpu.conv_probe --quick --out /tmp/c    # CPU check, the path

The cost model prices an accelerator's convolutions at a share of the matmul rate by
their work (`DeviceSpec.conv_efficiency_curve`, from `conv_probes.ACCEL_CONV_SHAPES`; before
it one share for all) and a network's first layer at another (`narrow_conv_efficiency`,
from `conv_probes.NARROW_CONVS` at batch 64). On an H200, VGG-16's convolutions ran at
about 0.85 of the matmul rate in a profiler trace and ResNet-50's (1x1 layers, small maps)
at 0.46, and the first layers at 0.05 where the probe gave 0.029. This times each family
alone, at two batches, so the question "does a 1x1 or a small map run slower, and does the
first layer's share depend on the batch" is answered by measurement, not by the model;
`--predict` sets jaxwap's prediction of each row's program beside it.

Each convolution runs as a training step runs it: forward and both gradients (the first
layer: forward and the kernel's gradient, its input needs none), jitted, its output summed,
operands random (`timing.operand`), the median of 5 timings after a warm-up, each of
`conv_probes.QUEUED` calls queued and the last waited for (one call per timing on a CPU;
the record's `queued` says which). Work is counted
as the cost model counts it (`conv_probes.conv_flops`), and the same work is priced as
matmuls on the calibrated curve (the profile's own `matmul_eff`, launch included): the
share is that price over the measured time. Writes `results/conv_probe/<device>.json` and
`.md` (or under `--out`).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks import harness

MODULE = "benchmarks.gpu.conv_probe"   # this script, as `python -m` runs it

#: (family, batch, spatial, in channels, out channels, window, stride)
FAMILIES = {
    # VGG-16's 3x3 layers (the calibration's ACCEL_CONV_SHAPES)
    "3x3 wide": [(56, 128, 128), (56, 256, 256), (28, 512, 512), (14, 512, 512)],
    # ResNet-50's bottleneck 3x3 layers: narrower, down to a 7x7 map
    "3x3 bottleneck": [(56, 64, 64), (28, 128, 128), (14, 256, 256), (7, 512, 512)],
    # ResNet-50's 1x1 layers, expanding and reducing
    "1x1": [(56, 64, 256), (56, 256, 64), (28, 512, 128), (28, 128, 512), (14, 1024, 256),
            (14, 256, 1024), (7, 2048, 512), (7, 512, 2048)],
}
#: first layers (3 input channels): (spatial, window, stride), AlexNet's 11x11/4, ResNet's
#: 7x7/2, VGG's 3x3/1
NARROW = [(224, 11, 4), (224, 7, 2), (224, 3, 1)]


def _loss(x: Any, w: Any, stride: int) -> Any:
    """The probe's convolution and a loss of its output (summed squares in f32)."""
    import jax
    import jax.numpy as jnp

    y = jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(y.astype(jnp.float32) ** 2)


def _argnums(family: str) -> tuple[int, ...]:
    """What a training step differentiates: a first layer's kernel only (its input is the
    data), any other layer's input and kernel."""
    return (1,) if family == "first layer" else (0, 1)


def predicted_s(row: dict[str, Any], dtype_name: str, spec: Any) -> float:
    """jaxwap's prediction for the row's program, as the planner makes it (abstract shapes,
    one device of `spec`): a step that runs the probe's forward and gradients and applies
    the kernel's (SGD, so the update is the kernel's size and little else); an input
    gradient is returned so it is part of the program, as in the timed one."""
    import jax
    import jax.numpy as jnp

    import jaxwap
    from jaxwap.planner import make_plan

    dt = jnp.dtype(dtype_name)
    b, h, c, k = row["batch"], row["spatial"], row["in"], row["out"]
    win, stride, argnums = row["window"], row["stride"], _argnums(row["family"])
    params = {"w": jax.ShapeDtypeStruct((win, win, c, k), dt)}
    x = jax.ShapeDtypeStruct((b, h, h, c), dt)

    def step(params: Any, x: Any) -> Any:
        _, grads = jax.value_and_grad(partial(_loss, stride=stride), argnums=argnums)(
            x, params["w"])
        new = {"w": params["w"] - 1e-3 * grads[-1]}
        return (new, grads[0]) if len(grads) == 2 else new

    planned = make_plan(step, (params, x), {}, params=params, options=jaxwap.PlanOptions(
        hardware=jaxwap.Cluster(spec, 1), num_devices=1, verify=0, cache=False))
    one = next(r for r in planned.search.results if r.d * r.m == 1 and r.variant == "planner")
    return float(one.predicted.step_time_s)


def _matmul_s(spec: Any, peak: float, overhead: float) -> Any:
    def f(w: float) -> float:
        return w / (peak * float(spec.matmul_eff(w, peak))) + overhead
    return f


def probe(batches: list[int], dtype_name: str, cal_path: str | None, quick: bool
          ) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from jaxwap.calibration.conv_probes import QUEUED, conv_flops
    from jaxwap.calibration.timing import operand, time_it
    from jaxwap.hardware.cluster import builtin_for_kind

    dev = jax.devices()[0]
    queued = 1 if dev.platform == "cpu" else QUEUED   # as the calibration times them
    dtype = jnp.dtype(dtype_name)
    if cal_path and Path(cal_path).exists():
        spec, source = load_spec(cal_path), f"calibrated ({cal_path})"
    else:
        spec, source = builtin_for_kind(dev.device_kind, dev.platform), "built-in"
    peak = spec.peak_flops if dtype == jnp.bfloat16 else spec.peak_flops_f32
    matmul_s = _matmul_s(spec, peak, spec.kernel_overhead_s)
    rows = []
    shapes = [(fam, h, c, k, 3 if fam.startswith("3x3") else 1, 1)
              for fam, ss in FAMILIES.items() for h, c, k in ss]
    shapes += [("first layer", h, 3, 64, win, s) for h, win, s in NARROW]
    for b in batches:
        for fam, h, c, k, win, s in shapes:
            if quick:   # the CPU check: the code path at toy sizes
                b, h = 2, max(h // 16, 4)
                c, k = min(c, 16), min(k, 16)
            x = operand(dev, (b, h, h, c), dtype)
            w = operand(dev, (win, win, c, k), dtype, win * win * c)
            argnums = _argnums(fam)
            f = jax.jit(jax.value_and_grad(partial(_loss, stride=s), argnums=argnums))
            seconds = time_it(lambda f=f, x=x, w=w: jax.block_until_ready(
                [f(x, w) for _ in range(queued)])) / queued
            flops = conv_flops(f, x, w)
            parts = 1 + len(argnums)       # forward and each gradient: one kernel each
            as_matmul = parts * matmul_s(flops / parts)
            rows.append({"family": fam, "batch": b, "spatial": h, "in": c, "out": k,
                         "window": win, "stride": s, "flops": flops, "seconds": seconds,
                         "as_matmul_s": as_matmul, "share": as_matmul / seconds,
                         "tflops": flops / seconds / 1e12})
            print(f"{fam:14s} b={b:3d} {h:3d}x{h:<3d} {c:4d}->{k:<4d} {win}x{win}/{s}: "
                  f"{seconds * 1e3:8.3f} ms, {flops / seconds / 1e12:7.1f} Tflop/s, "
                  f"{as_matmul / seconds:.3f} of the matmul rate", flush=True)
    return {"command": harness.command(MODULE), "date_utc": harness.date_utc(),
            "device": dev.device_kind, "jax": jax.__version__, "dtype": dtype.name,
            "matmul_curve": source, "peak_flops": peak, "queued": queued,
            "conv_efficiency_in_profile": spec.conv_efficiency,
            "narrow_conv_efficiency_in_profile": spec.narrow_conv_efficiency,
            "basis": "measured: seconds (median of 5, one warm-up) on the device named; "
                     "as_matmul_s: the same flops priced on the matmul curve named",
            "rows": rows}


def load_spec(path: str) -> Any:
    """The calibrated profile in `path`: a calibration's JSON, or a `gpu_sweep.py` record
    that holds one, as the model at this commit reads it (`gpu_sweep.recorded_spec`)."""
    from benchmarks.gpu.gpu_sweep import recorded_spec

    d = json.loads(Path(path).read_text())
    return recorded_spec(d if "spec" in d else d["calibration"])[0]


def add_predictions(rec: dict[str, Any], cal_path: str, command: str) -> None:
    """Each row's program as jaxwap predicts it (`predicted_s`) with the calibrated profile
    in `cal_path`: planning needs no device, so a run recorded on a lent GPU is predicted
    here, by the model at this commit."""
    spec = load_spec(cal_path)
    for row in rec["rows"]:
        row["predicted_s"] = predicted_s(row, rec["dtype"], spec)
    rec["predicted"] = {"command": command, "calibration": cal_path,
                        "date_utc": harness.date_utc(),
                        "basis": "predicted_s: jaxwap's analytic model, one device of the "
                                 "calibrated profile, the row's program as a training step"}


def summary(rec: dict[str, Any]) -> dict[tuple[str, int], float]:
    """Each (family, batch)'s work-weighted share: its matmul-priced seconds over its
    measured seconds, as the calibration weighs its own probe."""
    out: dict[tuple[str, int], list[float]] = {}
    for r in rec["rows"]:
        acc = out.setdefault((r["family"], r["batch"]), [0.0, 0.0])
        acc[0] += r["as_matmul_s"]
        acc[1] += r["seconds"]
    return {key: a / m for key, (a, m) in out.items()}


def markdown(rec: dict[str, Any]) -> str:
    lines = [f"# Convolutions against the matmul rate: {rec['device']}", "",
             f"Command: `{rec['command']}` on {rec['date_utc']}, jax {rec['jax']}, "
             f"{rec['dtype']}. **Measured** on the device named (forward and both "
             "gradients; a first layer forward and its kernel's gradient), against the "
             f"same flops priced on the {rec['matmul_curve']} matmul curve (peak "
             f"{rec['peak_flops'] / 1e12:.0f} Tflop/s). The profile's shares: "
             f"{rec['conv_efficiency_in_profile']} for convolutions, "
             f"{rec['narrow_conv_efficiency_in_profile']} for first layers. Each timing: "
             f"{rec.get('queued', 1)} call(s) queued, the last waited for.", "",
             "| family | batch | work-weighted share of the matmul rate |", "|---|---|---|"]
    for (fam, b), share in summary(rec).items():
        lines.append(f"| {fam} | {b} | {share:.3f} |")
    pred = "predicted" in rec
    if pred:
        p = rec["predicted"]
        lines += ["", f"Predicted: `{p['command']}` on {p['date_utc']}: jaxwap's analytic "
                  "model of each row's program (forward, gradients and the kernel's update, "
                  "one device of the calibrated profile), against the measured time."]
    lines += ["", "| family | batch | map | in -> out | window/stride | ms | Tflop/s | share |"
              + (" predicted ms |" if pred else ""),
              "|---|---|---|---|---|---|---|---|" + ("---|" if pred else "")]
    for r in rec["rows"]:
        lines.append(f"| {r['family']} | {r['batch']} | {r['spatial']} | {r['in']} -> "
                     f"{r['out']} | {r['window']}x{r['window']}/{r['stride']} | "
                     f"{r['seconds'] * 1e3:.3f} | {r['tflops']:.1f} | {r['share']:.3f} |"
                     + (f" {r['predicted_s'] * 1e3:.3f} "
                        f"({100 * (r['predicted_s'] / r['seconds'] - 1):+.0f}%) |"
                        if pred else ""))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--batches", default="64,128")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--calibration", help="a calibration's JSON (gpu_sweep's); else built-in")
    p.add_argument("--out", default=str(harness.results_dir("conv_probe")))
    p.add_argument("--quick", action="store_true", help="toy sizes: the code path on a CPU")
    p.add_argument("--predict", metavar="JSON",
                   help="a recorded probe: add jaxwap's predictions (needs --calibration), "
                        "no device run")
    args = p.parse_args()
    command = harness.command(MODULE)
    if args.predict:
        if not args.calibration:
            p.error("--predict needs --calibration (a calibration or gpu_sweep record)")
        rec = json.loads(Path(args.predict).read_text())
        add_predictions(rec, args.calibration, command)
    else:
        rec = probe([int(b) for b in args.batches.split(",")], args.dtype, args.calibration,
                    args.quick)
    kind = "".join(ch if ch.isalnum() else "-" for ch in rec["device"].lower())
    stem = Path(args.out) / (Path(args.predict).stem if args.predict
                             else f"{kind}{'_quick' if args.quick else ''}")
    harness.write_record(stem, rec, markdown(rec))
    print(markdown(rec))


if __name__ == "__main__":
    main()
