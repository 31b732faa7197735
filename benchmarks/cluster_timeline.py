"""Where a step's time goes on the two-process gloo cluster, collective by collective.

    .venv/bin/python benchmarks/cluster_timeline.py                  # the rows of DEFAULT_RUNS
    .venv/bin/python benchmarks/cluster_timeline.py --runs alexnet:fsdp gpt2:zero1
    .venv/bin/python benchmarks/cluster_timeline.py --runs alexnet:planner@1x2  # a mesh
    .venv/bin/python benchmarks/cluster_timeline.py --unpinned      # processes not pinned

`measured.py` says how far the predicted step is from the measured one on the cluster (two
processes under `jax.distributed`, one CPU device each, each pinned to its own core,
collectives over gloo); this says which part is off. For each (model, layout) both
processes compile the candidate `measured.py` times (`verify.compile_candidate`, planned
with the profile that run calibrated, kept in `measured_cpu.json`), time it, and run a few
steps under `jax.profiler.trace`. XLA:CPU records every operation it runs with its start
and duration on a clock both processes share (one machine), so the two timelines line up:

- a collective ends at about the same moment in both processes; the process that entered
  it first waits for the other (`wait`), and the later one's duration is the collective's
  own time (`own`): what the model prices, set beside the model's price of that very
  collective (`comm.collective_cost` of its HLO shape, the price XLA-fed verification
  uses);
- compute is the time some non-collective operation runs (the union over the process's
  threads).

Writes `benchmarks/results/cluster_timeline_cpu.json` and `.md`.
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

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_RUNS = ("alexnet:fsdp", "vgg16:fsdp", "resnet50:zero1", "gpt2:fsdp",
                "gpt2:data-parallel")
COLLECTIVE = re.compile(r"^(all-reduce|all-gather|all-to-all|reduce-scatter|"
                        r"collective-permute)(-start|-done)?(\.\d+)?$")
BOOKKEEPING = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener", "end: ")


# ---------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    """One process: plan with the recorded calibration, compile, time, trace."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jaxwap.launch import cluster_from_env, start_distributed

    coordinator, nproc, pid = cluster_from_env()
    why = start_distributed(coordinator, nproc, pid, timeout_s=60)
    if why is not None:
        raise SystemExit(f"process {pid}: jax.distributed did not start: {why}")
    import time

    import jax
    import numpy as np
    from jax.profiler import ProfileData

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import zoo
    from layouts import variant_candidate

    import jaxwap
    from jaxwap.calibrate import Calibration
    from jaxwap.comm import collective_cost
    from jaxwap.cost import with_compiled
    from jaxwap.hardware import detect_cluster
    from jaxwap.hlo import parse_collectives
    from jaxwap.planner import make_plan
    from jaxwap.verify import compile_candidate

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
    r = next(r for r in planned.search.results if (r.d, r.m) == (d, m)
             and r.variant == "planner")
    cand = variant_candidate(planned.graph, r, variant, cluster)
    figs, cs = compile_candidate(w.step, planned.layout, cand, devices, cluster)
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
    n_batch = len(jax.tree_util.tree_leaves(data[-1]))

    def run() -> None:   # as measured.py runs a step: the new state is the next step's
        out = jax.block_until_ready(cs.compiled(*state))
        new = jax.tree_util.tree_leaves(
            jax.tree_util.tree_unflatten(planned.layout.out_treedef, out)[:-1])
        state[: len(state) - n_batch] = new

    for _ in range(3):
        run()
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        run()
        walls.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(args.traced):
                run()
        files = sorted(Path(d).rglob("*.xplane.pb"))
        if not files:
            raise RuntimeError(f"jax.profiler.trace wrote no xplane file under {d}")
        profile = ProfileData.from_file(str(files[0]))
    events, steps = [], []
    for plane in profile.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for e in line.events:
                if line.name == "python":   # the host's calls: a step is a call of run()
                    if re.fullmatch(r"\$cluster_timeline\.py:\d+ run", e.name):
                        steps.append((e.start_ns, e.start_ns + e.duration_ns))
                elif not e.name.startswith(BOOKKEEPING):
                    events.append((e.start_ns, e.duration_ns, e.name))
    pred = cand.predicted
    out = {"process": pid, "events": events, "steps": sorted(steps),
           "walls_s": walls, "prices": prices,
           "predicted": {"step_s": pred.step_time_s, "compute_s": pred.compute_time_s,
                         "comm_s": pred.exposed_comm_time_s + pred.tp_comm_time_s,
                         "xla_fed_step_s": xla_fed.step_time_s,
                         "xla_fed_comm_s": xla_fed.exposed_comm_time_s
                         + xla_fed.tp_comm_time_s}}
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
    """The last traced step of both processes, lined up: per collective its own time
    (the shorter of the two durations: the later process's) and the wait of the one that
    entered first; per process its compute (union of its other operations)."""
    k = min(len(p["steps"]) for p in procs) - 1
    per: list[dict[str, list[tuple[int, int]]]] = []
    compute = []
    for p in procs:
        a, b = p["steps"][k]
        colls: dict[str, list[tuple[int, int]]] = {}
        other = []
        for s, d, name in p["events"]:
            if a <= s < b:
                if COLLECTIVE.match(name):
                    colls.setdefault(name, []).append((s, d))
                else:
                    other.append((s, s + d))
        per.append(colls)
        compute.append(union_ns(other) * 1e-9)
    rows = []
    for name in sorted(set(per[0]) & set(per[1]), key=lambda n: per[0][n][0][0]):
        runs = list(zip(per[0][name], per[1][name], strict=False))  # one per loop trip
        own = sum(min(x[1], y[1]) for x, y in runs) * 1e-9
        waits = [sum(x[1] for x, _ in runs) * 1e-9 - own,
                 sum(y[1] for _, y in runs) * 1e-9 - own]
        price = procs[0]["prices"].get(re.sub(r"-(start|done)$", "", name), {})
        rows.append({"name": name, "times": len(runs), "own_s": own, "wait_s": waits,
                     "kind": price.get("kind"), "bytes": price.get("bytes"),
                     "buffers": price.get("buffers"),
                     "priced_s": price.get("priced_s", 0.0) * len(runs)})
    walls = [statistics.median(p["walls_s"]) for p in procs]
    return {"step_s": max(walls), "compute_s": compute, "collectives": rows,
            "own_s": sum(r["own_s"] for r in rows),
            "wait_s": [sum(r["wait_s"][i] for r in rows) for i in range(2)],
            "priced_s": sum(r["priced_s"] for r in rows),
            "predicted": procs[0]["predicted"]}


def measure(run: str, args: argparse.Namespace) -> dict[str, Any]:
    from jaxwap.launch import describe, launch_local

    with tempfile.TemporaryDirectory() as out:
        res = launch_local([sys.executable, str(Path(__file__).resolve()), "--worker",
                            "--run", run, "--out", out, "--record", args.record,
                            "--steps", str(args.steps), "--traced", str(args.traced)],
                           2, pin_cores=not args.unpinned, timeout_s=900)
        if not all(r.ok for r in res):
            raise SystemExit(f"{run}: the cluster failed:\n{describe(res)}")
        procs = [json.loads(Path(out, f"p{i}.json").read_text()) for i in range(2)]
    return {"run": run, **analyse(procs)}


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"Measured on this machine's CPU ({record['cpu']}), {record['date']}: the cluster of "
        "`measured.py` (2 processes, gloo; "
        + ("each pinned to its own core" if record["pinned"] else
           "**not pinned**: both may run on either core, unlike `measured.py`")
        + "), each candidate planned with the "
        "profile `measured_cpu.json` recorded for its model, its last of "
        f"{record['traced']} traced steps read from XLA's profiler in both processes. "
        f"Command: `python benchmarks/cluster_timeline.py {record['argv']}`.", "",
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
            f"| {ms(r['compute_s'][0])} / {ms(r['compute_s'][1])} | {ms(p['compute_s'])} "
            f"| {sum(c['times'] for c in r['collectives'])} | {ms(r['own_s'])} "
            f"| {ms(r['wait_s'][0])} / {ms(r['wait_s'][1])} | {ms(r['priced_s'])} "
            f"| {ms(p['comm_s'])} |")
    for r in record["runs"]:
        lines += ["", f"**{r['run']}**, each collective (ms; bytes of its result on a "
                      "device):", "",
                  "| collective | kind | bytes | buffers | runs | own | wait p0 / p1 | priced |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in r["collectives"]:
            lines.append(f"| {c['name']} | {c['kind']} | {c['bytes']} | {c['buffers']} "
                         f"| {c['times']} | {ms(c['own_s'])} | {ms(c['wait_s'][0])} / "
                         f"{ms(c['wait_s'][1])} | {ms(c['priced_s'])} |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> None:
    import platform

    runs = []
    for run in args.runs:
        r = measure(run, args)
        print(f"{run:22s} step {ms(r['step_s'])} ms (predicted {ms(r['predicted']['step_s'])}),"
              f" compute {ms(r['compute_s'][0])}/{ms(r['compute_s'][1])}, "
              f"{len(r['collectives'])} collectives own {ms(r['own_s'])} waits "
              f"{ms(r['wait_s'][0])}/{ms(r['wait_s'][1])}, priced {ms(r['priced_s'])}",
              flush=True)
        runs.append(r)
    record = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
              "pinned": not args.unpinned,
              "cpu": f"{platform.machine()}, {os.cpu_count()} cores",
              "argv": " ".join(sys.argv[1:]), "traced": args.traced, "runs": runs}
    stem = args.stem or "cluster_timeline_cpu" + ("_unpinned" if args.unpinned else "")
    RESULTS.joinpath(f"{stem}.json").write_text(json.dumps(record, indent=1))
    RESULTS.joinpath(f"{stem}.md").write_text(markdown(record))
    print(f"wrote {RESULTS / stem}.md")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS),
                    help="model:layout pairs (layouts: planner, data-parallel, zero1, fsdp)")
    ap.add_argument("--record", default=str(RESULTS / "measured_cpu.json"),
                    help="the measured.py record whose cluster calibrations to plan with")
    ap.add_argument("--steps", type=int, default=8, help="steps timed (wall) per process")
    ap.add_argument("--traced", type=int, default=3, help="steps run under the profiler")
    ap.add_argument("--unpinned", action="store_true",
                    help="let both processes use every core (measured.py pins each to one); "
                         "writes cluster_timeline_cpu_unpinned.*")
    ap.add_argument("--stem", help="the results' file name (default cluster_timeline_cpu, "
                    "_unpinned with --unpinned)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    worker(a) if a.worker else main(a)
