"""Where a step's time goes on the two-process gloo cluster, collective by collective.

    .venv/bin/python -m benchmarks.cluster.cluster_timeline     # the rows of DEFAULT_RUNS
    .venv/bin/python -m benchmarks.cluster.cluster_timeline --runs alexnet:fsdp gpt2:zero1
    .venv/bin/python -m benchmarks.cluster.cluster_timeline --runs alexnet:planner@1x2  # a mesh
    .venv/bin/python -m benchmarks.cluster.cluster_timeline --placement threads  # one XLA thread

`measured.py` says how far the predicted step is from the measured one on the cluster (two
processes under `jax.distributed`, one CPU device each, each computing on one core,
collectives over gloo); this says which part is off. For each (model, layout) both
processes compile the candidate `measured.py` times (`verify.compile_candidate`, planned
with the profile that run calibrated, kept in `measured/cpu.json`), time it, and run a few
steps under `jax.profiler.trace`. XLA:CPU records every operation it runs with its start
and duration on a clock both processes share (one machine), so the two timelines line up:

- a collective ends at about the same moment in both processes; the process that entered
  it first waits for the other (`wait`), and the later one's duration is the collective's
  own time (`own`): what the model prices, set beside the model's price of that very
  collective (`collectives.collective_cost` of its HLO shape, the price XLA-fed verification
  uses);
- compute is the time some non-collective operation runs (the union over the process's
  threads).

Writes `benchmarks/results/cluster_timeline/cpu.json` and `.md`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.accuracy.measured import PLACEMENTS
from benchmarks.accuracy.op_profile import shared_out

MODULE = "benchmarks.cluster.cluster_timeline"   # this script, as `python -m` runs it
RESULTS = harness.results_dir("cluster_timeline")
DEFAULT_RUNS = ("alexnet:fsdp", "vgg16:fsdp", "resnet50:zero1", "gpt2:fsdp",
                "gpt2:data-parallel")
COLLECTIVE = re.compile(r"^(all-reduce|all-gather|all-to-all|reduce-scatter|"
                        r"collective-permute)(-start|-done)?(\.\d+)?$")


# ---------------------------------------------------------------------------- worker
def predicted_kinds(graph: Any, cluster: Any, cand: Any) -> dict[str, float]:
    """The candidate's predicted compute on a device by `op_profile`'s kinds of operation:
    each op's time (`op_time.op_parts`) at the share the candidate's layout gives it, as
    `mesh_cost.mesh_costs` splits it (a batched op over the data axis, and the model axis where
    a tensor-parallel layout splits it; a parameter's own op over its shard, its optimizer
    ops over its optimizer state's), the layout changes and the fresh scratch memory the
    model keeps apart, and what the model adds beyond those ('other terms': convolutions
    priced again at a split kernel's rate, the power stretch)."""
    import numpy as np

    from benchmarks.accuracy.op_profile import predicted_by_kind
    from jaxwap.analysis.graph import GRAD, OPT
    from jaxwap.cost.mesh_cost import op_model_split
    from jaxwap.cost.op_time import op_parts, relayout_times

    d, m, strats = cand.d, cand.m, cand.strategies
    shard = np.array([s.shard(d // cand.r, m) for s in strats] + [1], float)
    state = np.array([s.state_shard(d // cand.r, m) for s in strats] + [1], float)
    optimizer = np.isin(graph.op_class, (GRAD, OPT))
    split = np.where(graph.batched, d * op_model_split(graph, strats, m),
                     np.where(optimizer, state[graph.owner], shard[graph.owner]))
    speed = cluster.speedup_when_using(d * m)
    times = op_parts(graph, cluster, split, speed, data=float(d))[0] \
        - relayout_times(graph, cluster, split, speed)
    out = predicted_by_kind(graph, times)
    pred = cand.predicted
    out["layout (copy, reverse, transpose)"] += pred.layout_change_time_s
    out["fresh memory"] = pred.fresh_memory_time_s
    out["other terms"] = pred.compute_time_s - sum(out.values())
    return out


def worker(args: argparse.Namespace) -> None:
    """One process: plan with the recorded calibration, compile, time, trace."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jaxwap.runtime.distributed import start_distributed
    from jaxwap.runtime.launch import cluster_from_env

    coordinator, nproc, pid = cluster_from_env()
    why = start_distributed(coordinator, nproc, pid, timeout_s=60)
    if why is not None:
        raise SystemExit(f"process {pid}: jax.distributed did not start: {why}")

    import jax
    import numpy as np
    from jax.profiler import ProfileData

    import jaxwap
    from benchmarks.accuracy.op_profile import fused_bodies, op_events, xla_kind
    from benchmarks.models import zoo
    from benchmarks.models.layouts import mesh_candidate
    from jaxwap.cost.collectives import collective_cost
    from jaxwap.cost.mesh_prediction import with_compiled
    from jaxwap.decide.verify import compile_candidate
    from jaxwap.decide.xla_figures import parse_collectives
    from jaxwap.hardware.calibration import Calibration
    from jaxwap.hardware.cluster import detect_cluster
    from jaxwap.planner import make_plan

    run, _, mesh = args.run.partition("@")   # model:layout[@DxM], 2x1 by default
    model, variant = run.split(":")
    d, m = map(int, (mesh or "2x1").split("x"))
    record = json.loads(Path(args.record).read_text())
    cal = Calibration.from_dict(record["setups"]["cluster"]["calibrations"][model])
    devices = jax.devices()
    cluster, _ = detect_cluster(devices, cal)
    w = zoo.small(model)
    planned = make_plan(w.step, w.args, {}, params=w.params, options=jaxwap.PlanOptions(
        hardware=cluster, verify=0, cache=False))
    cand = mesh_candidate(planned, d, m, variant, cluster)
    pred = cand.predicted
    predicted = {"step_s": pred.step_time_s, "compute_s": pred.compute_time_s,
                 "comm_s": pred.exposed_comm_time_s + pred.tp_comm_time_s,
                 "by_kind_s": predicted_kinds(planned.graph, cluster, cand)}
    if pid >= d * m:   # outside the candidate's mesh (a one-device candidate): idle
        Path(args.out).joinpath(f"p{pid}.json").write_text(json.dumps(
            {"process": pid, "idle": True, "predicted": predicted}))
        return
    figs, cs = compile_candidate(w.step, planned.layout, cand, devices, cluster)
    bodies = fused_bodies(cs.compiled.as_text())
    xla_fed = with_compiled(cand.predicted, figs, cluster, planned.graph.batch_size or 1,
                            cand.d, cand.m, cand.r)
    # each collective of the program by name, priced as XLA-fed verification prices it
    prices = {}
    for line in cs.compiled.as_text().splitlines():
        name = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=", line)
        found = parse_collectives(line, (d, m)) if name else []
        if found:
            c = found[0]
            prices[name.group(1)] = {"kind": c.kind, "bytes": c.bytes, "buffers": c.buffers,
                                     "priced_s": collective_cost(c, cluster, d, m)[0]}
    data = w.synthetic(0)
    hosts = [np.asarray(x) for x in jax.tree_util.tree_leaves(data)]
    state = [jax.make_array_from_callback(x.shape, s, lambda i, x=x: x[i])
             for x, s in zip(hosts, cs.in_shardings, strict=True)]

    step = zoo.step_runner(cs, planned.layout, state)

    def run() -> None:   # its own name: the trace's steps are this function's calls
        step()

    walls = zoo.wall_times(run, args.steps)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(args.traced):
                run()
        files = sorted(Path(d).rglob("*.xplane.pb"))
        if not files:
            raise RuntimeError(f"jax.profiler.trace wrote no xplane file under {d}")
        profile = ProfileData.from_file(str(files[0]))
    ops, host = op_events(profile)
    events = [(s, d, name, xla_kind(name, bodies)) for s, d, name in ops]
    # the host's calls: a step is a call of run()
    steps = [(s, s + d) for s, d, name in host
             if re.fullmatch(r"\$cluster_timeline\.py:\d+ run", name)]
    predicted.update(xla_fed_step_s=xla_fed.step_time_s,
                     xla_fed_comm_s=xla_fed.exposed_comm_time_s + xla_fed.tp_comm_time_s)
    out = {"process": pid, "events": events, "steps": sorted(steps),
           "walls_s": walls, "prices": prices, "predicted": predicted}
    Path(args.out).joinpath(f"p{pid}.json").write_text(json.dumps(out))


# ---------------------------------------------------------------------------- analysis
def union_ns(spans: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def analyse(procs: list[dict[str, Any]]) -> dict[str, Any]:
    """The last traced step of the processes that ran it, lined up: per collective its own
    time (the shorter of the two durations: the later process's) and the wait of the one
    that entered first; per process its compute (union of its other operations), each
    moment of its step shared out by kind of what ran (`op_profile.shared_out`: the
    collectives one kind, the rest `op_profile.xla_kind`'s), and its idle time."""
    predicted = procs[0]["predicted"]
    procs = [p for p in procs if not p.get("idle")]
    k = min(len(p["steps"]) for p in procs) - 1
    per: list[dict[str, list[tuple[int, int]]]] = []
    compute, kinds, idle = [], [], []
    for p in procs:
        a, b = p["steps"][k]
        colls: dict[str, list[tuple[int, int]]] = {}
        other, labelled = [], []
        for s, d, name, kind in p["events"]:
            if a <= s < b:
                if COLLECTIVE.match(name):
                    colls.setdefault(name, []).append((s, d))
                    labelled.append((s, min(s + d, b), "collective"))
                else:
                    other.append((s, s + d))
                    labelled.append((s, min(s + d, b), kind))
        per.append(colls)
        compute.append(union_ns(other) * 1e-9)
        kinds.append(shared_out(labelled))
        # the step's time in which no operation or collective ran: before the first, after
        # the last, and between them
        busy = union_ns([(s, e) for s, e, _ in labelled])
        head = min((s for s, _, _ in labelled), default=b) - a
        tail = b - max((e for _, e, _ in labelled), default=b)
        idle.append((head * 1e-9, (b - a - busy - head - tail) * 1e-9, tail * 1e-9))
    rows = []
    for name in sorted(set.intersection(*(set(c) for c in per)), key=lambda n: per[0][n][0][0]):
        runs = list(zip(*(c[name] for c in per), strict=False))   # one per loop trip
        own = sum(min(x[1] for x in run) for run in runs) * 1e-9
        waits = [sum(run[i][1] for run in runs) * 1e-9 - own for i in range(len(per))]
        price = procs[0]["prices"].get(re.sub(r"-(start|done)$", "", name), {})
        rows.append({"name": name, "times": len(runs), "own_s": own, "wait_s": waits,
                     "kind": price.get("kind"), "bytes": price.get("bytes"),
                     "buffers": price.get("buffers"),
                     "priced_s": price.get("priced_s", 0.0) * len(runs)})
    walls = [statistics.median(p["walls_s"]) for p in procs]
    return {"step_s": max(walls), "compute_s": compute, "by_kind_s": kinds, "idle_s": idle,
            "collectives": rows, "own_s": sum(r["own_s"] for r in rows),
            "wait_s": [sum(r["wait_s"][i] for r in rows) for i in range(len(per))],
            "priced_s": sum(r["priced_s"] for r in rows), "predicted": predicted}


def measure(run: str, args: argparse.Namespace) -> dict[str, Any]:
    from jaxwap.runtime.launch import describe, launch_local

    with tempfile.TemporaryDirectory() as out:
        res = launch_local(harness.worker(MODULE, "--worker",
                                          "--run", run, "--out", out, "--record", args.record,
                                          "--steps", str(args.steps),
                                          "--traced", str(args.traced)),
                           2, timeout_s=900, cwd=str(harness.ROOT),
                           **PLACEMENTS[args.placement])
        if not all(r.ok for r in res):
            raise SystemExit(f"{run}: the cluster failed:\n{describe(res)}")
        procs = [json.loads(Path(out, f"p{i}.json").read_text()) for i in range(2)]
        if args.keep:   # each process's raw events, for a closer look
            keep = Path(args.keep, run.replace(":", "_").replace("@", "_"))
            keep.mkdir(parents=True, exist_ok=True)
            for i in range(2):
                Path(out, f"p{i}.json").replace(keep / f"p{i}.json")
    return {"run": run, **analyse(procs)}


PLACED = {"threads": "each computing on one XLA thread (NPROC=1), placed by the OS",
          "pinned": "each pinned to its own core, every thread of it",
          "shared": "**not pinned**: both may run on either core, on two XLA threads each"}


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def per_process(xs: list[float]) -> str:
    return " / ".join(ms(x) for x in xs)


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"Measured on this machine's CPU ({record['cpu']}), {record['date']}: the cluster of "
        "`measured.py` (2 processes, gloo; "
        + PLACED[record["placement"]]
        + "), each candidate planned with the "
        "profile `measured/cpu.json` recorded for its model, its last of "
        f"{record['traced']} traced steps read from XLA's profiler in both processes. "
        f"Command: `python -m benchmarks.cluster.cluster_timeline {record['argv']}`.", "",
        "'own' is a collective's time in the process that entered it last; 'waits' is what "
        "the process that entered first waited on top (p0 / p1); compute is the time some "
        "other operation ran (p0 / p1). Predicted figures are the model's (analytic) and "
        "the model's price of XLA's collectives one by one (XLA-fed, as verification "
        "prices them).", "",
        "| model:layout | step measured | predicted (XLA-fed) | compute measured p0 / p1 "
        "| predicted | collectives | own | waits p0 / p1 | priced one by one "
        "| predicted comm |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["runs"]:
        p = r["predicted"]
        lines.append(
            f"| {r['run']} | {ms(r['step_s'])} | {ms(p['step_s'])} ({ms(p['xla_fed_step_s'])}) "
            f"| {per_process(r['compute_s'])} | {ms(p['compute_s'])} "
            f"| {sum(c['times'] for c in r['collectives'])} | {ms(r['own_s'])} "
            f"| {per_process(r['wait_s'])} | {ms(r['priced_s'])} "
            f"| {ms(p['comm_s'])} |")
    lines += ["", "Compute by kind of operation (ms a step on a device): XLA's operations' "
              "durations summed by `op_profile.py`'s kinds in each process that ran the step, "
              "beside the model's per-op times at the candidate's shares summed by the same "
              "kinds ('fresh memory': scratch the model prices apart, which XLA's profile "
              "counts inside the ops that write it; 'other terms': the rest of the model's "
              "compute, convolutions priced again at a split kernel's rate and the power "
              "stretch).", "",
              "| model:layout | kind | measured p0 / p1 | predicted |", "|---|---|---|---|"]
    for r in record["runs"]:
        pk = r["predicted"].get("by_kind_s", {})
        for kind in dict.fromkeys([*pk, *(k for m in r.get("by_kind_s", []) for k in m)]):
            got = [m.get(kind, 0.0) for m in r.get("by_kind_s", [])]
            if any(got) or abs(pk.get(kind, 0.0)) > 5e-5:
                lines.append(f"| {r['run']} | {kind} | {per_process(got) if any(got) else '-'}"
                             f" | {ms(pk[kind]) if kind in pk else '-'} |")
    for r in record["runs"]:
        lines += ["", f"**{r['run']}**, each collective (ms; bytes of its result on a "
                      "device):", "",
                  "| collective | kind | bytes | buffers | runs | own | wait p0 / p1 | priced |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in r["collectives"]:
            lines.append(f"| {c['name']} | {c['kind']} | {c['bytes']} | {c['buffers']} "
                         f"| {c['times']} | {ms(c['own_s'])} | {per_process(c['wait_s'])} "
                         f"| {ms(c['priced_s'])} |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> None:

    runs = []
    for run in args.runs:
        r = measure(run, args)
        print(f"{run:22s} step {ms(r['step_s'])} ms (predicted {ms(r['predicted']['step_s'])}),"
              f" compute {per_process(r['compute_s'])}, "
              f"{len(r['collectives'])} collectives own {ms(r['own_s'])} waits "
              f"{per_process(r['wait_s'])}, priced {ms(r['priced_s'])}", flush=True)
        print("    idle before / between / after the ops: " + ", ".join(
            " / ".join(ms(x) for x in i) for i in r["idle_s"]), flush=True)
        for kind, t in r["predicted"]["by_kind_s"].items():
            got = [m.get(kind, 0.0) for m in r["by_kind_s"]]
            print(f"    {kind:36s} {per_process(got):>14s} {ms(t):>8s}", flush=True)
        runs.append(r)
    record = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
              "placement": args.placement,
              "cpu": harness.cpu_line(),
              "argv": " ".join(sys.argv[1:]), "traced": args.traced, "runs": runs}
    stem = args.stem or "cpu" + ("" if args.placement == "pinned" else f"_{args.placement}")
    harness.write_record(RESULTS / stem, record, markdown(record), newline=False)
    print(f"wrote {RESULTS / stem}.md")


if __name__ == "__main__":
    ap = harness.parser(__doc__)
    ap.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS),
                    help="model:layout pairs (layouts: planner, data-parallel, zero1, fsdp)")
    ap.add_argument("--record", default=str(harness.results_dir("measured") / "cpu.json"),
                    help="the measured.py record whose cluster calibrations to plan with")
    ap.add_argument("--steps", type=int, default=8, help="steps timed (wall) per process")
    ap.add_argument("--traced", type=int, default=3, help="steps run under the profiler")
    ap.add_argument("--placement", default="pinned", choices=sorted(PLACEMENTS),
                    help="how each process gets its core, as in measured.py (a placement "
                         "other than pinned writes cluster_timeline/cpu_<placement>.*)")
    ap.add_argument("--stem", help="the record's name in results/cluster_timeline/ (default "
                    "cpu, cpu_<placement> for another placement)")
    ap.add_argument("--keep", help="a folder to keep each process's raw events in")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    worker(a) if a.worker else main(a)
