"""Step time predicted against step time measured, on real CPU devices.

    .venv/bin/python benchmarks/measured.py                 # both set-ups, all CI-sized models
    .venv/bin/python benchmarks/measured.py --setup cluster --models gpt2

Two set-ups, both real devices of this machine (no simulated devices):

- ``single``: one process, one CPU device that XLA runs on every core;
- ``cluster``: two processes under `jax.distributed` on 127.0.0.1, one CPU device each,
  each pinned to its own core, talking over gloo: real devices with real communication.

In each, the profile is calibrated there and then (`jaxwap.calibrate`: per-device flop/s,
bandwidth, kernel overhead, and in the cluster link bandwidth and latency over gloo), and
the planner plans with it (`hardware=None` planning would use the same calibration). For
every CI-sized model of `benchmarks/zoo.py` every candidate layout of 1 and 2 devices
(each mesh the search keeps with the planner's layout, and plain data parallelism, ZeRO-1
and FSDP where the mesh has a data axis) is compiled by `verify.compile_candidate`, the
function `auto_shard` compiles through, run on synthetic data, and timed (median of the
steps after a warm-up). Each is set against the step time the planner predicted for it,
twice: the analytic model's (what the search ranks every candidate with) and the same
model fed XLA's figures of that compiled program (`cost.with_compiled`: what verification
ranks the compiled finalists with).

Then plan quality against the measured oracle: the planner's default choice (`jaxwap.plan`
with its default verification, objectives "throughput" and "balanced") is looked up among
the measured candidates. Regret for "throughput" = its measured time over the fastest
measured time - 1; for "balanced" the score is Zeus's eta*E + (1-eta)*P_max*N*T with the
measured time and the power the profile models (labelled modelled: no power meter here).

Writes `benchmarks/results/measured_cpu.json` and `measured_cpu.md`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODELS = ("alexnet", "vgg16", "resnet50", "gpt2")
OBJECTIVES = ("throughput", "balanced")
GOAL_MEDIAN, GOAL_WORST, GOAL_REGRET = 0.15, 0.30, 0.05


# ---------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    """One process of a set-up: calibrate, plan, compile and time every candidate."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if args.num_processes > 1:
        from jaxwap.launch import start_distributed

        why = start_distributed(args.coordinator, args.num_processes, args.process_id,
                                timeout_s=60)
        if why is not None:
            raise SystemExit(f"process {args.process_id}: jax.distributed did not start: {why}")
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import zoo
    from layouts import VARIANTS, variant_candidate

    import jaxwap
    from jaxwap.calibrate import Calibration, calibrate_full
    from jaxwap.cost import with_compiled
    from jaxwap.hardware import detect_cluster
    from jaxwap.planner import make_plan
    from jaxwap.solve import uses_model_axis
    from jaxwap.verify import compile_candidate

    pid, nproc = jax.process_index(), jax.process_count()
    devices = jax.devices()
    sync = (lambda name: multihost_utils.sync_global_devices(name)) if nproc > 1 \
        else (lambda name: None)
    log = (lambda *a: print(*a, flush=True)) if pid == 0 else (lambda *a: None)

    # one calibration for the whole set-up: every process measures (the link needs all of
    # them), process 0's record is the one every process plans with, so plans agree
    shared = Path(args.workdir)
    cal = calibrate_full(devices, progress=False, quick=args.quick, use_cache=False,
                         directory=shared / f"cal{pid}")
    if pid == 0:
        (shared / "calibration.json").write_text(json.dumps(cal.to_dict()))
    sync("calibrated")
    cal = Calibration.from_dict(json.loads((shared / "calibration.json").read_text()))
    cluster, _ = detect_cluster(devices, cal)
    # across processes the calibrated link is the one between them (`detect_cluster`)
    link = (f", link between processes {cal.spec.link_bandwidth / 1e9:.3f} GB/s "
            f"{cal.spec.link_latency_s * 1e6:.1f} us") if nproc > 1 else ""
    log(f"[{args.setup}] calibrated {cal.spec.name}: f32 {cal.spec.peak_flops_f32 / 1e9:.1f} "
        f"Gflop/s, {cal.spec.memory_bandwidth / 1e9:.2f} GB/s, kernel "
        f"{cal.spec.kernel_overhead_s * 1e6:.2f} us{link}")

    def global_array(host: Any, sharding: Any) -> Any:
        host = np.asarray(host)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    def time_candidate(w: Any, layout: Any, cand: Any, batch: int) -> dict[str, Any]:
        """Compile as auto_shard would (donating the state), run on synthetic data as a
        training loop does (the new state is the next step's), and time; every process
        runs it, process 0's clock counts. Also the prediction verification makes from
        the same compiled program (the model fed XLA's figures)."""
        figs, cs = compile_candidate(w.step, layout, cand, devices, cluster)
        compiled = with_compiled(cand.predicted, figs, cluster, batch, cand.d, cand.m, cand.r)
        data = w.synthetic(0)
        flat = jax.tree_util.tree_leaves(data)
        state = [global_array(x, s) for x, s in zip(flat, cs.in_shardings, strict=True)]
        n_batch = len(jax.tree_util.tree_leaves(data[-1]))   # the batch comes last

        def run() -> None:
            # every zoo step returns (*new state, metrics) for (*state, batch)
            out = jax.block_until_ready(cs.compiled(*state))
            new = jax.tree_util.tree_leaves(
                jax.tree_util.tree_unflatten(layout.out_treedef, out)[:-1])
            state[: len(state) - n_batch] = new

        for _ in range(2):
            run()
        times: list[float] = []
        t_end = time.perf_counter() + args.min_seconds
        while len(times) < args.steps or (time.perf_counter() < t_end and len(times) < 500):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return {"compiled_predicted_s": compiled.step_time_s,
                "measured_s": float(np.median(times)), "steps_timed": len(times),
                "spread": float((np.percentile(times, 90) - np.percentile(times, 10))
                                / np.median(times))}

    rows, quality = [], []
    for name in args.models:
        w = zoo.small(name)
        planned = make_plan(w.step, w.args, {}, params=w.params,
                            options=jaxwap.PlanOptions(hardware=cluster, verify=0, cache=False))
        seen: dict[tuple[Any, ...], dict[str, Any]] = {}
        for r in planned.search.results:
            if r.variant != "planner" or not uses_model_axis(r):
                continue
            for variant in VARIANTS:
                if variant != "planner" and r.d == 1:
                    continue
                cand = variant_candidate(planned.graph, r, variant, cluster)
                key = (cand.d, cand.m, tuple(s.name for s in cand.strategies))
                if key in seen:
                    seen[key]["variants"].append(variant)
                    continue
                n = cand.d * cand.m
                sync(f"{name}-{key}")
                if pid >= n:   # a mesh of process 0's device(s) only: the rest wait
                    seen[key] = {"variants": [variant]}
                    continue
                got = time_candidate(w, planned.layout, cand, planned.graph.batch_size or 1)
                p = cand.predicted
                row = {"setup": args.setup, "model": w.name, "mesh": f"{cand.d}x{cand.m}",
                       "variants": [variant], "strategies": sorted(set(key[2])),
                       "predicted_s": p.step_time_s, "compute_s": p.compute_time_s,
                       "comm_s": p.tp_comm_time_s + p.exposed_comm_time_s, **got}
                row["error"] = p.step_time_s / row["measured_s"] - 1
                row["compiled_error"] = row["compiled_predicted_s"] / row["measured_s"] - 1
                row["prediction"] = p
                seen[key] = row
                log(f"  {w.name:15s} {row['mesh']} {variant:13s} measured "
                    f"{row['measured_s'] * 1e3:8.2f} ms  predicted {p.step_time_s * 1e3:8.2f} ms"
                    f"  ({100 * row['error']:+.0f}%), with XLA's figures "
                    f"{row['compiled_predicted_s'] * 1e3:8.2f} ms "
                    f"({100 * row['compiled_error']:+.0f}%)")
        measured = {k: v for k, v in seen.items() if "measured_s" in v}
        rows += [{k: v for k, v in r.items() if k != "prediction"} for r in measured.values()]
        sync(f"{name}-measured")
        for objective in OBJECTIVES:
            plan = jaxwap.plan(w.step, *w.args, params=w.params, hardware=cluster,
                               objective=objective, cache=False)
            chosen = (plan.mesh_shape["data"], plan.mesh_shape["model"],
                      tuple(p.strategy for p in plan.params))
            quality.append(_regret(w.name, objective, chosen, measured, cluster))
        sync(f"{name}-planned")
    if pid == 0:
        out = {"setup": args.setup, "processes": nproc, "devices": len(devices),
               "device_kind": devices[0].device_kind, "calibration": cal.to_dict(),
               "rows": rows, "quality": quality}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


def _regret(model: str, objective: str, chosen: tuple[Any, ...],
            measured: dict[tuple[Any, ...], dict[str, Any]], cluster: Any) -> dict[str, Any]:
    """The planner's choice scored on measured time against the best measured candidate,
    by the objective's own ranking (energy = the profile's modelled power x measured time:
    no power meter on this CPU)."""
    import jaxwap
    from jaxwap.records import Measurement, judge

    keys = list(measured)
    judged = [judge(measured[k]["prediction"], measured=Measurement(
        measured[k]["measured_s"], measured[k]["prediction"].avg_power_w
        * measured[k]["measured_s"], "modeled", measured[k]["steps_timed"])) for k in keys]
    ranking = jaxwap.Objective(objective).rank(judged, max_watts=cluster.device.max_watts,
                                               num_devices_available=cluster.num_devices)
    best = keys[ranking.best]
    row = {"model": model, "objective": objective,
           "chosen": f"{chosen[0]}x{chosen[1]} {_layout_name(chosen[2])}",
           "oracle": f"{best[0]}x{best[1]} {_layout_name(best[2])}",
           "energy_basis": "modelled power x measured time"}
    if chosen in measured:
        row["regret"] = ranking.scores[keys.index(chosen)] / ranking.scores[ranking.best] - 1
    else:
        row["regret"] = None
        row["note"] = "the chosen layout is not among the measured candidates"
    return row


def _layout_name(strategies: tuple[str, ...]) -> str:
    """The layout's strategy kinds, most common first."""
    counts: dict[str, int] = {}
    for name in strategies:
        counts[name] = counts.get(name, 0) + 1
    return "/".join(sorted(counts, key=lambda k: (-counts[k], k)))


# ---------------------------------------------------------------------------- orchestrator
def run_setup(setup: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Run one set-up's workers (a subprocess, or a launched cluster) and read back what
    process 0 wrote."""
    from jaxwap.launch import describe, launch_local

    out = workdir / f"{setup}.json"
    n = 2 if setup == "cluster" else 1
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--setup", setup,
            "--models", ",".join(args.models), "--steps", str(args.steps),
            "--min-seconds", str(args.min_seconds), "--workdir", str(workdir),
            "--out", str(out), "--num-processes", str(n), "--coordinator", "{coordinator}",
            "--process-id", "{process_id}"] + (["--quick"] if args.quick else [])
    # the single device gets every core; the cluster's processes one core each
    results = launch_local(argv, n, pin_cores=setup == "cluster", timeout_s=3000,
                           cwd=str(ROOT))
    for r in results:
        print(r.tail(6000) if r.process_id == 0 else "", end="")
    if not all(r.ok for r in results):
        raise SystemExit(f"{setup} set-up failed:\n{describe(results)}")
    return json.loads(out.read_text())


def summarize(rows: list[dict[str, Any]], key: str = "error") -> dict[str, Any]:
    """Median and worst |error| of the `key` predictions (the analytic model's, or
    with XLA's figures of the compiled candidate)."""
    errs = [abs(r[key]) for r in rows]
    worst = max(rows, key=lambda r: abs(r[key]))
    return {"n": len(rows), "median_abs_error": statistics.median(errs),
            "worst_abs_error": max(errs),
            "worst_at": f"{worst['setup']} {worst['model']} {worst['mesh']} "
                        f"{'/'.join(worst['variants'])}"}


def markdown(record: dict[str, Any]) -> str:
    lines = [f"Measured on this machine's CPU ({record['cpu']}); predicted by jaxwap's model "
             f"with the profile calibrated in the same set-up. Command: `{record['command']}`.",
             ""]
    for key, what in (("summary", "the analytic model (what the search ranks with)"),
                      ("summary_compiled", "the model fed XLA's figures of the compiled "
                                           "candidate (what verification ranks with)")):
        s = record[key]
        lines += [f"Step-time error |predicted / measured - 1| of {what}: median "
                  f"{100 * s['median_abs_error']:.1f}%, worst "
                  f"{100 * s['worst_abs_error']:.1f}% ({s['worst_at']}), {s['n']} candidates "
                  f"(goal <= {100 * GOAL_MEDIAN:.0f}% / {100 * GOAL_WORST:.0f}%).", ""]
    lines += ["| set-up | model | mesh | layouts | measured ms | predicted ms | error | "
              "with XLA's figures ms | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['setup']} | {r['model']} | {r['mesh']} | {'/'.join(r['variants'])}"
                     f" | {1e3 * r['measured_s']:.2f} | {1e3 * r['predicted_s']:.2f} | "
                     f"{100 * r['error']:+.0f}% | {1e3 * r['compiled_predicted_s']:.2f} | "
                     f"{100 * r['compiled_error']:+.0f}% |")
    lines += ["", "Plan quality against the measured oracle (cluster set-up; balanced energy = "
              "modelled power x measured time):", "",
              "| model | objective | planner chose | measured best | regret |",
              "|---|---|---|---|---|"]
    for q in record["quality"]:
        reg = "not measured" if q["regret"] is None else f"{100 * q['regret']:.1f}%"
        lines.append(f"| {q['model']} | {q['objective']} | {q['chosen']} | {q['oracle']} | "
                     f"{reg} |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> None:
    setups = ["single", "cluster"] if args.setup == "all" else [args.setup]
    results = {}
    with tempfile.TemporaryDirectory(prefix="jaxwap-measured-") as tmp:
        for setup in setups:
            results[setup] = run_setup(setup, args, Path(tmp))
    rows = [r for res in results.values() for r in res["rows"]]
    quality = results["cluster"]["quality"] if "cluster" in results else []
    summary, compiled = summarize(rows), summarize(rows, "compiled_error")
    regrets = [q["regret"] for q in quality if q["regret"] is not None]
    print(f"\nstep time: median error {100 * summary['median_abs_error']:.1f}%, worst "
          f"{100 * summary['worst_abs_error']:.1f}% ({summary['worst_at']}); goal <= "
          f"{100 * GOAL_MEDIAN:.0f}% / {100 * GOAL_WORST:.0f}%")
    print(f"with XLA's figures: median error {100 * compiled['median_abs_error']:.1f}%, worst "
          f"{100 * compiled['worst_abs_error']:.1f}% ({compiled['worst_at']})")
    if regrets:
        print(f"regret vs measured oracle: worst {100 * max(regrets):.1f}% (goal <= "
              f"{100 * GOAL_REGRET:.0f}%)")
    import platform

    record = {"command": "python benchmarks/measured.py " + " ".join(sys.argv[1:]),
              "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "basis": "measured = median wall time of a step on real CPU devices of this "
                       "machine; predicted = jaxwap's model with the profile calibrated in "
                       "the same set-up; energy modelled (no power meter)",
              "setups": {k: {kk: v[kk] for kk in ("processes", "devices", "device_kind",
                                                  "calibration")}
                         for k, v in results.items()},
              "summary": summary, "summary_compiled": compiled, "rows": rows,
              "quality": quality}
    suffix = "" if set(setups) == {"single", "cluster"} else f"_{args.setup}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"measured_cpu{suffix}.json").write_text(json.dumps(record, indent=1) + "\n")
    (RESULTS / f"measured_cpu{suffix}.md").write_text(markdown(record))
    print(f"wrote benchmarks/results/measured_cpu{suffix}.json and .md")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", default="all", choices=["all", "single", "cluster"])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--min-seconds", type=float, default=2.0)
    p.add_argument("--quick", action="store_true", help="quick calibration sizes")
    # worker arguments (set by the orchestrator)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    p.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    worker(a) if a.worker else main(a)
