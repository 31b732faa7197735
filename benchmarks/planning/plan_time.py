"""How long jaxwap takes to plan (trace + analysis + search, no compile), and to read a
plan back from the plan cache.

    .venv/bin/python -m benchmarks.planning.plan_time                  # 224 px, batch 128
    .venv/bin/python -m benchmarks.planning.plan_time --image-size 64  # quicker

Plans the examples' own training step for AlexNet and VGG-16 (the same model, Adam and
loss as `examples/common.py`) and two transformers of `benchmarks/models/zoo.py` (GPT-2 small,
batch 8 x 1024 tokens, and a 4-layer d=256 decoder, batch 8 x 128) for 8 devices under
two hardware profiles: an HGX H100 box
(`Cluster("h100-sxm", 8)`, NVLink defaults) and the same GPUs on PCIe (25 GB/s, 10 us
links). Everything is abstract (`jax.eval_shape` / `jax.ShapeDtypeStruct`): no parameter
is allocated and nothing is compiled, so this runs anywhere, on 8 simulated CPU devices,
and measures the planner alone, i.e. the overhead auto_shard adds before the first compile.

Each plan is made `--repeats + 1` times: the first time includes one-off costs (tracing
caches, imports inside jax); the repeats show the steady cost of planning a new step.
The analyses `jaxwap.plan` keeps in memory are forgotten before each
(`jaxwap.clear_caches()`), so a repeat really plans again. The cached time
is set beside one trace of the step (`jax.make_jaxpr`, jax's trace cache warm): a plan
read back from the cache costs that trace (the step must be traced to key it) plus the
key and the read, and the goal is at most one trace + 20 ms.

Prints each plan's `explain()` and a summary table, and writes
`benchmarks/results/plan_time/cpu.json`.
"""

from __future__ import annotations

import os

# 8 simulated CPU devices, set before jax is imported: the plans are for hardware that need
# not be present, and the planner only needs the device count to match.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxwap  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.models import zoo  # noqa: E402

# the examples' own modules (examples/common.py, examples/models.py), as the zoo loads them
common = zoo.load_example("common")
VGG16, AlexNet = zoo.load_example("models").VGG16, zoo.load_example("models").AlexNet

NUM_DEVICES = 8
MODELS = {"AlexNet": AlexNet, "VGG-16": VGG16}
TRANSFORMERS = {
    "GPT-2 small": lambda: zoo.gpt2(),
    "4-layer transformer": lambda: zoo.gpt2(layers=4, d_model=256, heads=4, seq_len=128,
                                            vocab=1024, batch_size=8),
}


def clusters() -> dict[str, jaxwap.Cluster]:
    """The two 8-GPU systems compared: same GPUs, links 18x apart in bandwidth."""
    return {
        "h100-sxm x8 NVLink": jaxwap.Cluster("h100-sxm", num_devices=NUM_DEVICES),
        "h100-sxm x8 PCIe": jaxwap.Cluster("h100-sxm", num_devices=NUM_DEVICES,
                                           link_bandwidth=25e9, link_latency=10e-6),
    }


def abstract_inputs(model_cls: type, args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(train_step, params, opt_state, batch) with every array a jax.ShapeDtypeStruct."""
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    model = model_cls(num_classes=args.num_classes, dtype=dtype)
    tx = common.make_optimizer(args.lr)
    image = jax.ShapeDtypeStruct((args.batch_size, args.image_size, args.image_size, 3),
                                 jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), image)
    opt_state = jax.eval_shape(tx.init, params)
    batch = {"image": image, "label": jax.ShapeDtypeStruct((args.batch_size,), jnp.int32)}
    return common.make_train_step(model, tx), params, opt_state, batch


def time_plan(train_step: Any, params: Any, opt_state: Any, batch: Any,
              cluster: jaxwap.Cluster, repeats: int) -> tuple[jaxwap.Plan, float, list[float]]:
    """Plan repeats + 1 times, analytic only (verify=0: no XLA compile), without the plan
    cache or the analyses kept in memory, so every repeat really plans; return the last
    plan, the first time and the repeat times."""
    times = []
    plan = None
    for _ in range(repeats + 1):
        jaxwap.clear_caches()
        t0 = time.perf_counter()
        plan = jaxwap.plan(train_step, params, opt_state, batch, hardware=cluster,
                           objective="balanced", verify=0, cache=False)
        times.append(time.perf_counter() - t0)
    assert plan is not None
    return plan, times[0], times[1:]


def time_cached_plan(train_step: Any, params: Any, opt_state: Any, batch: Any,
                     cluster: jaxwap.Cluster, repeats: int = 5) -> tuple[float, float]:
    """(median seconds of a planning answered by the plan cache, median seconds of one
    trace of the step). The cached planning traces the step again (jax's trace cache makes
    that cheap), keys it and reads the plan back; nothing is searched."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        store = jaxwap.PlanCache(d)
        kw = dict(hardware=cluster, objective="balanced", verify=0, cache=store)
        jaxwap.plan(train_step, params, opt_state, batch, **kw)
        cached, traced = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jaxwap.plan(train_step, params, opt_state, batch, **kw)
            cached.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            jax.make_jaxpr(train_step)(params, opt_state, batch)
            traced.append(time.perf_counter() - t0)
        return statistics.median(cached), statistics.median(traced)


def workloads(args: argparse.Namespace) -> dict[str, tuple[Any, Any, Any, Any]]:
    """(train_step, params, opt_state, batch), all abstract, per model name."""
    out = {name: abstract_inputs(cls, args) for name, cls in MODELS.items()}
    for name, build in TRANSFORMERS.items():
        w = build()
        out[name] = (w.step, *w.args)
    return out


def main() -> None:
    p = harness.parser(__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="compute dtype, as the examples use on GPU")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-5, help="irrelevant to the plan; kept "
                   "equal to the examples' default so the step is theirs exactly")
    p.add_argument("--repeats", type=int, default=2, help="timed plans after the first")
    p.add_argument("--out", type=Path, default=harness.results_dir("plan_time") / "cpu.json")
    p.add_argument("--quiet", action="store_true", help="skip the explain() tables")
    args = p.parse_args()

    print(f"jax {jax.__version__}, jaxwap {jaxwap.__version__}, {len(jax.devices())} x "
          f"{jax.devices()[0].device_kind}; batch {args.batch_size}, {args.image_size}px, "
          f"{args.dtype}")
    rows = []
    for model_name, (train_step, params, opt_state, batch) in workloads(args).items():
        n_params = sum(x.size for x in jax.tree.leaves(params))
        for cluster_name, cluster in clusters().items():
            plan, first, repeats = time_plan(train_step, params, opt_state, batch, cluster,
                                             args.repeats)
            cached, traced = time_cached_plan(train_step, params, opt_state, batch, cluster)
            pred = plan.predicted
            row = {
                "model": model_name,
                "params_m": round(n_params / 1e6, 3),
                "hardware": cluster_name,
                "link_bandwidth": cluster.link_bandwidth,
                "link_latency": cluster.link_latency,
                "first_plan_s": first,
                "repeat_plan_s": repeats,
                "repeat_plan_median_s": statistics.median(repeats) if repeats else None,
                "cached_plan_s": cached,
                "one_trace_s": traced,
                "cached_minus_trace_s": cached - traced,
                "planner_phases_s": dict(plan.planning_time_s),
                "mesh_shape": dict(plan.mesh_shape),
                "num_devices": plan.num_devices,
                "predicted": {
                    "step_time_s": pred.step_time_s,
                    "samples_per_s": pred.samples_per_s,
                    "energy_per_sample_j": pred.energy_per_sample_j,
                    "avg_power_w": pred.avg_power_w,
                },
            }
            rows.append(row)
            if not args.quiet:
                print(f"\n=== {model_name} on {cluster_name} ===")
                print(plan.explain())

    print(f"\n{'model':20s} {'hardware':20s} {'first s':>8s} {'repeat s':>9s} "
          f"{'cached s':>9s} {'trace s':>8s}  {'mesh':16s} {'step ms':>8s} {'samples/s':>10s} "
          f"{'J/sample':>9s}")
    for r in rows:
        mesh = " x ".join(f"{k}={v}" for k, v in r["mesh_shape"].items())
        pr = r["predicted"]
        rep = r["repeat_plan_median_s"]
        print(f"{r['model']:20s} {r['hardware']:20s} {r['first_plan_s']:8.3f} "
              f"{rep if rep is not None else float('nan'):9.3f} {r['cached_plan_s']:9.3f} "
              f"{r['one_trace_s']:8.3f}  "
              f"{mesh:16s} "
              f"{pr['step_time_s'] * 1e3:8.2f} {pr['samples_per_s']:10.0f} "
              f"{pr['energy_per_sample_j']:9.4f}")

    record = {
        "command": harness.command("benchmarks.planning.plan_time"),
        "date_utc": harness.date_utc(),
        "jax_version": jax.__version__,
        "jaxwap_version": jaxwap.__version__,
        "python_version": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "simulated_devices": len(jax.devices()),
        "config": {"batch_size": args.batch_size, "image_size": args.image_size,
                   "dtype": args.dtype, "num_classes": args.num_classes,
                   "objective": "balanced", "optimizer": "adam", "repeats": args.repeats},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")   # any name --out gives
    root = harness.ROOT
    print(f"\nwrote {args.out.relative_to(root) if args.out.is_relative_to(root) else args.out}")


if __name__ == "__main__":
    main()
