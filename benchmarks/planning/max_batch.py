"""The largest batch that fits one device's memory: plain `jax.jit` vs jaxwap.

For VGG-16 (224 px) and a GPT-2-small-shaped decoder (seq 1024), both trained with Adam,
under a fixed per-device memory budget:

- **plain**: `jax.jit(step, donate_argnums=(0, 1))`, the step as a user writes it; it fits
  when XLA's `memory_analysis()` of the compiled step (argument + output + temp - alias)
  is within the budget;
- **jaxwap**: `jaxwap.plan(step, ..., num_devices=1, memory_budget=budget)` on the same loss
  and optimizer built with `jaxwap.make_train_step`, so the planner may shard/offload
  optimizer state and restructure the step (micro-batches; remat on a GPU). jaxwap only
  returns a plan XLA's own analysis says fits (`verify=1`), so "fits" means the same thing
  on both sides.

Batch sizes are searched by doubling and one bisection (plain from 1; jaxwap from plain's
maximum, up to `--cap` times it). On a CPU the budget is artificial (`--budget-gib`, default
8 GiB for VGG-16 and 16 GiB for GPT-2) and every figure is XLA's compiled analysis; float32,
since XLA:CPU computes bfloat16 in float32 anyway. Throughput is only measured on a GPU
(`--run`, default there): real steps on synthetic data at plain's maximum batch and at
jaxwap's, with the device's real memory as the budget unless `--budget-gib` is given.

    python -m benchmarks.planning.max_batch              # both models (several minutes on a CPU)
    python -m benchmarks.planning.max_batch --small      # CI-sized models, seconds
    python -m benchmarks.planning.max_batch --models gpt2 --budget-gib 16

Writes `benchmarks/results/max_batch/cpu[_small].json` and `.md` (on a GPU, its kind in place
of `cpu`).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxwap  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.models import zoo  # noqa: E402

RESULTS = harness.results_dir("max_batch")
GiB = 2**30

MODELS: dict[str, dict[str, Any]] = {
    "vgg16": dict(build=lambda B, dtype, small: zoo.vgg16(
        batch_size=B, dtype=dtype, restructurable=True,
        **({"image_size": 32, "num_classes": 10} if small else {})),
        budget_gib=8.0, small_budget_gib=0.6, multiple=8),
    "gpt2": dict(build=lambda B, dtype, small: zoo.gpt2(
        batch_size=B, dtype=dtype, restructurable=True,
        **({k: v for k, v in zoo.SMALL["gpt2"].items() if k not in ("batch_size", "dtype")}
           if small else {})),
        budget_gib=16.0, small_budget_gib=0.02, multiple=2),
}


@dataclass(frozen=True)
class Fit:
    """One batch size tried: whether it fits, XLA's per-device bytes, and for jaxwap the
    step variant chosen and the predicted samples/s."""

    batch: int
    fits: bool
    memory_bytes: float | None
    step: str = ""
    predicted_samples_per_s: float | None = None
    seconds: float = 0.0


def compiled_bytes(compiled: Any) -> float:
    m = compiled.memory_analysis()
    return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                 - m.alias_size_in_bytes)


def plain_fit(w: zoo.Workload, budget: float) -> Fit:
    t0 = time.perf_counter()
    compiled = jax.jit(w.step, donate_argnums=(0, 1)).lower(*w.args).compile()
    mem = compiled_bytes(compiled)
    return Fit(w.batch_size, mem <= budget, mem, "jax.jit as written",
               seconds=time.perf_counter() - t0)


def jaxwap_fit(w: zoo.Workload, budget: float,
               offload: bool) -> tuple[Fit, jaxwap.Plan | None]:
    t0 = time.perf_counter()
    try:
        plan = jaxwap.plan(w.step, *w.args, params=w.params, num_devices=1,
                           memory_budget=budget, verify=1, cache=False, offload=offload)
    except MemoryError as e:
        return Fit(w.batch_size, False, None, str(e)[:160],
                   seconds=time.perf_counter() - t0), None
    layout = [p.strategy for p in plan.params]
    where = "; optimizer state in host memory" if any("offload" in s for s in layout) else ""
    return Fit(w.batch_size, True, plan.compiled.memory_bytes if plan.compiled else None,
               plan.step.describe() + where, plan.predicted.samples_per_s,
               time.perf_counter() - t0), plan


def largest(fits: Callable[[int], Fit], start: int, cap: int, multiple: int,
            log: list[Fit]) -> int:
    """The largest batch in [start, cap] that fits: doubling, then one bisection between
    the last fit and the first miss (on multiples of `multiple`); 0 if `start` misses."""
    def tried(b: int) -> bool:
        f = fits(b)
        log.append(f)
        print(f"    batch {b:5d}: {'fits' if f.fits else 'no  '} "
              f"{'' if f.memory_bytes is None else f'{f.memory_bytes / GiB:7.2f} GiB'}  "
              f"{f.step}  ({f.seconds:.1f} s)", flush=True)
        return f.fits

    if not tried(start):
        return 0
    ok, b = start, start * 2
    while b <= cap and tried(b):
        ok, b = b, b * 2
    if b <= cap:
        mid = (ok + b) // 2 // multiple * multiple
        if ok < mid < b and tried(mid):
            ok = mid
    return ok


def peak_bytes() -> float | None:
    """The process's high-water mark of device memory (None where the backend keeps none,
    as XLA:CPU): it only rises, so a run's own peak is known only where it raised it."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def throughput(w: zoo.Workload, step: Callable, steps: int) -> float:
    """Measured samples/s of `step` on synthetic data (GPU runs only)."""
    args = w.synthetic(0)
    out = step(*args)
    jax.block_until_ready(out)
    state = out[:2]
    t0 = time.perf_counter()
    for _ in range(steps):
        out = step(*state, args[-1])
        state = out[:2]
    jax.block_until_ready(out)
    return w.batch_size * steps / (time.perf_counter() - t0)


def run_model(name: str, *, small: bool, budget: float, cap_factor: int, run: bool,
              dtype: Any, steps: int, offload: bool) -> dict[str, Any]:
    spec = MODELS[name]
    build = lambda B: spec["build"](B, dtype, small)  # noqa: E731
    print(f"{name}: budget {budget / GiB:.2f} GiB per device, {jnp.dtype(dtype).name}")
    log_plain: list[Fit] = []
    log_jw: list[Fit] = []
    print("  plain jax.jit:")
    plain_max = largest(lambda b: plain_fit(build(b), budget), 1, 1 << 14, 1, log_plain)
    if plain_max == 0:
        raise SystemExit(f"{name}: even batch 1 does not fit {budget / GiB:.2f} GiB with "
                         f"plain jax.jit; raise --budget-gib")
    plans: dict[int, jaxwap.Plan] = {}

    def jw(b: int) -> Fit:
        fit, plan = jaxwap_fit(build(b), budget, offload)
        if plan is not None:
            plans[b] = plan
        return fit

    print(f"  jaxwap (host offload {'allowed' if offload else 'not allowed'}):")
    start = plain_max
    jw_max = largest(jw, start, cap_factor * plain_max, spec["multiple"], log_jw)
    at_plain = next(f for f in log_jw if f.batch == plain_max)
    row: dict[str, Any] = {
        "model": name, "budget_bytes": budget, "dtype": jnp.dtype(dtype).name,
        "plain_max_batch": plain_max, "jaxwap_max_batch": jw_max,
        "ratio": jw_max / plain_max, "cap": cap_factor * plain_max, "offload": offload,
        "jaxwap_step_at_plain_max": at_plain.step,
        "jaxwap_step_at_own_max": plans[jw_max].step.describe() if jw_max in plans else "",
        "description": build(plain_max).description,
        "plain_tried": [asdict(f) for f in log_plain],
        "jaxwap_tried": [asdict(f) for f in log_jw],
        "throughput_basis": "measured" if run else "not measured (no GPU)",
    }
    if run:
        # in order of rising memory, so that each run's peak shows where it raised the
        # process's high-water mark; beside it, XLA's compiled figure for the same program
        peaks: list[dict[str, Any]] = []

        def timed(key: str, w: zoo.Workload, step: Callable, compiled: float | None) -> None:
            before = peak_bytes()
            row[key] = throughput(w, step, steps)
            after = peak_bytes()
            peaks.append({"run": key, "batch": w.batch_size, "compiled_bytes": compiled,
                          "peak_bytes_in_use": after,
                          "peak_is_this_runs": after is not None and (
                              before is None or after > before)})
            print(f"    {key}: {row[key]:.1f} samples/s, peak "
                  f"{'n/a' if after is None else f'{after / GiB:.2f} GiB'}", flush=True)

        w_plain = build(plain_max)
        plain_step = jax.jit(w_plain.step, donate_argnums=(0, 1))
        timed("plain_samples_per_s_at_plain_max", w_plain, plain_step,
              next(f.memory_bytes for f in log_plain if f.batch == plain_max))
        for key, b in (("jaxwap_samples_per_s_at_plain_max", plain_max),
                       ("jaxwap_samples_per_s_at_own_max", jw_max)):
            w = build(b)
            sharded = jaxwap.auto_shard(w.step, w.params, num_devices=1, offload=offload,
                                        memory_budget=budget, verify=1)
            timed(key, w, sharded, next(f.memory_bytes for f in log_jw if f.batch == b))
        row["measured_peaks"] = peaks
        row["throughput_ratio_at_plain_max"] = (row["jaxwap_samples_per_s_at_plain_max"]
                                                / row["plain_samples_per_s_at_plain_max"])
    return row


def table(rows: list[dict[str, Any]], device: str) -> str:
    lines = [f"Largest batch on one device ({device}); fits = XLA's compiled memory analysis "
             "within the budget (argument + output + temp - alias).", "",
             "| model | budget / device | plain jax.jit max batch | jaxwap max batch | ratio | "
             "host offload | "
             "jaxwap's step at its max | jaxwap's step at plain's max | throughput at plain's "
             "max (jaxwap / plain) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        capped = " (search cap)" if r["jaxwap_max_batch"] >= r["cap"] else ""
        tp = (f"{r['throughput_ratio_at_plain_max']:.2f}x (measured)"
              if "throughput_ratio_at_plain_max" in r else "not measured (needs a GPU)")
        lines.append(f"| {r['model']} | {r['budget_bytes'] / GiB:.2f} GiB | "
                     f"{r['plain_max_batch']} | {r['jaxwap_max_batch']}{capped} | "
                     f"{r['ratio']:.1f}x | {'allowed' if r['offload'] else 'off'} | "
                     f"{r['jaxwap_step_at_own_max']} | "
                     f"{r['jaxwap_step_at_plain_max']} | {tp} |")
    runs = [(r["model"], p, r[p["run"]]) for r in rows for p in r.get("measured_peaks", [])]
    if runs:
        lines += ["", "Real steps (measured samples/s; XLA's compiled bytes against the "
                  "device's measured high-water mark, which is this run's own only where the "
                  "run raised it):", "",
                  "| model | run | batch | samples/s | compiled GiB | measured peak GiB |",
                  "|---|---|---|---|---|---|"]
        for model, p, sps in runs:
            peak = p["peak_bytes_in_use"]
            shown = ("n/a" if peak is None else f"{peak / GiB:.2f}"
                     + ("" if p["peak_is_this_runs"] else " (an earlier run's)"))
            comp = "n/a" if p["compiled_bytes"] is None else f"{p['compiled_bytes'] / GiB:.2f}"
            lines.append(f"| {model} | {p['run'].replace('_samples_per_s', '')} | "
                         f"{p['batch']} | {sps:.1f} | {comp} | {shown} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--small", action="store_true", help="CI-sized models")
    ap.add_argument("--budget-gib", type=float, default=None,
                    help="per-device budget (default: per model on CPU; the real memory "
                         "less jaxwap's headroom on a GPU)")
    ap.add_argument("--cap", type=int, default=8, help="search jaxwap up to cap x plain max")
    ap.add_argument("--run", action=argparse.BooleanOptionalAction, default=None,
                    help="run real steps for throughput (default: on a GPU only)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS), help="where the .json and .md go")
    ap.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                    help="let jaxwap keep optimizer state in host memory (default: on a "
                         "GPU only; XLA:CPU ignores memory kinds, so on a CPU the saving "
                         "could only be modelled, and every figure here is XLA's)")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    run = gpu if args.run is None else args.run
    dtype = jnp.bfloat16 if gpu else jnp.float32
    rows: list[dict[str, Any]] = []
    device = f"{dev.device_kind} ({dev.platform})"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = (dev.device_kind.lower().replace(" ", "-") if gpu else "cpu") \
        + ("_small" if args.small else "")
    cmd = harness.command("benchmarks.planning.max_batch", argv)

    def write() -> str:   # after every model, so a run cut short keeps what it finished
        md = table(rows, device)
        harness.write_record(out / stem, {"device": device, "command": cmd.strip(),
                                          "jax": jax.__version__, "rows": rows},
                             f"Command: `{cmd.strip()}`\n\n{md}", indent=2, newline=False)
        return md

    for name in args.models:
        spec = MODELS[name]
        if args.budget_gib is not None:
            budget = args.budget_gib * GiB
        elif gpu:
            limit = jaxwap.hardware.cluster.device_memory_limit(dev)
            budget = float(limit) * (1 - jaxwap.planning.devices.MEMORY_HEADROOM)
        else:
            budget = spec["small_budget_gib" if args.small else "budget_gib"] * GiB
        rows.append(run_model(name, small=args.small, budget=budget, cap_factor=args.cap,
                              run=run, dtype=dtype, steps=args.steps,
                              offload=gpu if args.offload is None else args.offload))
        md = write()
    print("\n" + md)


if __name__ == "__main__":
    main()
