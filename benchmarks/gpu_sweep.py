"""One device, many batch sizes: measured step time, throughput, power and energy per
image next to jaxwap's prediction. This curve decides how many GPUs a job should use.

    .venv/bin/python benchmarks/gpu_sweep.py                 # on a GPU: AlexNet, VGG-16
    .venv/bin/python benchmarks/gpu_sweep.py --quick         # CPU check of the code path

For AlexNet and VGG-16 (224 px on a GPU), per-device batch 16, 32, 64, 128, 256, 512, in
bf16 and fp32: calibrates the device first (`jaxwap.calibrate`, cached), predicts the
one-device step with the calibrated profile, then runs it (warm-up, then at least 10 steps
and a window long enough for NVML's energy counter) and reads NVML energy. Without NVML
(CPU) the energy column is modeled and labelled so. Writes
`benchmarks/results/gpu_<device>.json` and `gpu_<device>.png`; prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import zoo  # noqa: E402

import jaxwap  # noqa: E402
from jaxwap.measure import measure_step  # noqa: E402


def one_device_plan(w: zoo.Workload, cluster: jaxwap.Cluster) -> jaxwap.Plan:
    return jaxwap.plan(w.step, *w.args, params=w.params, hardware=cluster, num_devices=1,
                       verify=0, cache=False)


def run_point(name: str, batch: int, image: int, dtype: Any, cluster: jaxwap.Cluster,
              steps: int) -> dict[str, Any]:
    w = zoo.WORKLOADS[name](batch_size=batch, image_size=image, dtype=dtype)
    plan = one_device_plan(w, cluster)
    pred = plan.predicted
    device = jax.devices()[0]
    args = jax.device_put(w.synthetic(0), device)
    step = jax.jit(w.step)
    state = list(args)
    n_state = len(args) - 1  # everything but the batch is carried

    def run() -> None:
        out = step(*state)
        jax.block_until_ready(out)
        state[:n_state] = list(out[:n_state])

    t0 = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t0
    m = measure_step(run, [device], steps, pred.avg_power_w)
    return {
        "model": name, "batch": batch, "image": image, "dtype": jnp.dtype(dtype).name,
        "measured": {"step_time_s": m.step_time_s, "images_per_s": batch / m.step_time_s,
                     "avg_power_w": m.energy_per_step_j / m.step_time_s,
                     "energy_per_image_j": m.energy_per_step_j / batch,
                     "energy_source": m.energy_source, "steps": m.steps, "note": m.note},
        "predicted": {"step_time_s": pred.step_time_s, "images_per_s": pred.samples_per_s,
                      "avg_power_w": pred.avg_power_w,
                      "energy_per_image_j": pred.energy_per_sample_j},
        "first_step_s": compile_s,
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (model, dtype) in sorted({(r["model"], r["dtype"]) for r in rows}):
        rs = [r for r in rows if r["model"] == model and r["dtype"] == dtype]
        b = [r["batch"] for r in rs]
        for ax, key, scale in ((axes[0], "images_per_s", 1), (axes[1], "energy_per_image_j", 1e3)):
            line, = ax.plot(b, [r["measured"][key] * scale for r in rs], "o-",
                            label=f"{model} {dtype} measured")
            ax.plot(b, [r["predicted"][key] * scale for r in rs], "x--",
                    color=line.get_color(), label=f"{model} {dtype} predicted")
    axes[0].set_ylabel("images/s")
    axes[1].set_ylabel("mJ per image")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch per device")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="alexnet,vgg16")
    p.add_argument("--batches", default="16,32,64,128,256,512")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--quick", action="store_true",
                   help="CPU check: AlexNet, 32 px, batches 8 and 16, fp32, 2 steps")
    args = p.parse_args()
    if args.quick:
        args.models, args.batches, args.dtypes = "alexnet", "8,16", "float32"
        args.image_size, args.steps = 32, 2
    cal = jaxwap.calibrate(progress=True, quick=args.quick)
    cluster = jaxwap.Cluster(cal, 1)
    device = jax.devices()[0]
    rows = []
    print(f"{'model':8s} {'dtype':9s} {'batch':>5s} {'ms meas':>8s} {'ms pred':>8s} "
          f"{'img/s meas':>10s} {'W meas':>7s} {'mJ/img meas':>11s} {'mJ/img pred':>11s} energy")
    for name in args.models.split(","):
        for dt in args.dtypes.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                try:
                    r = run_point(name, b, args.image_size, jnp.dtype(dt), cluster, args.steps)
                except Exception as e:  # noqa: BLE001 - out of memory at big batches: recorded
                    print(f"{name:8s} {dt:9s} {b:5d} failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:80]}")
                    continue
                rows.append(r)
                m, pr = r["measured"], r["predicted"]
                print(f"{name:8s} {dt:9s} {b:5d} {m['step_time_s'] * 1e3:8.2f} "
                      f"{pr['step_time_s'] * 1e3:8.2f} {m['images_per_s']:10.0f} "
                      f"{m['avg_power_w']:7.0f} {m['energy_per_image_j'] * 1e3:11.3f} "
                      f"{pr['energy_per_image_j'] * 1e3:11.3f} {m['energy_source']}", flush=True)
    kind = "".join(c if c.isalnum() else "-" for c in device.device_kind.lower())
    out = ROOT / "benchmarks" / "results" / f"gpu_{kind}{'_quick' if args.quick else ''}"
    record = {"command": "python benchmarks/gpu_sweep.py " + " ".join(sys.argv[1:]),
              "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "device": device.device_kind, "platform": device.platform,
              "jax": jax.__version__, "calibrated_profile": cal.to_dict(),
              "basis": "measured = run on the device named (energy from NVML unless "
                       "energy_source says modeled); predicted = jaxwap's model with the "
                       "calibrated profile",
              "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    if rows:
        plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json').relative_to(ROOT)}")


if __name__ == "__main__":
    main()
