"""A pipeline measured on a real two-device cluster: where the model says pipelining wins,
the pipelined step against the best non-pipelined one, each measured beside its
prediction.

    .venv/bin/python -m benchmarks.pipelines.pipeline_measured

Two processes under `jax.distributed` on 127.0.0.1, one CPU device each, each pinned to
its own core, talking over gloo (the cluster of `benchmarks/accuracy/measured.py`). The profile is
calibrated there (`jaxwap.calibrate`: flop/s, bandwidth, kernel overhead, link bandwidth
and latency over gloo). The model is a stack of 8 wide MLP blocks under `lax.scan`: big
weights, whose gradient all-reduce costs data parallelism more than a pipeline's sends
cost it. `jaxwap.plan` (objective "throughput", pipelining weighed beside every other
candidate) plans it at batch 16, 64 and 256 until it chooses a pipeline (the largest
batch if it never does); there its best pipelined and best non-pipelined candidates
are compiled through `verify.compile_candidate` (what `auto_shard` runs), run as a
training loop on synthetic data through the call `auto_shard`'s step makes
(`zoo.step_runner`: the arguments in their pytrees) and timed (median after a warm-up). Writes
`benchmarks/results/pipeline_measured/cpu.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

MODULE = "benchmarks.pipelines.pipeline_measured"   # this script, as `python -m` runs it
RESULTS = harness.results_dir("pipeline_measured")
L, D = 8, 1024
# batch sizes tried, in order: the first where the planner chooses a pipeline is measured
# (the largest when none is: then both sides are still measured beside their predictions)
BATCHES = (16, 64, 256)


def loss(params: Any, batch: Any) -> Any:
    """The measured model: L wide MLP blocks under `lax.scan` between two projections."""
    import jax
    import jax.numpy as jnp

    h = batch["x"] @ params["inp"]

    def block(h: Any, w: Any) -> Any:
        return h + jnp.tanh(h @ w["up"]) @ w["down"], None

    h, _ = jax.lax.scan(block, h, params["blocks"])
    return jnp.mean((h @ params["out"] - batch["t"]) ** 2)


def model_params(rng: Any) -> dict[str, Any]:
    """The measured model's parameters (numpy, f32), drawn from `rng`."""
    import numpy as np

    return {"inp": rng.standard_normal((64, D), np.float32) / 8,
            "blocks": {"up": rng.standard_normal((L, D, 4 * D), np.float32) / 32,
                       "down": rng.standard_normal((L, 4 * D, D), np.float32) / 64},
            "out": rng.standard_normal((D, 8), np.float32) / 32}


def worker(args: argparse.Namespace) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jaxwap.runtime.distributed import start_distributed

    why = start_distributed(args.coordinator, 2, args.process_id, timeout_s=60)
    if why is not None:
        raise SystemExit(f"jax.distributed did not start: {why}")
    import jax
    import numpy as np
    import optax
    from jax.experimental import multihost_utils

    import jaxwap
    from benchmarks.models import zoo
    from jaxwap.calibration.calibrate import calibrate_full
    from jaxwap.core.records import STAGE
    from jaxwap.decide.verify import compile_candidate
    from jaxwap.hardware.calibration import Calibration
    from jaxwap.hardware.cluster import detect_cluster
    from jaxwap.planner import make_plan

    pid = jax.process_index()
    devices = jax.devices()
    shared = Path(args.workdir)
    cal = calibrate_full(devices, progress=False, quick=True, use_cache=False,
                         directory=shared / f"cal{pid}")
    if pid == 0:
        (shared / "calibration.json").write_text(json.dumps(cal.to_dict()))
    multihost_utils.sync_global_devices("calibrated")
    cal = Calibration.from_dict(json.loads((shared / "calibration.json").read_text()))
    cluster, _ = detect_cluster(devices, cal)

    rng = np.random.default_rng(0)
    params = model_params(rng)
    step = jaxwap.make_train_step(loss, optax.adam(1e-4))
    opt = step.init(params)
    tried = []
    for B in BATCHES:
        batch = {"x": rng.standard_normal((B, 64), np.float32),
                 "t": rng.standard_normal((B, 8), np.float32)}
        args_ = (params, opt, batch)
        # abstract: global shapes (host arrays would be taken as this process's slice)
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args_)
        planned = make_plan(step, abstract, {}, params=abstract[0],
                            options=jaxwap.PlanOptions(hardware=cluster, verify=0, cache=False,
                                                       objective="throughput"))
        chosen = dict(planned.plan.mesh_shape)
        tried.append({"batch": B, "chosen_mesh": chosen,
                      "predicted_s": planned.plan.predicted.step_time_s})
        if chosen.get(STAGE, 1) > 1:
            break
    results = planned.search.results
    cands = planned.plan.candidates

    def pick(pipelined: bool) -> int:
        idx = [i for i, r in enumerate(results) if (r.stages > 1) == pipelined and r.fits]
        return min(idx, key=lambda i: planned.search.scores[i])

    rows = []
    for label, i in (("pipelined", pick(True)), ("not pipelined", pick(False))):
        r = results[i]
        multihost_utils.sync_global_devices(f"start-{label}")
        if pid >= r.num_devices:   # a mesh of process 0's device alone: the rest wait
            continue
        _, cs = compile_candidate(step, planned.layout, r, devices, cluster)
        flat = jax.tree_util.tree_leaves(args_)
        state = [jax.make_array_from_callback(np.shape(x), s, lambda idx, x=x: np.asarray(x)[idx])
                 for x, s in zip(flat, cs.in_shardings, strict=True)]
        run = zoo.step_runner(cs, planned.layout, state)   # the call auto_shard's step makes
        for _ in range(2):
            run()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        p = r.predicted
        rows.append({"which": label, "mesh": dict(r.mesh), "chosen": cands[i].chosen,
                     "step": r.step.describe() if r.step else "as written",
                     "measured_s": float(np.median(times)), "predicted_s": p.step_time_s,
                     "predicted_bubble_s": p.bubble_time_s, "predicted_send_s": p.send_time_s,
                     "predicted_exposed_comm_s": p.exposed_comm_time_s,
                     "predicted_compute_s": p.compute_time_s, "steps_timed": len(times)})
    multihost_utils.sync_global_devices("measured")
    if pid == 0:
        Path(args.out).write_text(json.dumps(
            {"calibration": cal.to_dict(), "rows": rows,
             "chosen_mesh": dict(planned.plan.mesh_shape),
             "chosen_pipelined": dict(planned.plan.mesh_shape).get(STAGE, 1) > 1,
             "tried": tried,
             "model": f"{L} blocks of {D} -> {4 * D} -> {D} under lax.scan, batch {B}, "
                      f"f32, Adam"}, indent=1))


def markdown(doc: dict[str, Any], command: str) -> str:
    cal = doc["calibration"]
    out = [f"Two processes on this machine's CPU (one core, one device each, gloo over "
           f"127.0.0.1), profile calibrated there; model: {doc['model']}. Command: "
           f"`{command}`. Step times **measured** (median) beside jaxwap's **predicted** "
           f"figure for the same candidate. The planner (objective throughput) chose "
           f"{doc['chosen_mesh']} ({'pipelined' if doc['chosen_pipelined'] else 'not pipelined'}).",
           "", "Batch sizes planned, in order, until the planner chose a pipeline: "
           + "; ".join(f"batch {t['batch']}: {t['chosen_mesh']}, predicted "
                       f"{t['predicted_s'] * 1e3:.1f} ms" for t in doc.get("tried", [])) + ".",
           "", f"calibration: {json.dumps({k: cal[k] for k in list(cal)[:3]})[:300]}", "",
           "| candidate | mesh | step | measured ms | predicted ms | error | predicted "
           "bubble ms | predicted sends ms | predicted exposed grad comm ms |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        err = r["predicted_s"] / r["measured_s"] - 1
        out.append(f"| {r['which']}{' (chosen)' if r['chosen'] else ''} | {r['mesh']} | "
                   f"{r['step']} | {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} "
                   f"| {err:+.0%} | {r['predicted_bubble_s'] * 1e3:.1f} | "
                   f"{r['predicted_send_s'] * 1e3:.1f} | "
                   f"{r['predicted_exposed_comm_s'] * 1e3:.1f} |")
    rows = {r["which"]: r for r in doc["rows"]}
    if len(rows) == 2:
        a, b = rows["pipelined"], rows["not pipelined"]
        out += ["", f"Pipelined over not pipelined: measured "
                    f"{b['measured_s'] / a['measured_s']:.2f}x faster, predicted "
                    f"{b['predicted_s'] / a['predicted_s']:.2f}x."]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if args.worker:
        try:
            worker(args)
        except BaseException:
            import traceback
            (Path(args.workdir) / f"error{args.process_id}.txt").write_text(
                traceback.format_exc())
            raise
        return
    from jaxwap.runtime.launch import describe, launch_local

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        argv = harness.worker(MODULE, "--worker", "--process-id",
                              "{process_id}", "--coordinator", "{coordinator}", "--workdir", tmp,
                              "--out", str(out), "--steps", str(args.steps))
        results = launch_local(argv, 2, pin_cores=True, timeout_s=1500,
                               cwd=str(harness.ROOT))
        for r in results:
            print(r.tail(4000) if r.process_id == 0 else "", end="")
        if not all(r.ok for r in results):
            errors = "".join(p.read_text()[-3000:] for p in Path(tmp).glob("error*.txt"))
            raise SystemExit(f"failed:\n{errors or describe(results)}")
        doc = json.loads(out.read_text())
    command = f"python -m {MODULE}"
    harness.write_record(RESULTS / "cpu", {"command": command, **doc}, markdown(doc, command),
                         newline=False)
    print(markdown(doc, command))


if __name__ == "__main__":
    main()
