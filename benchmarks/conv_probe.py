"""Convolutions by shape against the calibrated matmul rate: which share of it each runs at.

    python benchmarks/conv_probe.py --calibration CAL.json --out DIR   # on a GPU
    .venv/bin/python benchmarks/conv_probe.py --quick --out /tmp/c     # CPU check of the path

The cost model prices every convolution of an accelerator at one share of the matmul rate
(`DeviceSpec.conv_efficiency`, from `probes.ACCEL_CONV_SHAPES`: VGG's 3x3 layers at batch
64) and a network's first layer at another (`narrow_conv_efficiency`, from
`accel_probes.NARROW_CONVS` at batch 64). On an H200, VGG-16's convolutions ran at about
0.85 of the matmul rate in a profiler trace and ResNet-50's (1x1 layers, small maps) at
0.46, and the first layers at 0.05 where the probe gave 0.029. This times each family
alone, at two batches, so the question "does a 1x1 or a small map run slower, and does the
first layer's share depend on the batch" is answered by measurement, not by the model.

Each convolution runs as a training step runs it: forward and both gradients (the first
layer: forward and the kernel's gradient, its input needs none), jitted, its output summed,
operands random (`probes.operand`), the median of 5 runs after a warm-up. Work is counted
as the cost model counts it (`probes._conv_flops`), and the same work is priced as
matmuls on the calibrated curve (the profile's own `matmul_eff`, launch included): the
share is that price over the measured time. Writes `conv_probe_<device>.json` and `.md`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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


def _matmul_s(spec: Any, peak: float, overhead: float) -> Any:
    def f(w: float) -> float:
        return w / (peak * float(spec.matmul_eff(w, peak))) + overhead
    return f


def probe(batches: list[int], dtype_name: str, cal_path: str | None, quick: bool
          ) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from jaxwap.calibrate import Calibration
    from jaxwap.hardware import builtin_for_kind
    from jaxwap.probes import _conv_flops, operand, time_it

    dev = jax.devices()[0]
    dtype = jnp.dtype(dtype_name)
    if cal_path and Path(cal_path).exists():
        spec = Calibration.from_dict(json.loads(Path(cal_path).read_text())).spec
        source = f"calibrated ({cal_path})"
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

            def loss(x: Any, w: Any, s: int = s) -> Any:
                y = jax.lax.conv_general_dilated(x, w, (s, s), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
                return jnp.sum(y.astype(jnp.float32) ** 2)

            first = fam == "first layer"
            argnums = (1,) if first else (0, 1)
            f = jax.jit(jax.value_and_grad(loss, argnums=argnums))
            seconds = time_it(lambda f=f, x=x, w=w: jax.block_until_ready(f(x, w)))
            flops = _conv_flops(f, x, w)
            parts = 1 + len(argnums)       # forward and each gradient: one kernel each
            as_matmul = parts * matmul_s(flops / parts)
            rows.append({"family": fam, "batch": b, "spatial": h, "in": c, "out": k,
                         "window": win, "stride": s, "flops": flops, "seconds": seconds,
                         "as_matmul_s": as_matmul, "share": as_matmul / seconds,
                         "tflops": flops / seconds / 1e12})
            print(f"{fam:14s} b={b:3d} {h:3d}x{h:<3d} {c:4d}->{k:<4d} {win}x{win}/{s}: "
                  f"{seconds * 1e3:8.3f} ms, {flops / seconds / 1e12:7.1f} Tflop/s, "
                  f"{as_matmul / seconds:.3f} of the matmul rate", flush=True)
    return {"command": "python benchmarks/conv_probe.py " + " ".join(sys.argv[1:]),
            "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": dev.device_kind, "jax": jax.__version__, "dtype": dtype.name,
            "matmul_curve": source, "peak_flops": peak,
            "conv_efficiency_in_profile": spec.conv_efficiency,
            "narrow_conv_efficiency_in_profile": spec.narrow_conv_efficiency,
            "basis": "measured: seconds (median of 5, one warm-up) on the device named; "
                     "as_matmul_s: the same flops priced on the matmul curve named",
            "rows": rows}


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
             f"{rec['narrow_conv_efficiency_in_profile']} for first layers.", "",
             "| family | batch | work-weighted share of the matmul rate |", "|---|---|---|"]
    for (fam, b), share in summary(rec).items():
        lines.append(f"| {fam} | {b} | {share:.3f} |")
    lines += ["", "| family | batch | map | in -> out | window/stride | ms | Tflop/s | share |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        lines.append(f"| {r['family']} | {r['batch']} | {r['spatial']} | {r['in']} -> "
                     f"{r['out']} | {r['window']}x{r['window']}/{r['stride']} | "
                     f"{r['seconds'] * 1e3:.3f} | {r['tflops']:.1f} | {r['share']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="64,128")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--calibration", help="a calibration's JSON (gpu_sweep's); else built-in")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--quick", action="store_true", help="toy sizes: the code path on a CPU")
    args = p.parse_args()
    rec = probe([int(b) for b in args.batches.split(",")], args.dtype, args.calibration,
                args.quick)
    kind = "".join(ch if ch.isalnum() else "-" for ch in rec["device"].lower())
    stem = Path(args.out) / f"conv_probe_{kind}{'_quick' if args.quick else ''}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(rec, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(rec))
    print(markdown(rec))


if __name__ == "__main__":
    main()
