"""The host's call of a step on this machine, measured, beside what the model prices.

    .venv/bin/python -m benchmarks.accuracy.step_call        # one device, then 8 simulated
    taskset -c 0 .venv/bin/python -m benchmarks.accuracy.step_call --tag one_core
    PYTHONPATH=<checkout of an earlier commit>:. .venv/bin/python -P \
        -m benchmarks.accuracy.step_call --steps-only --tag before  # the steps alone, its code
    .venv/bin/python -m benchmarks.accuracy.step_call --steps-only --calls-only --rounds 30 \
        --against <checkout of an earlier commit>/jaxwap        # before and after, interleaved
    python -m benchmarks.accuracy.step_call --device --out DIR  # on a GPU: full-size steps

(`-P` keeps the repository root from going ahead of PYTHONPATH, so the earlier checkout's
`jaxwap` is the one imported; the `.` at its end finds this `benchmarks` package.)

jax's dispatch of a compiled program (parsing its arguments, the donation, making its
results, per device) is paid once per step and is not inside any operation, so the
calibration's in-program probes leave it out. `jaxwap.calibrate` measures it with
`dispatch_probes.step_call` (seconds + n x seconds per array for n arrays in and out, on one
device and on all of a process's: `DeviceSpec.call_cost`). This times the same kind of
program, one that adds one to its donated arguments, directly at several array counts, on
one device and on 8 simulated CPU devices (a fresh process with
`--xla_force_host_platform_device_count=8`), beside what the probe makes of its two
calls there; and gives each CI-sized zoo model's arrays in and out (`Graph.buffers`) and
the call the one-device probe prices for it with the Python calls of its pytree work
(`pytree_cost`). Then ResNet-50-small's and GPT-2-small's one-device steps are timed
through `auto_shard`, through `jax.jit` and inside a program, whose differences are what
a call really costs. Each round times every way once, so a round's differences (auto_shard
less jax.jit) pair figures taken together: on a machine shared with other work their
median and spread across rounds say more than the difference of two medians. The goal
column: within 1% of jax.jit's step or 50 us, whichever is larger. The call alone is timed
too (`call_times`): the same pytrees through a step that adds one to each state leaf, whose
program is cheap, so the call's difference stands out of the noise of a step's. `--against
DIR` times another jaxwap package (an earlier commit's `jaxwap/`, imported under another
name) in the same rounds.

Writes `benchmarks/results/step_call/cpu.json` and `.md` (`--tag T`: `cpu_T.*`).
Every figure is **measured** on this CPU, except the zoo's call, **predicted** from the
probe and the Python calls the planner counts. `--device` times the same three ways the
full-size steps (bf16, the zoo's batches) on the default backend's first device (a GPU)
and writes `<device>.*` under `--out`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

MODULE = "benchmarks.accuracy.step_call"   # this script, as `python -m` runs it
RESULTS = harness.results_dir("step_call")
COUNTS = (1, 8, 32, 108, 256)


def timed(devices: int) -> dict[str, Any]:
    """In this process (which must have `devices` CPU devices): median seconds of a call
    with each count of arrays replicated on the first `devices` (`dispatch_probes.call_seconds`,
    300 calls each), and the probe's rows."""
    import jax

    from jaxwap.calibration import dispatch_probes

    devs = jax.devices()[:devices]
    out = {str(n): dispatch_probes.call_seconds(devs, n, repeats=300) for n in COUNTS}
    rows = dispatch_probes.step_call(devs)
    a, c = rows[-1][1:]    # the probe's row for all of them
    return {"devices": devices, "call_s": out, "probe": rows,
            "probe_s": {str(n): a + c * 2 * n for n in COUNTS}}


def zoo_calls(rows: list[list[float]], per_call: float) -> list[dict[str, Any]]:
    """Each CI-sized zoo model's arrays in and out, the Python calls of its pytree work
    (`Graph.tree_calls`, counted by the planner) and the call one device prices, at
    `per_call` seconds each (`host_calls.python_call_seconds`)."""
    import dataclasses

    import jaxwap
    from benchmarks.models import zoo
    from jaxwap.cost.prediction import call_time
    from jaxwap.planner import make_plan

    spec = dataclasses.replace(jaxwap.device_spec("cpu"), call_cost=rows,
                               python_call_s=per_call)
    cluster = jaxwap.Cluster(spec, 1)
    rows = []
    for name in ("alexnet", "vgg16", "resnet50", "gpt2"):
        w = zoo.small(name)
        planned = make_plan(w.step, w.args, {}, params=w.params,
                            options=jaxwap.PlanOptions(hardware=cluster, verify=0, cache=False))
        g = planned.graph
        rows.append({"model": w.name, "arrays": g.buffers, "tree_calls": g.tree_calls,
                     "tree_s": g.tree_calls * per_call,
                     "call_s": call_time(cluster, g.buffers, 1, g.tree_calls)})
    return rows


def zoo_steps(names: tuple[str, ...] = ("resnet50", "gpt2", "resnet50-depth"),
              full: bool = False, in_program: bool = True, rounds: int = 12,
              against: Any = None) -> list[dict[str, Any]]:
    """`step_times` of each model (`full`: the full-size model, else the CI-sized one;
    `resnet50-depth`: ResNet-50 at its full depth, 8 channels wide on 32-pixel images, whose
    592 argument leaves are the full model's count on a CPU-sized computation)."""
    return [step_times(name, full, in_program, rounds, against=against) for name in names]


def load_against(path: str) -> Any:
    """The jaxwap package in the directory `path` (a checkout's `jaxwap/`), imported as
    `jaxwap_against` beside this one: its modules import each other relatively."""
    root = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(
        "jaxwap_against", root / "__init__.py", submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["jaxwap_against"] = module
    spec.loader.exec_module(module)
    return module


def step_times(name: str, full: bool = False, in_program: bool = True, rounds: int = 12,
               calls: int = 11, against: Any = None) -> dict[str, Any]:
    """A zoo model's one-device step timed three ways in interleaved rounds (median of
    `calls` calls a round, medians of the rounds): through `auto_shard` as a training
    loop calls it (its pytrees in and out), through `jax.jit` of the step (donating the
    state), and inside a program (`timing.in_program`'s difference: one program running
    the step three times against one running it once, over two), which no call pays. The
    first two less the third are what a call costs (`in_program=False`: the first two
    alone). `against`: another jaxwap module whose `auto_shard` is timed in the same
    rounds. Each round's auto_shard less jax.jit gives the differences' median and
    quartiles (`diff_s`, `diff_iqr_s`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxwap
    from jaxwap.calibration.timing import time_it

    w, data = _workload(name, full)
    k = len(data) - 1       # the state's arguments; the batch comes last

    def looped(step: Any) -> Any:
        state = [jax.tree.map(lambda a: jnp.array(a, copy=True), x) for x in data]

        def run() -> None:
            got = jax.block_until_ready(step(*state))
            state[:k] = got[:-1]
        return run

    def chained(r: int) -> Any:
        def steps(*a: Any) -> Any:
            state = a[:k]
            for _ in range(r):
                got = w.step(*state, a[k])
                state = got[:-1]
            return got
        return jax.jit(steps, donate_argnums=tuple(range(k)))

    runs = {"auto_shard": looped(jaxwap.auto_shard(w.step, w.params, cache=False)),
            "jax.jit": looped(jax.jit(w.step, donate_argnums=tuple(range(k))))}
    if against is not None:
        runs["against"] = looped(against.auto_shard(w.step, w.params, cache=False))
    if in_program:
        runs.update({"chain 1": looped(chained(1)), "chain 3": looped(chained(3))})
    times = _rounds(runs, rounds, lambda run: time_it(run, calls))
    med = {n: float(np.median(t)) for n, t in times.items()}
    out = {"model": w.name if name != "resnet50-depth" else name, "rounds": rounds,
           "auto_shard_s": med["auto_shard"], "jit_s": med["jax.jit"],
           "in_program_s": (med["chain 3"] - med["chain 1"]) / 2 if in_program else None,
           **_paired(times)}
    return out


def call_times(name: str, full: bool = False, rounds: int = 30, calls: int = 20,
               against: Any = None) -> dict[str, Any]:
    """The call alone: a zoo model's arguments (its pytrees, so as many leaves as its
    step takes) through a step that adds one to each state leaf and sums a batch leaf,
    whose program costs little beside its call: through `auto_shard`, through `jax.jit`
    donating the state (and `against`'s auto_shard), `calls` calls back to back a round
    (the last one waited for), in interleaved rounds. Seconds a call and each round's
    differences with jax.jit (`_paired`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxwap

    w, data = _workload(name, full)
    k = len(data) - 1

    def add_one(*a: Any) -> Any:
        return (*jax.tree.map(lambda x: x + 1, a[:k]),
                {"sum": jnp.sum(jax.tree.leaves(a[k])[0])})

    def looped(step: Any) -> Any:
        state = [jax.tree.map(lambda a: jnp.array(a, copy=True), x) for x in data]

        def run() -> Any:
            got = step(*state)
            state[:k] = got[:-1]
            return got
        return run

    def timed(run: Any) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            got = run()
        jax.block_until_ready(got)
        return (time.perf_counter() - t0) / calls

    runs = {"auto_shard": looped(jaxwap.auto_shard(add_one, w.params, cache=False,
                                                   verify=0)),
            "jax.jit": looped(jax.jit(add_one, donate_argnums=tuple(range(k))))}
    if against is not None:
        runs["against"] = looped(against.auto_shard(add_one, w.params, cache=False,
                                                    verify=0))
    times = _rounds(runs, rounds, timed)
    return {"model": w.name if name != "resnet50-depth" else name, "rounds": rounds,
            "leaves": len(jax.tree.leaves(data)), "auto_shard_s": float(np.median(
                times["auto_shard"])), "jit_s": float(np.median(times["jax.jit"])),
            **_paired(times)}


def _workload(name: str, full: bool = False) -> tuple[Any, tuple[Any, ...]]:
    """(The zoo workload, its synthetic arguments): `full` the full-size model, else the
    CI-sized one; `resnet50-depth` ResNet-50 at full depth, 8 channels, 32 pixels."""
    from benchmarks.models import zoo

    w = (zoo.WORKLOADS[name]() if full else
         zoo.resnet50(batch_size=2, image_size=32, width=8, num_classes=10)
         if name == "resnet50-depth" else zoo.small(name))
    return w, w.synthetic(0)


def _rounds(runs: dict[str, Any], rounds: int, timed: Any) -> dict[str, list[float]]:
    """`timed(run)` of every run in each of `rounds` rounds, after a warm-up call each;
    each round starts with the next run, so none is always first."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {n: [] for n in runs}
    order = list(runs)
    for r in range(rounds):
        for n in order[r % len(order):] + order[:r % len(order)]:
            times[n].append(timed(runs[n]))
    return times


def _paired(times: dict[str, list[float]]) -> dict[str, Any]:
    """Each way's round-by-round differences with jax.jit: median, quartiles and all of
    them (`diff_s`, `diff_iqr_s`, `diffs_s`; `against_*` for the other jaxwap)."""
    import numpy as np

    jit = np.array(times["jax.jit"])
    out: dict[str, Any] = {}
    for way, prefix in (("auto_shard", ""), ("against", "against_")):
        if way not in times:
            continue
        d = np.array(times[way]) - jit
        out.update({f"{prefix}diff_s": float(np.median(d)),
                    f"{prefix}diff_iqr_s": [float(np.percentile(d, 25)),
                                            float(np.percentile(d, 75))],
                    f"{prefix}diffs_s": [float(x) for x in d]})
        if way == "against":
            out["against_s"] = float(np.median(times[way]))
    return out


def _within_goal(diff_s: float, jit_s: float) -> bool:
    """The goal: within 1% of jax.jit's step or 50 us, whichever is larger."""
    return diff_s <= max(0.01 * jit_s, 50e-6)


def _against_cells(row: dict[str, Any]) -> str:
    """A table row's cells for the jaxwap at `--against`: its median difference from
    jax.jit's and their quartiles, in microseconds."""
    lo, hi = row["against_diff_iqr_s"]
    return f" {row['against_diff_s'] * 1e6:+.0f} | {lo * 1e6:+.0f} .. {hi * 1e6:+.0f} |"


def markdown(record: dict[str, Any]) -> str:
    where = (f"one {record['device']} (host: {record['cpu']})" if record.get("device")
             else f"this machine's CPU ({record['cpu']})")
    head = (f"**Measured** on {where}, {record['date_utc']} UTC. "
            f"Command: `{record['command']}`.")
    lines = [head, ""]
    if record.get("runs"):
        lines += ["The host's call of a program that adds one to its donated arguments, "
                  "median of 300 calls each; beside it what the calibration's probe "
                  "(`dispatch_probes.step_call`, in the same process) makes of its two calls, "
                  "1 and 64 arrays.", "",
                  "| devices | " + " | ".join(f"{n} arrays in and out" for n in COUNTS) + " |",
                  "|---|" + "---|" * len(COUNTS)]
        for r in record["runs"]:
            lines.append(f"| {r['devices']} measured | " + " | ".join(
                f"{r['call_s'][str(n)] * 1e6:.1f} us" for n in COUNTS) + " |")
            lines.append(f"| {r['devices']} probe | " + " | ".join(
                f"{r['probe_s'][str(n)] * 1e6:.1f} us" for n in COUNTS) + " |")
        rows = "; ".join(f"{d} device(s) {a * 1e6:.2f} us + {c * 1e6:.3f} us an array"
                         for d, a, c in record["runs"][-1]["probe"])
        lines += ["", f"The probe's rows in the 8-device process (`DeviceSpec.call_cost`): "
                  f"{rows}.", "",
                  f"Each CI-sized zoo model's call, one device (**predicted**: the one-device "
                  f"probe's row for its arrays, plus the Python calls of its pytree work, "
                  f"counted by the planner, at {record['python_call_s'] * 1e9:.0f} ns each, "
                  f"**measured** here by `host_calls.python_call_seconds`):", "",
                  "| model | arrays in and out | pytree calls | their time | call |",
                  "|---|---|---|---|---|"]
        lines += [f"| {z['model']} | {z['arrays']} | {z['tree_calls']} | "
                  f"{z['tree_s'] * 1e3:.3f} ms | {z['call_s'] * 1e3:.3f} ms |"
                  for z in record["zoo"]]
        lines.append("")
    priced = {z["model"]: z["call_s"] for z in record.get("zoo", [])}
    size = "Full-size (the zoo's batches, bf16)" if record.get("device") else "One-device"
    lines += [f"{size} steps, **measured** in interleaved rounds: as a training loop calls "
              "`auto_shard`'s step, as it calls `jax.jit` of the step, and inside a program "
              "(no call: a program of three steps less one of one, over two). What a call "
              "costs is the first two less the third:", "",
              "| model | auto_shard ms | jax.jit ms | in a program ms | auto_shard's call "
              "ms | jax.jit's call ms | priced call ms |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {s['model']} | {s['auto_shard_s'] * 1e3:.2f} | {s['jit_s'] * 1e3:.2f} | "
              + (f"{s['in_program_s'] * 1e3:.2f} | "
                 f"{(s['auto_shard_s'] - s['in_program_s']) * 1e3:.2f} | "
                 f"{(s['jit_s'] - s['in_program_s']) * 1e3:.2f} | "
                 if s["in_program_s"] is not None else "- | - | - | ")
              + (f"{priced[s['model']] * 1e3:.2f} |" if s["model"] in priced else "- |")
              for s in record["steps"]]
    paired = [s for s in record["steps"] if "diff_s" in s]
    if paired:
        against = any("against_s" in s for s in paired)
        lines += ["", "auto_shard's step less jax.jit's, round by round (the median of the "
                  "rounds' differences, and their quartiles); the goal: within 1% of "
                  "jax.jit's step or 50 us, whichever is larger"
                  + (f"; `before`: the jaxwap at `{record['against']}`, timed in the same "
                     f"rounds" if against else "") + ":", "",
                  "| model | rounds | jax.jit ms | auto_shard - jax.jit us | quartiles us "
                  "| goal us | within |" + (" before - jax.jit us | quartiles us |"
                                            if against else ""),
                  "|---|---|---|---|---|---|---|" + ("---|---|" if against else "")]
        for s in paired:
            lo, hi = s["diff_iqr_s"]
            row = (f"| {s['model']} | {s['rounds']} | {s['jit_s'] * 1e3:.2f} | "
                   f"{s['diff_s'] * 1e6:+.0f} | {lo * 1e6:+.0f} .. {hi * 1e6:+.0f} | "
                   f"{max(0.01 * s['jit_s'], 50e-6) * 1e6:.0f} | "
                   f"{'yes' if _within_goal(s['diff_s'], s['jit_s']) else 'no'} |")
            lines.append(row + (_against_cells(s) if against else ""))
    if record.get("calls"):
        against = any("against_s" in c for c in record["calls"])
        lines += ["", "The call alone: each model's arguments (its pytrees) through a step "
                  "that adds one to each state leaf, whose program costs little beside the "
                  "call, 20 calls back to back a round, in interleaved rounds; auto_shard "
                  "less jax.jit round by round (median, quartiles)"
                  + (", and the jaxwap at `against`" if against else "") + ":", "",
                  "| model | leaves | rounds | jax.jit us a call | auto_shard - jax.jit us "
                  "| quartiles us |" + (" before - jax.jit us | quartiles us |"
                                       if against else ""),
                  "|---|---|---|---|---|---|" + ("---|---|" if against else "")]
        for c in record["calls"]:
            lo, hi = c["diff_iqr_s"]
            row = (f"| {c['model']} | {c['leaves']} | {c['rounds']} | "
                   f"{c['jit_s'] * 1e6:.0f} | {c['diff_s'] * 1e6:+.0f} | "
                   f"{lo * 1e6:+.0f} .. {hi * 1e6:+.0f} |")
            lines.append(row + (_against_cells(c) if against else ""))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--tag", default="")
    ap.add_argument("--steps-only", action="store_true",
                    help="time the zoo's steps alone (runs on the code of earlier commits)")
    ap.add_argument("--device", action="store_true",
                    help="the full-size steps alone on the default backend (a GPU)")
    ap.add_argument("--calls-only", action="store_true",
                    help="auto_shard against jax.jit alone (no in-program time)")
    ap.add_argument("--rounds", type=int, default=12, help="interleaved rounds per model")
    ap.add_argument("--against", help="a jaxwap package directory (an earlier commit's "
                    "jaxwap/) to time in the same rounds")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.device:
        os.environ["JAX_PLATFORMS"] = "cpu"
    if args.worker:
        print(json.dumps(timed(args.worker)))
        return
    against = load_against(args.against) if args.against else None
    record = {"command": harness.command(MODULE), "date_utc": harness.date_utc(minutes=True),
              "cpu": harness.cpu_line(affinity=True)}
    if args.device:
        import jax

        kind = jax.devices()[0].device_kind
        record.update(device=kind, jax=jax.__version__,
                      steps=zoo_steps(("resnet50", "gpt2"), full=True,
                                      in_program=not args.calls_only, rounds=args.rounds,
                                      against=against),
                      calls=[call_times(n, True, args.rounds, against=against)
                             for n in ("resnet50", "gpt2")])
        stem = "".join(c if c.isalnum() else "-" for c in kind.lower()) \
            + (f"_{args.tag}" if args.tag else "")
        _write(Path(args.out), stem, record)
        return
    if not args.steps_only:
        from jaxwap.calibration.host_calls import python_call_seconds

        runs = [timed(1)]
        per_call = python_call_seconds()
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
        got = subprocess.run(harness.worker(MODULE, "--worker", "8"), env=env,
                             check=True, capture_output=True, text=True, cwd=harness.ROOT)
        runs.append(json.loads(got.stdout.strip().splitlines()[-1]))
        record.update(runs=runs, python_call_s=per_call,
                      zoo=zoo_calls(runs[0]["probe"], per_call))
    if against is not None:
        record["against"] = args.against
    record["steps"] = zoo_steps(in_program=not args.calls_only, rounds=args.rounds,
                                against=against)
    record["calls"] = [call_times(n, rounds=args.rounds, against=against)
                       for n in ("resnet50", "gpt2", "resnet50-depth")]
    _write(Path(args.out), "cpu" + (f"_{args.tag}" if args.tag else ""), record)


def _write(out: Path, stem: str, record: dict[str, Any]) -> None:
    harness.write_record(out / stem, record, markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
