"""Where a step's time goes on this CPU, by XLA's own per-operation timing, beside the model.

    .venv/bin/python -m benchmarks.accuracy.op_profile     # the four CI-sized zoo models
    .venv/bin/python -m benchmarks.accuracy.op_profile --models gpt2 --fresh

The step-time table of `measured.py` says how far the prediction is from the measured step;
this says which part of the model is off. For each CI-sized model of `benchmarks/models/zoo.py` on
one CPU device (one process, XLA on both cores):

- predicted: the one-device candidate's step time as the planner predicts it, with the
  profile `jaxwap.calibrate` measures here (cached, or measured again with ``--fresh``):
  its per-op times (`op_time.op_times`) summed by kind of op, and the two terms the model
  keeps apart from the ops (layout changes, fresh scratch memory);
- measured: the step compiled by `jax.jit` (state donated, as `auto_shard` compiles it) and
  run under `jax.profiler.trace`. XLA:CPU records every operation it runs (each thunk, on
  whichever thread of its pool ran it; one split into parallel parts up to the end of its
  last, `op_events`); each moment of a step is shared out among the operations running
  then and summed per step by the same kinds. The step's wall time is timed apart,
  without the profiler.

Kinds, by each operation's name and what its fused computation in the compiled program
holds: matmuls and convolutions (XLA's `dot`, its convolutions, and the YNNPACK fusions that
carry either), reductions (YNNPACK's reduction fusions, XLA's reduce and reduce-window
fusions), other fused elementwise work (`fusion`, XLA's `wrapped_*` ops: broadcasts, iotas,
scatters), layout changes XLA inserts that the jaxpr does not have (`copy`, `reverse`,
`transpose`; the model prices a convolution kernel's and a kernel gradient's operands' with
their convolutions), and the rest. jaxpr ops and XLA operations are not one to one (XLA fuses
and rewrites), so the comparison is by kind, not by op.

Each model's slowest fused elementwise operations are listed with the bytes each reads
and writes (`xla_figures.operation_bytes`) and the bandwidth that gives; the wall time left
outside any operation stands beside the host's call of the step the model prices
(`prediction.call_time`).

Writes `benchmarks/results/op_profile/cpu.json` and `cpu.md` (with `--tag T`,
`cpu_T.*`: one pinned core is `taskset -c 0 ... --tag one_core --fresh`).
"""

from __future__ import annotations

import bisect
import glob
import os
import re
import tempfile
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxwap  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.models import zoo  # noqa: E402
from jaxwap.calibration.calibrate import calibrate_full  # noqa: E402
from jaxwap.cost.op_time import op_times  # noqa: E402
from jaxwap.decide.xla_figures import computations, operation_bytes  # noqa: E402
from jaxwap.hardware.cluster import detect_cluster  # noqa: E402
from jaxwap.planner import make_plan  # noqa: E402

RESULTS = harness.results_dir("op_profile")

MODELS = ("alexnet", "vgg16", "resnet50", "gpt2")
SLOWEST = 8    # fused elementwise operations listed per model, slowest first
KINDS = ("matmul and convolution", "reduction", "fused elementwise",
         "layout (copy, reverse, transpose)", "other")
# XLA:CPU's bookkeeping events: not operations of the step
_BOOKKEEPING = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener")


def fused_bodies(hlo: str) -> dict[str, str]:
    """Each fusion instruction's name -> the text of the computation it calls (and of the
    computations that one calls), from the compiled program's HLO text: what an XLA:CPU
    thunk event of that name ran."""
    comps = computations(hlo)

    def body(name: str, depth: int = 0) -> str:
        text = "\n".join(comps.get(name, []))
        if depth < 3:
            text += "".join(body(c, depth + 1)
                            for c in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", text))
        return text

    return {m.group(1): body(m.group(2)) for m in re.finditer(
        r"^\s*(?:ROOT )?%([\w.\-]+) = .*?calls=%([\w.\-]+)", hlo, re.M)}


def xla_kind(name: str, bodies: dict[str, str]) -> str:
    """The kind of an XLA:CPU operation, by the name its thunk event carries and what its
    fused computation holds: YNNPACK's fusions carry matmuls, convolutions or reductions
    (their names do not say which), XLA's own loop fusions elementwise work, reductions
    or layout changes (a fusion holding a transpose or reverse counts as one)."""
    base = re.sub(r"\.\d+$", "", name)
    body = bodies.get(name, "")
    if base == "dot" or base.startswith("conv") or "convolution" in base \
            or re.search(r" (dot|convolution)\(", body):
        return "matmul and convolution"
    if base in ("copy", "wrapped_reverse", "wrapped_transpose", "transpose", "reverse") \
            or re.search(r" (transpose|reverse)\(", body):
        return "layout (copy, reverse, transpose)"
    if re.search(r" (reduce|reduce-window)\(", body) or "reduce" in base:
        return "reduction"
    if base == "fusion" or base.endswith("_fusion") or base.startswith("wrapped_"):
        return "fused elementwise"
    return "other"


def predicted_by_kind(graph: Any, times: np.ndarray) -> dict[str, float]:
    """The model's per-op seconds summed by the same kinds (kernel launches included;
    a kernel gradient's operand copies, `grad_reductions.conv_grad_relayouts`, with its
    convolution)."""
    out = dict.fromkeys(KINDS, 0.0)
    for k, t in enumerate(times):
        if graph.conv[k] or graph.is_matmul[k]:
            kind = "matmul and convolution"
        elif graph.reduced[k] or graph.window_taps[k] or graph.window_grad_elems[k]:
            kind = "reduction"    # XLA:CPU pools, and their gradients, with reduce-windows
        elif graph.flops[k] or graph.bytes[k] or graph.kernels[k]:
            kind = "fused elementwise"
        else:
            kind = "other"
        out[kind] += float(t)
    return out


def op_events(profile: Any) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
    """XLA:CPU's operations in a `jax.profiler` trace as (start ns, duration ns, name), and
    the host's Python calls alike. An operation whose loop XLA splits into parallel
    partitions (`outer_dimension_partitions`) records an event only for the part the
    launching thread runs; the pool's threads run the rest, and XLA marks the moment the
    last part ends with an event named "end: <operation>". Its duration here runs to that
    mark: on one pinned core AlexNet-small's 64 MiB copy of a weight records 5 ms and ends
    35 ms after it starts."""
    ops, host, ends = [], [], {}
    for plane in profile.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for e in line.events:
                if line.name == "python":
                    host.append((e.start_ns, e.duration_ns, e.name))
                elif e.name.startswith("end: "):
                    ends.setdefault(e.name[5:], []).append(e.start_ns)
                elif not e.name.startswith(_BOOKKEEPING):
                    ops.append((e.start_ns, e.duration_ns, e.name))
    for marks in ends.values():
        marks.sort()
    out = []
    for start, dur, name in ops:
        marks = ends.get(name, [])
        i = bisect.bisect_left(marks, start)
        out.append((start, max(dur, marks[i] - start) if i < len(marks) else dur, name))
    return out, host


def shared_out(spans: list[tuple[int, int, str]]) -> dict[str, float]:
    """Seconds per label, each moment of the spans shared out equally among the spans
    running then: on a process pinned to one core, operations that overlap (the copies a
    step starts with, a collective waiting beside compute) share that core, so their
    shares add up to the time something ran."""
    cuts = sorted({t for a, b, _ in spans for t in (a, b)})
    out: dict[str, float] = {}
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        on = [label for a, b, label in spans if a <= lo and b >= hi]
        for label in on:
            out[label] = out.get(label, 0.0) + (hi - lo) * 1e-9 / len(on)
    return out


def profile_step(run: Any, steps: int, bodies: dict[str, str]
                 ) -> tuple[dict[str, float], float, dict[str, float]]:
    """Seconds per step of each kind of XLA operation, from a profiler trace of `steps`
    runs (`op_events`: each operation from its start to the end of its last part), each
    moment shared out among the operations running then (`shared_out`), how many
    operations a step runs, and each operation's own seconds per step (shared out too)."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                run()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        if not files:
            raise RuntimeError(f"jax.profiler.trace wrote no xplane file under {d}")
        ops, _ = op_events(ProfileData.from_file(files[0]))
    shares = shared_out([(s, s + d, xla_kind(name, bodies)) for s, d, name in ops])
    each = shared_out([(s, s + d, name) for s, d, name in ops])
    return ({k: shares.get(k, 0.0) / steps for k in KINDS}, len(ops) / steps,
            {name: t / steps for name, t in each.items()})


def measure(name: str, cluster: Any, steps: int) -> dict[str, Any]:
    w = zoo.small(name)
    planned = make_plan(w.step, w.args, {}, params=w.params,
                        options=jaxwap.PlanOptions(hardware=cluster, verify=0, cache=False))
    times = op_times(planned.graph, cluster, 1.0)
    # the one-device candidate's whole prediction: its ops, and the terms of the step the
    # model keeps apart from them (layout changes XLA inserts, fresh scratch memory)
    one = next(r for r in planned.search.results if (r.d, r.m) == (1, 1)).predicted
    data = w.synthetic(0)
    f = jax.jit(w.step, donate_argnums=tuple(range(len(data) - 1))).lower(*data).compile()
    bodies, moved = fused_bodies(f.as_text()), operation_bytes(f.as_text())
    state = [jax.device_put(x) for x in data]

    def run() -> None:
        out = jax.block_until_ready(f(*state))
        state[: len(state) - 1] = out[:-1]   # the batch comes last; the rest is state

    walls = zoo.wall_times(run, steps, warm=2)
    by_kind, ops, each = profile_step(run, 3, bodies)
    # the slowest fused elementwise operations, with the bytes each reads and writes
    slow = sorted((n for n in each if xla_kind(n, bodies) == "fused elementwise"),
                  key=lambda n: -each[n])[:SLOWEST]
    predicted = predicted_by_kind(planned.graph, times)
    predicted["layout (copy, reverse, transpose)"] += one.layout_change_time_s
    predicted["fresh memory (inside the ops that write it)"] = one.fresh_memory_time_s
    predicted["host's call (outside the operations)"] = one.call_time_s
    return {"model": w.name, "predicted_s": predicted,
            "measured_s": by_kind, "operations_per_step": ops,
            "slowest_elementwise": [{"operation": n, "s": each[n], "bytes": moved.get(n, 0)}
                                    for n in slow],
            "predicted_kernels": float(planned.graph.kernels.sum()),
            "predicted_step_s": float(one.step_time_s),
            "measured_step_s": float(np.median(walls))}


def markdown(record: dict[str, Any]) -> str:
    cal = record["profile"]
    lines = [f"Measured on this machine's CPU ({record['cpu']}), one device, "
             f"{record['date_utc']}: XLA:CPU's own per-operation times from "
             f"`jax.profiler.trace`, summed by kind per step, beside jaxwap's predicted "
             f"per-op times (profile calibrated here: f32 matmul "
             f"{cal['peak_flops_f32'] / 1e9:.0f} Gflop/s, half-efficiency at "
             f"{cal['efficiency_half_flops'] / 1e6:.1f} Mflop, "
             f"{cal['memory_bandwidth'] / 1e9:.0f} GB/s, kernel "
             f"{cal['kernel_overhead_s'] * 1e6:.1f} us, convolutions at "
             f"{cal['conv_efficiency']:.2f} of the matmul rate, generic loop "
             f"{(cal['small_input_conv_flops'] or 0) / 1e9:.2f} Gflop/s). Command: "
             f"`{record['command']}`.", "",
             "Each operation runs from its start to the end of its last parallel part "
             "(XLA's 'end:' mark), and each moment of the step is shared out equally among "
             "the operations running then, so the kinds add up to the time some operation "
             "ran. The predicted "
             "step is the one-device candidate's (what the planner ranks): its ops by "
             "kind, the layout changes XLA inserts (with the layout kind), and the fresh "
             "scratch memory the step maps (which XLA's profile counts inside the ops "
             "that write it).", ""]
    for row in record["rows"]:
        p, m = row["predicted_s"], row["measured_s"]
        lines += [f"**{row['model']}**: step predicted {row['predicted_step_s'] * 1e3:.2f} ms, "
                  f"measured {row['measured_step_s'] * 1e3:.2f} ms wall "
                  f"({row['predicted_step_s'] / row['measured_step_s'] - 1:+.0%}); "
                  f"its {row['operations_per_step']:.0f} XLA operations (the model counts "
                  f"{row['predicted_kernels']:.0f} kernels) sum to "
                  f"{sum(m.values()) * 1e3:.2f} ms, so "
                  f"{(row['measured_step_s'] - sum(m.values())) * 1e3:.2f} ms of the wall "
                  f"time passes outside any operation", "",
                  "| kind | predicted ms | measured ms (XLA profile) |", "|---|---|---|"]
        lines += [f"| {k} | {p.get(k, 0.0) * 1e3:.2f} | "
                  f"{m[k] * 1e3:.2f} |" if k in m else f"| {k} | {p[k] * 1e3:.2f} | - |"
                  for k in (*KINDS, *(k for k in p if k not in KINDS))
                  if p.get(k) or m.get(k)]
        lines += ["", f"its {len(row['slowest_elementwise'])} slowest fused elementwise "
                  f"operations (bytes: the operation's result and operands):", "",
                  "| operation | us per step | MB | GB/s |", "|---|---|---|---|"]
        lines += [f"| {o['operation']} | {o['s'] * 1e6:.1f} | {o['bytes'] / 1e6:.3f} | "
                  f"{o['bytes'] / max(o['s'], 1e-12) / 1e9:.1f} |"
                  for o in row["slowest_elementwise"]]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=10, help="timed steps for the wall time")
    ap.add_argument("--fresh", action="store_true", help="calibrate again, not from cache")
    ap.add_argument("--tag", default="", help="write op_profile/cpu_TAG.{json,md} "
                    "(another placement, say: taskset -c 0 for one pinned core)")
    args = ap.parse_args()
    devices = jax.devices()[:1]
    cal = calibrate_full(devices, progress=False, use_cache=not args.fresh)
    cluster, _ = detect_cluster(devices, cal)
    rows = []
    for name in args.models.split(","):
        row = measure(name, cluster, args.steps)
        rows.append(row)
        print(f"{row['model']:15s} predicted {row['predicted_step_s'] * 1e3:8.2f} ms  "
              f"measured {row['measured_step_s'] * 1e3:8.2f} ms, "
              f"{row['operations_per_step']:.0f} operations summing to "
              f"{sum(row['measured_s'].values()) * 1e3:.2f} ms", flush=True)
        for k in row["predicted_s"]:
            p, m = row["predicted_s"][k], row["measured_s"].get(k, float("nan"))
            print(f"    {k:36s} {p * 1e3:9.2f} {m * 1e3:9.2f}")
    record = {"command": harness.command("benchmarks.accuracy.op_profile"),
              "date_utc": harness.date_utc(minutes=True),
              "cpu": harness.cpu_line(affinity=True),
              "basis": "predicted = jaxwap's per-op model with the profile calibrated here; "
                       "measured = XLA:CPU's per-operation times from jax.profiler",
              "profile": cluster.device.to_dict(), "rows": rows}
    stem = RESULTS / ("cpu" + (f"_{args.tag}" if args.tag else ""))
    harness.write_record(stem, record, markdown(record) + "\n")
    print(f"wrote {stem}.md")


if __name__ == "__main__":
    main()
