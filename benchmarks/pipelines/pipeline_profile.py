"""Where a pipelined step's time goes on this CPU: the pipelined program of
`benchmarks/pipelines/pipeline_measured.py` profiled op by op.

    .venv/bin/python -m benchmarks.pipelines.pipeline_profile

One process, 2 simulated CPU devices sharing this machine's cores. The model of
`pipeline_measured.py` (8 blocks of 1024 -> 4096 -> 1024 under `lax.scan`, batch 16,
Adam) is planned with a forced pipeline (2 stages, 2 micro-batches, GPipe) and, beside
it, on one device without one; each is compiled through `verify.compile_candidate` (what
`auto_shard` runs) and timed (median of 4 steps after 2), and the pipelined step is traced
with `jax.profiler` for two steps. The table sums the traced ops per device and step,
largest first: **measured**. Predicted figures use the built-in CPU profile (no
calibration here). Writes `benchmarks/results/pipeline_profile/cpu.{json,md}`.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxwap  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.pipelines.pipeline_measured import D, L, loss, model_params  # noqa: E402
from jaxwap.decide.verify import compile_candidate  # noqa: E402
from jaxwap.hardware.cluster import detect_cluster  # noqa: E402
from jaxwap.planner import make_plan  # noqa: E402

RESULTS = harness.results_dir("pipeline_profile")
B = 16
TRACED_STEPS = 2


def compiled_step(step: Any, args: Any, pipeline: Any, devices: int) -> tuple[Any, Any, list]:
    """(candidate, compiled step, placed arguments) of the plan with this pipeline."""
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                                      args)
    planned = make_plan(step, abstract, {}, params=abstract[0], options=jaxwap.PlanOptions(
        verify=0, cache=False, objective="throughput", num_devices=devices,
        pipeline=pipeline))
    r = next(x for x in planned.search.results
             if (x.stages > 1) == bool(pipeline) and x.num_devices == devices)
    cluster, _ = detect_cluster(jax.devices())
    _, cs = compile_candidate(step, planned.layout, r, jax.devices(), cluster)
    state = [jax.make_array_from_callback(np.shape(x), s, lambda i, x=x: np.asarray(x)[i])
             for x, s in zip(jax.tree_util.tree_leaves(args), cs.in_shardings, strict=True)]
    return r, cs, state


def run(cs: Any, state: list, keep: int) -> float:
    t0 = time.perf_counter()
    out = jax.block_until_ready(cs.compiled(*state))
    state[:keep] = list(out[:keep])
    return time.perf_counter() - t0


def op_table(trace_dir: Path) -> list[dict[str, Any]]:
    """Per (device thread, op name): ms per step, from the trace's complete events."""
    path = next(trace_dir.rglob("*.trace.json.gz"))
    events = json.load(gzip.open(path))["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    total: collections.Counter = collections.Counter()
    for e in events:
        name = threads.get((e.get("pid"), e.get("tid")), "")
        if e.get("ph") == "X" and name.startswith("tf_XLAEigen"):
            total[name, e["name"]] += e["dur"]
    devices = {t: f"device {i}" for i, t in enumerate(sorted({t for t, _ in total}))}
    return [{"device": devices[t], "op": op, "ms_per_step": us / 1e3 / TRACED_STEPS}
            for (t, op), us in total.most_common()]


def main() -> None:
    rng = np.random.default_rng(0)
    params = model_params(rng)
    batch = {"x": rng.standard_normal((B, 64), np.float32),
             "t": rng.standard_normal((B, 8), np.float32)}
    step = jaxwap.make_train_step(loss, optax.adam(1e-4))
    args = (params, step.init(params), batch)
    keep = len(jax.tree_util.tree_leaves(args)) - len(batch)
    rows, ops = [], []
    for label, pipe, n in (("pipelined", {"stages": 2, "micro_batches": 2, "repeats": 1}, 2),
                           ("one device", False, 1)):
        r, cs, state = compiled_step(step, args, pipe, n)
        times = [run(cs, state, keep) for _ in range(6)][2:]
        rows.append({"which": label, "mesh": dict(r.mesh), "measured_s": float(np.median(times)),
                     "predicted_s": r.predicted.step_time_s})
        print(rows[-1], flush=True)
        if pipe:
            with tempfile.TemporaryDirectory() as tmp:
                jax.profiler.start_trace(tmp)
                for _ in range(TRACED_STEPS):
                    run(cs, state, keep)
                jax.profiler.stop_trace()
                ops = op_table(Path(tmp))
    head = ("One process, 2 simulated CPU devices on this machine's cores; "
            f"{L} blocks of {D} -> {4 * D} -> {D} under lax.scan, batch {B}, f32, Adam. "
            "Command: `.venv/bin/python -m benchmarks.pipelines.pipeline_profile`. Step times "
            "**measured** (median) beside the **predicted** figure (built-in CPU profile).\n\n"
            "| candidate | mesh | measured ms | predicted ms |\n|---|---|---|---|\n")
    head += "".join(f"| {x['which']} | {x['mesh']} | {x['measured_s'] * 1e3:.1f} | "
                    f"{x['predicted_s'] * 1e3:.1f} |\n" for x in rows)
    head += ("\nThe pipelined step's 25 largest ops per device and step (`jax.profiler`, "
             "**measured**; events nest: ThunkExecutor::Execute is a whole program or loop "
             "body, a conditional counts the ops inside it; 'Rendezvous' and 'Wait' are a "
             "device waiting for the other at a collective):\n\n"
             "| device | op | ms per step |\n|---|---|---|\n")
    head += "".join(f"| {x['device']} | {x['op']} | {x['ms_per_step']:.1f} |\n"
                    for x in ops[:25])
    harness.write_record(RESULTS / "cpu", {
        "jax": jax.__version__, "command": "python -m benchmarks.pipelines.pipeline_profile",
        "rows": rows, "ops": ops[:200]}, head, newline=False)
    print(head)


if __name__ == "__main__":
    sys.exit(main())
