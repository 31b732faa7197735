"""Where the time between two steps goes, on this machine, from a profiler trace.

    .venv/bin/python -m benchmarks.accuracy.call_phases   # ResNet-50-small, GPT-2-small

A training loop that waits for each step pays, between the last operation of one step
and the first of the next: the wake-up of the waiting thread and the return to Python,
jax's dispatch of the next call up to XLA's execution (parsing the arguments, the
donation), and the execution's start up to its first operation. `benchmarks/accuracy/step_call.py`
measures the sum (a step's call less its time inside a program); this splits it with
`jax.profiler.trace` (host events `PjitFunction` and `ExecuteHelperOnSingleDevice`, the
operations' own events as `op_profile.op_events` reads them), the step compiled as
`auto_shard` would for one device (donating its state) and called with its flat leaves,
so that no pytree work enters. The Python tracer is off (it slows the dispatch several
times over). Every figure is **measured** on this CPU, one traced run of 8 steps after 5
untraced ones; the calibration's probe of a call (`dispatch_probes.call_seconds`, a program that
adds one to each of as many donated arrays) is timed beside it.

Writes `benchmarks/results/call_phases/cpu.json` and `.md`.
"""

from __future__ import annotations

import bisect
import glob
import os
import tempfile
from typing import Any

from benchmarks import harness

RESULTS = harness.results_dir("call_phases")
PHASES = ("last operation -> next dispatch", "dispatch -> execution",
          "execution -> first operation")


def phases(name: str, steps: int = 8) -> dict[str, Any]:
    """The three phases between steps of a zoo model's one-device step, in microseconds,
    for each traced step after the first."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.profiler import ProfileData

    from benchmarks.accuracy.op_profile import op_events
    from benchmarks.models import zoo
    from jaxwap.calibration import dispatch_probes

    w = zoo.small(name)
    data = w.synthetic(0)
    k = len(data) - 1
    leaves, treedef = jax.tree_util.tree_flatten(tuple(data))
    donated = len(jax.tree_util.tree_leaves(tuple(data[:k])))

    def flat(*values: Any) -> tuple[Any, ...]:
        return tuple(jax.tree_util.tree_leaves(w.step(*treedef.unflatten(values))))

    step = jax.jit(flat, donate_argnums=tuple(range(donated)))
    state = [jnp.array(a, copy=True) for a in leaves]

    def run() -> None:
        out = jax.block_until_ready(step(*state))
        state[:donated] = out[:donated]

    for _ in range(5):
        run()
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, profiler_options=options)
        for _ in range(steps):
            run()
        jax.profiler.stop_trace()
        ops, host = op_events(ProfileData.from_file(
            glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]))
    starts = sorted(s for s, _, _ in ops)
    ends = sorted(s + t for s, t, _ in ops)
    calls = sorted(s for s, _, n in host if n.startswith("PjitFunction"))
    calls = [s for i, s in enumerate(calls) if i == 0 or s - calls[i - 1] > 5e3]  # nested
    executes = sorted(s for s, _, n in host if n.startswith("CommonPjRtLoadedExecutable::"
                                                             "ExecuteHelper"))
    rows = []
    for call, execute in zip(calls[1:], executes[1:], strict=False):
        last = ends[bisect.bisect_left(ends, call) - 1]
        first = starts[bisect.bisect_left(starts, execute)]
        rows.append([(call - last) / 1e3, (execute - call) / 1e3, (first - execute) / 1e3])
    med = np.median(np.array(rows), axis=0)
    return {"model": w.name, "arrays_in": len(leaves), "donated": donated,
            "per_step_us": rows, "median_us": dict(zip(PHASES, med.tolist(), strict=True)),
            "probe_call_us": dispatch_probes.call_seconds(jax.devices()[:1], len(leaves)) * 1e6}


def markdown(record: dict[str, Any]) -> str:
    lines = [f"**Measured** on this machine's CPU ({record['cpu']}), {record['date_utc']} "
             f"UTC, from a `jax.profiler` trace of each model's one-device step called "
             f"with its flat leaves (its state donated), the Python tracer off. Command: "
             f"`{record['command']}`. Medians over the traced steps, in us; the last "
             f"column is the calibration's probe of a call with as many arrays "
             f"(`dispatch_probes.call_seconds`), timed alone.", "",
             "| model | arrays | " + " | ".join(PHASES) + " | sum | probe's call |",
             "|---|---|" + "---|" * (len(PHASES) + 2)]
    for r in record["models"]:
        m = r["median_us"]
        lines.append(f"| {r['model']} | {r['arrays_in']} ({r['donated']} donated) | "
                     + " | ".join(f"{m[p]:.0f}" for p in PHASES)
                     + f" | {sum(m.values()):.0f} | {r['probe_call_us']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    record = {"command": "python -m benchmarks.accuracy.call_phases",
              "date_utc": harness.date_utc(minutes=True),
              "cpu": harness.cpu_line(affinity=True),
              "models": [phases(name) for name in ("resnet50", "gpt2")]}
    harness.write_record(RESULTS / "cpu", record, markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
