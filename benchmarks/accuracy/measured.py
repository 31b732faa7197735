"""Step time predicted against step time measured, on real CPU devices.

    .venv/bin/python -m benchmarks.accuracy.measured    # both set-ups, all CI-sized models
    .venv/bin/python -m benchmarks.accuracy.measured --setup cluster --models gpt2

Two set-ups, both real devices of this machine (no simulated devices):

- ``single``: one process, one CPU device that XLA runs on every core;
- ``cluster``: two processes under `jax.distributed` on 127.0.0.1, one CPU device each,
  each computing on one core, talking over gloo: real devices with real communication.
  How a process gets its core is ``--placement``: ``pinned`` (the default, the record's)
  pins each process, every thread of it, to its own core (`taskset`); ``threads`` sizes
  XLA's thread pools to one thread (its NPROC setting) and leaves the processes to the
  OS. Pinned, gloo's threads wait behind XLA's on the one core, and a small collective
  lasts until the scheduler's next 4 ms tick about as often as not
  (`benchmarks/cluster/cluster_timeline.py`): no real cluster's links behave so. ``threads``
  writes `measured/cpu_threads.*`.

In each, before each model's candidates, the profile is calibrated there and then
(`jaxwap.calibrate`: per-device flop/s, bandwidth, kernel overhead, and in the cluster link
bandwidth and latency over gloo), and the planner plans with it (`hardware=None` planning
would use the same calibration). For every CI-sized model of `benchmarks/models/zoo.py` every
candidate layout of 1 and 2 devices (each mesh the search keeps with the planner's layout,
and plain data parallelism, ZeRO-1 and FSDP where the mesh has a data axis) is compiled by
`verify.compile_candidate`, the function `auto_shard` compiles through, and run on
synthetic data. A model's candidates are timed in interleaved rounds (all of them, then all
again, ``--rounds``), so the machine's drift falls on all of them alike; the median over
every timed step is kept, and how far the rounds' medians lie apart is recorded. Each is
set against the step time the planner predicted for it, twice: the analytic model's (what
the search ranks every candidate with) and the same model fed XLA's figures of that
compiled program (`mesh_prediction.with_compiled`: what verification ranks the compiled finalists
with).

Then plan quality against the measured oracle: the planner's default choice (`jaxwap.plan`
with its default verification, objectives "throughput" and "balanced") is looked up among
the measured candidates. Regret for "throughput" = its measured time over the fastest
measured time - 1; for "balanced" the score is Zeus's eta*E + (1-eta)*P_max*N*T with the
measured time and the power the profile models (labelled modelled: no power meter here).
Then the measured choice: `auto_shard(..., measure=True)` on the cluster (each process
passing its own slice of the batch) times its verified finalists and chooses on them; its
choice is scored the same way, against the measured candidates that use both devices (a
step running under two processes uses every device).

Writes `benchmarks/results/measured/cpu.json` and `cpu.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

MODULE = "benchmarks.accuracy.measured"   # this script, as `python -m` runs it
RESULTS = harness.results_dir("measured")
MODELS = ("alexnet", "vgg16", "resnet50", "gpt2")
OBJECTIVES = ("throughput", "balanced")
GOAL_MEDIAN, GOAL_WORST, GOAL_REGRET = 0.15, 0.30, 0.05
# how each process of the cluster gets its core: `launch_local`'s arguments
PLACEMENTS = {"threads": {"pin_cores": False, "threads": 1},
              "pinned": {"pin_cores": True},
              "shared": {"pin_cores": False}}


# ---------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    """One process of a set-up: calibrate, plan, compile and time every candidate."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if args.num_processes > 1:
        from jaxwap.runtime.distributed import start_distributed

        why = start_distributed(args.coordinator, args.num_processes, args.process_id,
                                timeout_s=60)
        if why is not None:
            raise SystemExit(f"process {args.process_id}: jax.distributed did not start: {why}")
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import jaxwap
    from benchmarks.models import zoo
    from benchmarks.models.layouts import VARIANTS, variant_candidate
    from jaxwap.calibration.calibrate import calibrate_full
    from jaxwap.cost.mesh_prediction import with_compiled
    from jaxwap.decide.verify import compile_candidate
    from jaxwap.hardware.calibration import Calibration
    from jaxwap.hardware.cluster import detect_cluster
    from jaxwap.planner import make_plan
    from jaxwap.search.solve import uses_model_axis

    pid, nproc = jax.process_index(), jax.process_count()
    devices = jax.devices()
    sync = (lambda name: multihost_utils.sync_global_devices(name)) if nproc > 1 \
        else (lambda name: None)
    log = (lambda *a: print(*a, flush=True)) if pid == 0 else (lambda *a: None)

    shared = Path(args.workdir)

    def calibrate_here(tag: str) -> tuple[Any, Any]:
        """Calibrate now, on every process (the link needs all of them); process 0's
        record is the one every process plans with, so plans agree."""
        cal = calibrate_full(devices, progress=False, quick=args.quick, use_cache=False,
                             directory=shared / f"cal{pid}-{tag}")
        if pid == 0:
            (shared / f"calibration-{tag}.json").write_text(json.dumps(cal.to_dict()))
        sync(f"calibrated-{tag}")
        cal = Calibration.from_dict(json.loads(
            (shared / f"calibration-{tag}.json").read_text()))
        cluster, _ = detect_cluster(devices, cal)
        # across processes the calibrated link is the one between them (`detect_cluster`)
        link = (f", link between processes {cal.spec.link_bandwidth / 1e9:.3f} GB/s "
                f"{cal.spec.link_latency_s * 1e6:.1f} us") if nproc > 1 else ""
        log(f"[{args.setup}] calibrated before {tag}: f32 "
            f"{cal.spec.peak_flops_f32 / 1e9:.1f} Gflop/s, "
            f"{cal.spec.memory_bandwidth / 1e9:.2f} GB/s, kernel "
            f"{cal.spec.kernel_overhead_s * 1e6:.2f} us{link}")
        return cal, cluster

    def global_array(host: Any, sharding: Any) -> Any:
        host = np.asarray(host)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    def prepare(w: Any, layout: Any, cand: Any, cluster: Any,
                batch: int) -> dict[str, Any]:
        """Compile as auto_shard would (donating the state) and place synthetic data; `run`
        is one step as a training loop runs it (the new state is the next step's). Also
        the prediction verification makes from the same compiled program (the model fed
        XLA's figures)."""
        figs, cs = compile_candidate(w.step, layout, cand, devices, cluster)
        compiled = with_compiled(cand.predicted, figs, cluster, batch, cand.d, cand.m, cand.r)
        data = w.synthetic(0)
        flat = jax.tree_util.tree_leaves(data)
        state = [global_array(x, s) for x, s in zip(flat, cs.in_shardings, strict=True)]

        return {"run": zoo.step_runner(cs, layout, state),
                "compiled_predicted_s": compiled.step_time_s}

    def time_interleaved(runs: list[Any]) -> list[dict[str, Any]]:
        """Time every candidate of a model in `args.rounds` interleaved rounds (candidate
        1, 2, ..., then 1, 2, ... again), so that the machine's drift (this VM's speed
        moves by tens of percent within minutes) falls on all of them alike and the
        comparison between them, the measured oracle, is fair. Step counts are decided by
        process 0 from a timed warm-up and shared, so every process of a mesh runs the same
        number of steps (each step's collectives need all of them). `runs[i]` is None on a
        process outside candidate i's mesh; process 0 is in every mesh."""
        est = []
        for i, run in enumerate(runs):
            sync(f"warm-{i}")
            if run is None:
                est.append(0.0)
                continue
            for _ in range(2):
                run()
            t0 = time.perf_counter()
            for _ in range(3):
                run()
            est.append((time.perf_counter() - t0) / 3)
        per_round = args.min_seconds / args.rounds
        counts = np.array([int(min(max(np.ceil(per_round / max(e, 1e-6)),
                                       np.ceil(args.steps / args.rounds)),
                                   np.ceil(500 / args.rounds))) for e in est], np.int32)
        if nproc > 1:
            counts = np.asarray(multihost_utils.broadcast_one_to_all(counts))
        times: list[list[list[float]]] = [[] for _ in runs]
        for rnd in range(args.rounds):
            for i, run in enumerate(runs):
                sync(f"round-{rnd}-{i}")
                if run is None:
                    continue
                these = []
                for _ in range(int(counts[i])):
                    t0 = time.perf_counter()
                    run()
                    these.append(time.perf_counter() - t0)
                times[i].append(these)
        out = []
        for rounds in times:
            if not rounds:
                out.append({})
                continue
            every = np.concatenate([np.asarray(r) for r in rounds])
            med = float(np.median(every))
            by_round = [float(np.median(r)) for r in rounds]
            out.append({"measured_s": med, "steps_timed": int(every.size),
                        "spread": float((np.percentile(every, 90) - np.percentile(every, 10))
                                        / med),
                        "round_medians_s": by_round,
                        "round_spread": (max(by_round) - min(by_round)) / med})
        return out

    def measured_choice(w: Any, objective: str, cluster: Any) -> Any:
        """The plan `auto_shard(measure=True)` runs: its verified finalists timed on the
        devices (every process passing its own slice of the batch, as a training loop
        under jax.distributed does), the choice made on the measurements."""
        *state, batch = w.synthetic(0)
        mine = jax.tree.map(lambda x: np.array_split(np.asarray(x), nproc)[pid], batch)
        step = jaxwap.auto_shard(w.step, w.params, hardware=cluster, objective=objective,
                                 measure=True, cache=False)
        jax.block_until_ready(step(*state, mine))
        return step.plan

    rows, quality, choice, calibrations = [], [], [], {}
    for name in args.models:
        # calibrated afresh just before this model's candidates, as a user calibrates
        # before planning: the profile is the machine's as it is while they are timed
        cal, cluster = calibrate_here(name)
        calibrations[name] = cal.to_dict()
        w = zoo.small(name)
        planned = make_plan(w.step, w.args, {}, params=w.params,
                            options=jaxwap.PlanOptions(hardware=cluster, verify=0, cache=False))
        batch = planned.graph.batch_size or 1
        cands: dict[tuple[Any, ...], dict[str, Any]] = {}
        for r in planned.search.results:
            if r.variant != "planner" or not uses_model_axis(r):
                continue
            for variant in VARIANTS:
                if variant != "planner" and r.d == 1:
                    continue
                cand = variant_candidate(planned.graph, r, variant, cluster)
                key = (cand.d, cand.m, tuple(s.name for s in cand.strategies))
                if key in cands:
                    cands[key]["variants"].append(variant)
                else:
                    cands[key] = {"variants": [variant], "cand": cand}
        prepared = []
        for i, (key, c) in enumerate(cands.items()):
            sync(f"{name}-compile-{i}")
            # a mesh of process 0's device(s) only: the rest wait
            prepared.append(prepare(w, planned.layout, c["cand"], cluster, batch)
                            if pid < key[0] * key[1] else None)
        timed = time_interleaved([p["run"] if p else None for p in prepared])
        measured: dict[tuple[Any, ...], dict[str, Any]] = {}
        for (key, c), prep, got in zip(cands.items(), prepared, timed, strict=True):
            if pid != 0:
                continue
            p = c["cand"].predicted
            row = {"setup": args.setup, "model": w.name, "mesh": f"{key[0]}x{key[1]}",
                   "variants": c["variants"], "strategies": sorted(set(key[2])),
                   "predicted_s": p.step_time_s, "compute_s": p.compute_time_s,
                   "comm_s": p.tp_comm_time_s + p.exposed_comm_time_s,
                   "compiled_predicted_s": prep["compiled_predicted_s"], **got}
            row["error"] = p.step_time_s / row["measured_s"] - 1
            row["compiled_error"] = row["compiled_predicted_s"] / row["measured_s"] - 1
            measured[key] = {**row, "prediction": p}
            rows.append(row)
            log(f"  {w.name:15s} {row['mesh']} {'/'.join(c['variants']):13s} measured "
                f"{row['measured_s'] * 1e3:8.2f} ms (rounds within "
                f"{100 * row['round_spread']:.0f}%)  predicted {p.step_time_s * 1e3:8.2f} ms"
                f"  ({100 * row['error']:+.0f}%), with XLA's figures "
                f"{row['compiled_predicted_s'] * 1e3:8.2f} ms "
                f"({100 * row['compiled_error']:+.0f}%)")
        del prepared
        sync(f"{name}-measured")
        for objective in OBJECTIVES:
            plan = jaxwap.plan(w.step, *w.args, params=w.params, hardware=cluster,
                               objective=objective, cache=False)
            if pid == 0:
                quality.append(_regret(w.name, objective, _chosen(plan), measured, cluster))
            if nproc > 1:
                got = measured_choice(w, objective, cluster)
                if pid == 0:
                    # under several processes auto_shard runs on every device: scored
                    # against the candidates that use them all
                    every = {k: v for k, v in measured.items() if k[0] * k[1] == len(devices)}
                    choice.append({**_regret(w.name, objective, _chosen(got), every, cluster),
                                   "finalists": _finalists(got)})
        sync(f"{name}-planned")
    if pid == 0:
        out = {"setup": args.setup, "processes": nproc, "devices": len(devices),
               "device_kind": devices[0].device_kind, "calibrations": calibrations,
               "rows": rows, "quality": quality, "measured_choice": choice}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


def _regret(model: str, objective: str, chosen: tuple[Any, ...],
            measured: dict[tuple[Any, ...], dict[str, Any]], cluster: Any) -> dict[str, Any]:
    """The planner's choice scored on measured time against the best measured candidate,
    by the objective's own ranking (energy = the profile's modelled power x measured time:
    no power meter on this CPU): over every timed step, and again within each interleaved
    round (candidates timed side by side), which says whether the regret stands out of the
    machine's drift."""
    import jaxwap
    from jaxwap.core.records import Measurement, judge

    keys = list(measured)

    def scored(seconds: list[float]) -> tuple[Any, tuple[Any, ...]]:
        judged = [judge(measured[k]["prediction"], measured=Measurement(
            t, measured[k]["prediction"].avg_power_w * t, "modeled",
            measured[k]["steps_timed"])) for k, t in zip(keys, seconds, strict=True)]
        ranking = jaxwap.Objective(objective).rank(
            judged, max_watts=cluster.device.max_watts,
            num_devices_available=cluster.num_devices)
        return ranking, keys[ranking.best]

    ranking, best = scored([measured[k]["measured_s"] for k in keys])
    row = {"model": model, "objective": objective,
           "chosen": f"{chosen[0]}x{chosen[1]} {_layout_name(chosen[2])}",
           "oracle": f"{best[0]}x{best[1]} {_layout_name(best[2])}",
           "energy_basis": "modelled power x measured time"}
    if chosen not in measured:
        row.update(regret=None, regret_by_round=[],
                   note="the chosen layout is not among the measured candidates")
        return row
    row["regret"] = ranking.scores[keys.index(chosen)] / ranking.scores[ranking.best] - 1
    by_round = []
    for rnd in range(min(len(measured[k]["round_medians_s"]) for k in keys)):
        r_rank, _ = scored([measured[k]["round_medians_s"][rnd] for k in keys])
        by_round.append(r_rank.scores[keys.index(chosen)] / r_rank.scores[r_rank.best] - 1)
    row["regret_by_round"] = by_round
    # the rounds compare candidates timed side by side; pooled medians mix in the drift
    # between rounds (a candidate with two fast and two slow rounds pools to the middle)
    row["regret_round_median"] = statistics.median(by_round) if by_round else None
    return row


def _chosen(plan: Any) -> tuple[Any, ...]:
    """A plan's candidate key: (data, model, every parameter's strategy)."""
    return (plan.mesh_shape["data"], plan.mesh_shape["model"],
            tuple(p.strategy for p in plan.params))


def _finalists(plan: Any) -> list[dict[str, Any]]:
    """The candidates `measure=` timed, with the step time each measured and predicted."""
    return [{"candidate": f"{c.label} " + _layout_name(
                 tuple(k for k, n in c.strategy_counts for _ in range(n))),
             "measured_s": c.measured.step_time_s,
             "steps": c.measured.steps, "chosen": c.chosen}
            for c in plan.candidates if c.measured is not None]


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
    from jaxwap.runtime.launch import describe, launch_local

    out = workdir / f"{setup}.json"
    n = 2 if setup == "cluster" else 1
    argv = harness.worker(MODULE, "--worker", "--setup", setup) + [
            "--models", ",".join(args.models), "--steps", str(args.steps),
            "--min-seconds", str(args.min_seconds), "--rounds", str(args.rounds),
            "--workdir", str(workdir),
            "--out", str(out), "--num-processes", str(n), "--coordinator", "{coordinator}",
            "--process-id", "{process_id}"] + (["--quick"] if args.quick else [])
    # the single device gets every core; the cluster's processes one core each
    place = PLACEMENTS[args.placement if setup == "cluster" else "shared"]
    results = launch_local(argv, n, timeout_s=3000, cwd=str(harness.ROOT), **place)
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
             f"with the profile calibrated in the same set-up just before each model. "
             f"Command: `{record['command']}`. A model's candidates are timed in "
             f"{record.get('rounds', 1)} interleaved rounds; 'rounds apart' is how far the "
             f"rounds' medians lie apart, over the median (the machine's drift).", ""]
    for key, what in (("summary", "the analytic model (what the search ranks with)"),
                      ("summary_compiled", "the model fed XLA's figures of the compiled "
                                           "candidate (what verification ranks with)")):
        s = record[key]
        lines += [f"Step-time error |predicted / measured - 1| of {what}: median "
                  f"{100 * s['median_abs_error']:.1f}%, worst "
                  f"{100 * s['worst_abs_error']:.1f}% ({s['worst_at']}), {s['n']} candidates "
                  f"(goal <= {100 * GOAL_MEDIAN:.0f}% / {100 * GOAL_WORST:.0f}%).", ""]
    lines += ["| set-up | model | mesh | layouts | measured ms | predicted ms | error | "
              "with XLA's figures ms | error | rounds apart |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['setup']} | {r['model']} | {r['mesh']} | {'/'.join(r['variants'])}"
                     f" | {1e3 * r['measured_s']:.2f} | {1e3 * r['predicted_s']:.2f} | "
                     f"{100 * r['error']:+.0f}% | {1e3 * r['compiled_predicted_s']:.2f} | "
                     f"{100 * r['compiled_error']:+.0f}% | {100 * r['round_spread']:.0f}% |")
    lines += ["", "Plan quality against the measured oracle (cluster set-up; balanced energy = "
              "modelled power x measured time):", "",
              "| model | objective | planner chose | measured best (pooled) | regret, "
              "median of the rounds | in each round | regret on pooled medians |",
              "|---|---|---|---|---|---|---|"]
    lines += _quality_rows(record["quality"])
    if record.get("measured_choice"):
        lines += ["", "The measured choice, `auto_shard(..., measure=True)` on the same cluster: "
                  "its verified finalists timed on the devices (a few steps each) and the "
                  "choice made on those measurements. Under two processes a running step "
                  "uses every device, so it is scored against the measured candidates of "
                  "2 devices:", "",
                  "| model | objective | measure=True chose | measured best of 2 devices | "
                  "regret, median of the rounds | in each round | regret on pooled medians |",
                  "|---|---|---|---|---|---|---|"]
        lines += _quality_rows(record["measured_choice"])
        lines += ["", "Finalists `measure=True` timed (ms per step, its own short windows):",
                  ""]
        for q in record["measured_choice"]:
            timed = ", ".join(f"{f['candidate']} {1e3 * f['measured_s']:.1f}"
                              + (" (chosen)" if f["chosen"] else "")
                              for f in q.get("finalists", []))
            lines.append(f"- {q['model']} {q['objective']}: {timed or 'none'}")
    return "\n".join(lines) + "\n"


def _quality_rows(quality: list[dict[str, Any]]) -> list[str]:
    lines = []
    for q in quality:
        reg = "not measured" if q["regret"] is None else f"{100 * q['regret']:.1f}%"
        mid = q.get("regret_round_median")
        rounds = ", ".join(f"{100 * x:.1f}%" for x in q.get("regret_by_round", []))
        lines.append(f"| {q['model']} | {q['objective']} | {q['chosen']} | {q['oracle']} | "
                     f"{'-' if mid is None else f'{100 * mid:.1f}%'} | {rounds or '-'} | "
                     f"{reg} |")
    return lines


def main(args: argparse.Namespace) -> None:
    setups = ["single", "cluster"] if args.setup == "all" else [args.setup]
    results = {}
    with tempfile.TemporaryDirectory(prefix="jaxwap-measured-") as tmp:
        for setup in setups:
            results[setup] = run_setup(setup, args, Path(tmp))
    rows = [r for res in results.values() for r in res["rows"]]
    quality = results["cluster"]["quality"] if "cluster" in results else []
    choice = results["cluster"].get("measured_choice", []) if "cluster" in results else []
    summary, compiled = summarize(rows), summarize(rows, "compiled_error")
    regrets = [q["regret_round_median"] for q in quality
               if q.get("regret_round_median") is not None]
    print(f"\nstep time: median error {100 * summary['median_abs_error']:.1f}%, worst "
          f"{100 * summary['worst_abs_error']:.1f}% ({summary['worst_at']}); goal <= "
          f"{100 * GOAL_MEDIAN:.0f}% / {100 * GOAL_WORST:.0f}%")
    print(f"with XLA's figures: median error {100 * compiled['median_abs_error']:.1f}%, worst "
          f"{100 * compiled['worst_abs_error']:.1f}% ({compiled['worst_at']})")
    if regrets:
        print(f"regret vs measured oracle (median of the rounds): worst "
              f"{100 * max(regrets):.1f}% (goal <= {100 * GOAL_REGRET:.0f}%)")
        for q in quality:
            if q.get("regret_by_round"):
                print(f"  {q['model']:15s} {q['objective']:10s} regret {100 * q['regret']:5.1f}%,"
                      f" in each round: "
                      + ", ".join(f"{100 * x:.1f}%" for x in q["regret_by_round"]))
    for q in choice:
        if q.get("regret_by_round"):
            print(f"  measure=True {q['model']:15s} {q['objective']:10s} chose {q['chosen']}, "
                  f"regret {100 * q['regret_round_median']:.1f}% (median of the rounds)")
    import platform

    record = {"command": harness.command(MODULE), "date_utc": harness.date_utc(),
              "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "basis": "measured = median wall time of a step on real CPU devices of this "
                       "machine; predicted = jaxwap's model with the profile calibrated in "
                       "the same set-up; energy modelled (no power meter)",
              "setups": {k: {kk: v[kk] for kk in ("processes", "devices", "device_kind",
                                                  "calibrations")}
                         for k, v in results.items()},
              "rounds": args.rounds, "placement": args.placement,
              "summary": summary, "summary_compiled": compiled, "rows": rows,
              "quality": quality, "measured_choice": choice}
    suffix = ("" if set(setups) == {"single", "cluster"} else f"_{args.setup}") \
        + ("" if args.placement == "pinned" else f"_{args.placement}")
    harness.write_record(RESULTS / f"cpu{suffix}", record, markdown(record))
    print(f"wrote {RESULTS / f'cpu{suffix}'}.json and .md")


if __name__ == "__main__":
    p = harness.parser(__doc__)
    p.add_argument("--setup", default="all", choices=["all", "single", "cluster"])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--min-seconds", type=float, default=2.0,
                   help="seconds of timed steps per candidate, over all rounds")
    p.add_argument("--rounds", type=int, default=4,
                   help="interleaved rounds over a model's candidates")
    p.add_argument("--quick", action="store_true", help="quick calibration sizes")
    p.add_argument("--placement", default="pinned", choices=sorted(PLACEMENTS),
                   help="how each cluster process gets its core: one XLA thread each "
                        "(threads), every thread pinned (pinned), or neither (shared)")
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
