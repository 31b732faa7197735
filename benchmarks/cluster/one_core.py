"""A candidate's whole work on one core: is a 2-device program heavier than the 1-device one?

    NPROC=1 taskset -c 0 .venv/bin/python -m benchmarks.cluster.one_core    # AlexNet-small
    NPROC=1 taskset -c 0 .venv/bin/python -m benchmarks.cluster.one_core --models alexnet,vgg16

On the two-process gloo cluster (`measured.py --setup cluster`) each process of
AlexNet-small's FSDP 2x1 step computes 82-92 ms where the model predicts 67.6 ms, and every
2-device AlexNet and VGG-16 layout is under-predicted, while one-device steps are not. That
is either the program (XLA's 2-device program doing more work than half the one-device
one) or the setting (two processes, one core each, gloo, both cores busy at once). This
runs the programs `auto_shard` would compile (the planner's one-device candidate, FSDP
2x1 and the planner's 1x2, compiled by `verify.compile_candidate`) on two simulated CPU
devices of one process, which the command pins to one core with XLA's pools at one thread:
the devices' work then runs one after the other on that core, so a step's wall time is the
program's whole work (its collectives are in-process copies). Then two such processes at
once, pinned to cores 0 and 1: the same work with both cores busy. **Measured**: the median of
8 steps' wall time, each step's new state the next step's. **Predicted**: the candidate's
compute per device with the cluster calibration `measured.py` recorded (one core a
process), the figure the cluster is checked against. Then copies of 64 MiB on one core
alone and on two cores at once (two processes): what the memory system gives each of two
processes running a memory-bound phase together. Writes `results/one_core/cpu.json` and
`.md`.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks import harness  # noqa: E402

MODULE = "benchmarks.cluster.one_core"   # this script, as `python -m` runs it
RESULTS = harness.results_dir("one_core")
#: (data, model, variant) of each program timed
RUNS = ((1, 1, "planner"), (2, 1, "fsdp"), (1, 2, "planner"))


def measure(model: str, steps: int) -> list[dict[str, Any]]:
    import jax
    import numpy as np

    import jaxwap
    from benchmarks.models import zoo
    from benchmarks.models.layouts import mesh_candidate
    from jaxwap.decide.verify import compile_candidate
    from jaxwap.hardware.calibration import Calibration
    from jaxwap.planner import make_plan

    record = json.loads((harness.results_dir("measured") / "cpu.json").read_text())
    cal = Calibration.from_dict(record["setups"]["cluster"]["calibrations"][model])
    devices = jax.devices()
    # as each process of the cluster plans: two devices of the calibrated core, not one
    # host's cores shared out among simulated devices
    cluster = jaxwap.Cluster(cal.spec, 2)
    # ... and the same with both cores' processes running at once: the memory-side
    # figures slowed as the calibration measured the host (`Cluster.co_running`)
    host = cal.measurements.get("host_memory")
    host = jaxwap.HostMemory.from_dict(host) if host else None
    together = jaxwap.Cluster(jaxwap.Cluster(cal.spec, 2, host_memory=host)
                              .co_running(2).device, 2)
    w = zoo.small(model)
    planned = make_plan(w.step, w.args, {}, params=w.params, options=jaxwap.PlanOptions(
        hardware=cluster, verify=0, cache=False))
    both = make_plan(w.step, w.args, {}, params=w.params, options=jaxwap.PlanOptions(
        hardware=together, verify=0, cache=False))
    rows = []
    for d, m, variant in RUNS:
        cand = mesh_candidate(planned, d, m, variant, cluster)
        _, cs = compile_candidate(w.step, planned.layout, cand, devices[: d * m], cluster)
        data = w.synthetic(0)
        state = [jax.device_put(np.asarray(x), s) for x, s in
                 zip(jax.tree_util.tree_leaves(data), cs.in_shardings, strict=True)]

        run = zoo.step_runner(cs, planned.layout, state)

        walls = zoo.wall_times(run, steps)
        row = {"model": f"{model}-small", "layout": f"{variant}@{d}x{m}", "devices": d * m,
               "measured_wall_ms": statistics.median(walls) * 1e3,
               "measured_per_device_ms": statistics.median(walls) * 1e3 / (d * m),
               "predicted_compute_per_device_ms": cand.predicted.compute_time_s * 1e3,
               "predicted_together_ms": mesh_candidate(both, d, m, variant, together)
               .predicted.compute_time_s * 1e3,
               "host_memory": host.to_dict() if host else None}
        rows.append(row)
        print(row, flush=True)
    return rows


def twin(models: str, steps: int) -> list[list[dict[str, Any]]]:
    """Each process's rows when two processes, pinned to cores 0 and 1 with XLA's pools at
    one thread, run `measure` at once: the same programs with both cores busy, as the
    gloo cluster's two processes run a 2-device step."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        procs = [subprocess.Popen(harness.worker(MODULE, "--models", models, "--steps",
                                                 str(steps), "--twin-worker", str(core),
                                                 f"{d}/{core}.json"),
                                  env=dict(os.environ, NPROC="1"), cwd=harness.ROOT)
                 for core in (0, 1)]
        if any(q.wait() for q in procs):
            raise SystemExit("a twin process failed")
        return [json.loads(Path(f"{d}/{core}.json").read_text()) for core in (0, 1)]


def stream_worker(core: int, seconds: float) -> None:
    """Copy 64 MiB back and forth on `core` for `seconds`; print GB/s moved (read + write)."""
    import numpy as np

    os.sched_setaffinity(0, {core})
    a = np.ones(16 * 2**20, np.float32)
    b = np.empty_like(a)
    for _ in range(3):
        np.copyto(b, a)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        np.copyto(b, a)
        n += 1
    print(2 * a.nbytes * n / (time.perf_counter() - t0) / 1e9, flush=True)


def stream_contention(seconds: float = 4.0) -> dict[str, Any]:
    """GB/s one core streams copies alone, and each of cores 0 and 1 when both do at once
    (separate processes, as the gloo cluster's are): what two processes running the same
    memory-bound phase of a step at once get of the memory system."""
    import subprocess

    def start(core: int) -> Any:
        return subprocess.Popen(harness.worker(MODULE, "--stream-worker", str(core),
                                               str(seconds)),
                                stdout=subprocess.PIPE, text=True, cwd=harness.ROOT)

    alone = float(start(0).communicate()[0])
    both = [start(0), start(1)]
    return {"alone_GBps": alone, "both_GBps": [float(q.communicate()[0]) for q in both]}


def markdown(rec: dict[str, Any]) -> str:
    lines = [f"# One core, the whole program: {', '.join(rec['models'])}", "",
             f"Command: `{rec['command']}` on {rec['date_utc']}; affinity {rec['affinity']}, "
             f"NPROC={rec['nproc']}. **Measured**: median wall time of {rec['steps']} steps of "
             "the program on two simulated devices run one after the other on that core (a "
             "step's whole work). **Predicted**: compute per device, model with the cluster "
             "calibration of `measured/cpu.json` (one core a process).", "",
             "Both cores (**measured**): two processes, pinned to cores 0 and 1 at one XLA "
             "thread each, run the same programs at once, as the cluster's two processes "
             "run a 2-device step; predicted with the memory-side figures slowed by the "
             "host's measured slowdown (`Cluster.co_running`, from the calibration's "
             "`host_memory`).", "",
             "| model | layout | devices | measured wall ms | per device ms | predicted "
             "compute per device ms | both cores: per device ms (core 0, core 1) | "
             "predicted, both cores |", "|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        lines.append(f"| {r['model']} | {r['layout']} | {r['devices']} | "
                     f"{r['measured_wall_ms']:.1f} | {r['measured_per_device_ms']:.1f} | "
                     f"{r['predicted_compute_per_device_ms']:.1f} | "
                     + ", ".join(f"{x:.1f}" for x in r["twin_per_device_ms"])
                     + f" | {r['predicted_together_ms']:.1f} |")
    hosts = {r["model"]: r["host_memory"] for r in rec["rows"]}
    lines += ["", "The host's slowdowns each prediction took (the calibration's "
              "`host_memory`): " + "; ".join(f"{m} {h}" for m, h in hosts.items()) + "."]
    c = rec["streams"]
    lines += ["", f"Copies of 64 MiB (numpy, **measured**): one core alone "
              f"{c['alone_GBps']:.1f} GB/s; cores 0 and 1 at once (two processes) "
              + " and ".join(f"{x:.1f}" for x in c["both_GBps"]) + " GB/s each."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--models", default="alexnet")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--stream-worker", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--twin-worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stream_worker:
        return stream_worker(int(args.stream_worker[0]), float(args.stream_worker[1]))
    if args.twin_worker:
        os.sched_setaffinity(0, {int(args.twin_worker[0])})
        rows = [r for m in args.models.split(",") for r in measure(m, args.steps)]
        return Path(args.twin_worker[1]).write_text(json.dumps(rows))
    rows = [r for m in args.models.split(",") for r in measure(m, args.steps)]
    for r, *pair in zip(rows, *twin(args.models, args.steps), strict=True):
        r["twin_per_device_ms"] = [q["measured_per_device_ms"] for q in pair]
    streams = stream_contention()
    rec = {"command": "NPROC=" + os.environ.get("NPROC", "") + " " + harness.command(MODULE),
           "date_utc": harness.date_utc(),
           "affinity": sorted(os.sched_getaffinity(0)), "nproc": os.environ.get("NPROC"),
           "steps": args.steps, "models": args.models.split(","), "rows": rows,
           "streams": streams}
    harness.write_record(RESULTS / "cpu", rec, markdown(rec))
    print(markdown(rec))


if __name__ == "__main__":
    main()
