"""Where the planner pipelines: Llama-style 8B and 70B models (stacked layers under
`lax.scan`) planned for H100 clusters whose links between nodes range from 400 Gb/s
InfiniBand per GPU (8 rails a node) down to one 100 Gb/s Ethernet link per node.

Each row is one `jaxwap.plan` (analytic: `verify=0`, nothing runs on an H100) with
pipelining weighed beside every other candidate, as `auto_shard` plans. It reports the
chosen plan, whether it is pipelined, and the best candidate of the other kind from the
same plan's candidates (so both were priced by the same model in the same search): the
predicted gain of pipelining is the best non-pipelined step time (or energy) over the
best pipelined one. Planning time is measured on this machine.

    python -m benchmarks.pipelines.pipeline          # every row: results/pipeline/cpu.{json,md}
    python -m benchmarks.pipelines.pipeline --quick  # the 8B rows only (cpu_quick.*)
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jaxwap  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.models import zoo  # noqa: E402
from jaxwap.core.records import STAGE  # noqa: E402

RESULTS = harness.results_dir("pipeline")
GB = 1e9
H100 = "h100-sxm"

# per-device share of the inter-node links (bytes/s): the node's links over its 8 GPUs
LINKS = {
    "IB 400G x8 per node": 50 * GB,
    "IB 400G per node": 50 * GB / 8,
    "IB 200G per node": 25 * GB / 8,
    "100GbE per node": 12.5 * GB / 8,
}


def cluster(devices: int, link: str) -> jaxwap.Cluster:
    slow = link.startswith("100GbE")
    return jaxwap.Cluster(H100, devices, devices_per_node=8, inter_node_bandwidth=LINKS[link],
                          inter_node_latency=30e-6 if slow else None)


def workloads() -> dict[str, Any]:
    return {
        "Llama 8B scan (bs 512 x 4096)": lambda: zoo.llama_8b(batch_size=512, scan=True,
                                                              remat=True),
        "Llama 70B scan (bs 1024 x 4096)": lambda: zoo.llama_70b(batch_size=1024, scan=True,
                                                                 remat=True),
    }


ROWS = [(model, devices, link, objective)
        for model, devices in (("Llama 8B scan (bs 512 x 4096)", 256),
                               ("Llama 70B scan (bs 1024 x 4096)", 1024))
        for link in LINKS for objective in ("throughput", "energy")]


def _pipelined(c: Any) -> bool:
    return dict(c.mesh_shape).get(STAGE, 1) > 1


def plan_row(w: Any, devices: int, link: str, objective: str) -> dict[str, Any]:
    hw = cluster(devices, link)
    t0 = time.perf_counter()
    try:
        plan = jaxwap.plan(w.step, *w.args, params=w.params, hardware=hw, verify=0,
                           cache=False, objective=objective)
    except MemoryError as e:
        return {"error": str(e)[:400], "planning_time_s": time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    fit = [c for c in plan.candidates if c.fits]
    chosen = next(c for c in plan.candidates if c.chosen)

    def best(cands: list[Any]) -> Any:   # by the objective's own score
        return min(cands, key=lambda c: c.score) if cands else None

    pipe, flat = best([c for c in fit if _pipelined(c)]), best([c for c in fit
                                                               if not _pipelined(c)])

    def figures(c: Any) -> dict[str, Any] | None:
        if c is None:
            return None
        p = c.predicted
        return {"mesh": dict(c.mesh_shape), "step_time_s": p.step_time_s,
                "energy_per_step_j": p.energy_per_step_j,
                "peak_memory_bytes": p.peak_memory_bytes,
                "bubble_time_s": p.bubble_time_s, "send_time_s": p.send_time_s,
                "exposed_comm_s": p.exposed_comm_time_s, "verdict": c.reason}

    why_not = [n for n in plan.notes if n.startswith("pipelining not considered")]
    return {"planning_time_s": seconds, "chosen": figures(chosen),
            "chosen_pipelined": _pipelined(chosen), "step": plan.step.to_dict(),
            "step_described": plan.step.describe(),
            "best_pipelined": figures(pipe), "best_not_pipelined": figures(flat),
            "gain_time": (flat.predicted.step_time_s / pipe.predicted.step_time_s
                          if pipe and flat else None),
            "gain_energy": (flat.predicted.energy_per_step_j / pipe.predicted.energy_per_step_j
                            if pipe and flat else None),
            "phases_s": dict(plan.planning_time_s), "why_not": why_not}


def _mesh(m: dict[str, int] | None) -> str:
    return "-" if m is None else " x ".join(f"{k}={v}" for k, v in m.items())


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    out = [
        f"Planned on this machine ({platform.machine()}, {os.cpu_count()} cores) for the H100 "
        f"clusters described (8 GPUs a node); command: `{command}`. Step time and energy "
        f"are **predicted** by jaxwap's model (analytic plans, nothing ran on an H100); "
        f"planning time is **measured** here. Gain = best non-pipelined / best pipelined "
        f"candidate of the same plan (> 1: pipelining predicted better). The bubble is the "
        f"time devices idle in it: 0 where GPipe keeping only each loop step's input runs "
        f"its layers there (busy) instead.",
        "",
        "| model | devices | inter-node link | objective | chosen mesh | pipelined? | step "
        "(predicted) | best pipelined: mesh, step, idle bubble, sends | best not pipelined: "
        "mesh, step | gain time / energy (predicted) | planning s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['devices']} | {r['link']} | {r['objective']} |"
        if "error" in r:
            out.append(f"{head} no plan fits: {r['error'][:120]} | | | | | | "
                       f"{r['planning_time_s']:.1f} |")
            continue
        c, p, f = r["chosen"], r["best_pipelined"], r["best_not_pipelined"]
        ps = ("-" if p is None else f"{_mesh(p['mesh'])}, {p['step_time_s'] * 1e3:.0f} ms, "
              f"{p['bubble_time_s'] * 1e3:.0f} ms, {p['send_time_s'] * 1e3:.0f} ms")
        fs = "-" if f is None else f"{_mesh(f['mesh'])}, {f['step_time_s'] * 1e3:.0f} ms"
        gain = ("-" if r["gain_time"] is None
                else f"{r['gain_time']:.2f}x / {r['gain_energy']:.2f}x")
        out.append(f"{head} {_mesh(c['mesh'])} | "
                   f"{'yes: ' + r['step_described'] if r['chosen_pipelined'] else 'no'} | "
                   f"{c['step_time_s'] * 1e3:.0f} ms | {ps} | {fs} | {gain} | "
                   f"{r['planning_time_s']:.1f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="the 8B rows only")
    args = ap.parse_args()
    rows = [r for r in ROWS if not args.quick or "8B" in r[0]]
    builders = workloads()
    built = {name: builders[name]() for name in sorted({r[0] for r in rows})}
    results = []
    for model, devices, link, objective in rows:
        r = {"model": model, "devices": devices, "link": link, "objective": objective,
             **plan_row(built[model], devices, link, objective)}
        results.append(r)
        c = r.get("chosen")
        print(f"{model} | {devices} | {link} | {objective}: "
              + (f"no plan: {r['error'][:200]}" if c is None else
                 f"{_mesh(c['mesh'])} {c['step_time_s'] * 1e3:.0f} ms "
                 f"{'PIPELINED ' + r['step_described'] if r['chosen_pipelined'] else ''} "
                 f"gain {r['gain_time']}") + f" ({r['planning_time_s']:.1f} s)", flush=True)
    command = "python -m benchmarks.pipelines.pipeline" + (" --quick" if args.quick else "")
    harness.write_record(RESULTS / ("cpu_quick" if args.quick else "cpu"),
                         {"command": command, "rows": results}, markdown(results, command),
                         newline=False, default=str)


if __name__ == "__main__":
    main()
