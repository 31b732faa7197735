"""Plans at cluster scale, from this machine: how long planning takes, what it chooses.

    .venv/bin/python -m benchmarks.planning.scale            # every row (a few minutes on 2 cores)
    .venv/bin/python -m benchmarks.planning.scale --quick    # the three planning-time goals only

Every plan is analytic (`verify=0`): the clusters described (up to 4096 H100s in nodes of
8) are not here, and `jaxwap.plan(..., hardware=Cluster(...))` plans for them anyway, from
abstract arguments on 8 simulated CPU devices. So:

- planning time is **measured** on this machine (wall time of `jaxwap.plan`, `cache=False`):
  the first call, a repeat (jax's trace cache warm, the analyses jaxwap keeps in memory
  forgotten: `jaxwap.clear_caches()`, so it plans again) and a third call with those kept
  (what planning the same step again in a process costs);
- step time and MFU are **predicted** by jaxwap's model for the described hardware.
  MFU = model flops / (devices x datasheet bf16 peak x predicted step time), with model flops
  6 x parameters x tokens + 12 x layers x d_model x seq x tokens (attention), the
  PaLM-paper convention (recomputation not counted).

The models are `benchmarks/models/zoo.py`'s: GPT-2 small, and Llama-3-shaped 8B and 70B
decoders built with `jaxwap.make_train_step` (so the planner may split the batch into
micro-batches), unrolled and (8B) stacked under `lax.scan`, with per-block
rematerialization (`remat=True`: each block's activations recomputed in its backward
pass, as large-model trainers run them; the attention is plain jnp, with its [T, T]
scores, no flash kernel), and one 8B row without it. The clusters are
H100 SXM nodes of 8 (NVLink 450 GB/s per GPU inside a node) with, between nodes, 400 Gb/s
InfiniBand per GPU (50 GB/s, the DGX H100 configuration), one 400 Gb/s link per node
(6.25 GB/s per GPU), or one 100 Gb/s Ethernet link per node (1.56 GB/s per GPU): those are
configurations, not measurements. The WAP rows plan one job under each objective and show
how many nodes each would use.

Writes `benchmarks/results/scale/cpu.json` and `cpu.md` (the README's table).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

import jaxwap  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.models import zoo  # noqa: E402
from jaxwap.hardware.datasheets import DATASHEETS  # noqa: E402

RESULTS = harness.results_dir("scale")
GB = 1e9


@dataclass(frozen=True)
class Row:
    """One planning question: a model, a cluster, an objective, and the planning-time goal
    it is held to (None: no goal)."""

    model: str
    cluster: str
    objective: str
    goal_s: float | None = None


def clusters() -> dict[str, jaxwap.Cluster]:
    h100 = "h100-sxm"
    return {
        "8 x H100 (1 node)": jaxwap.Cluster(h100, 8),
        "512 x H100 (64 nodes of 8, IB 400G/GPU)": jaxwap.Cluster(h100, 512, devices_per_node=8),
        "512 x H100 (64 nodes of 8, 400G/node)": jaxwap.Cluster(
            h100, 512, devices_per_node=8, inter_node_bandwidth=50 * GB / 8),
        "512 x H100 (64 nodes of 8, 100GbE/node)": jaxwap.Cluster(
            h100, 512, devices_per_node=8, inter_node_bandwidth=12.5 * GB / 8,
            inter_node_latency=30e-6),
        "4096 x H100 (512 nodes of 8, IB 400G/GPU)": jaxwap.Cluster(
            h100, 4096, devices_per_node=8),
    }


def workloads() -> dict[str, tuple[Any, int, int]]:
    """Per model: a builder of its zoo Workload (abstract arguments), its layer count and
    d_model (for the attention term of the model flops)."""
    l8, l70 = zoo.LLAMA_CONFIGS["llama_8b"], zoo.LLAMA_CONFIGS["llama_70b"]
    return {
        "GPT-2 small (bs 8 x 1024)": (lambda: zoo.gpt2(), 12, 768),
        "Llama 8B (bs 1024 x 4096)": (lambda: zoo.llama_8b(batch_size=1024, remat=True),
                                      l8["layers"], l8["d_model"]),
        "Llama 8B scan (bs 1024 x 4096)": (
            lambda: zoo.llama_8b(batch_size=1024, scan=True, remat=True),
            l8["layers"], l8["d_model"]),
        "Llama 8B no remat (bs 1024 x 4096)": (lambda: zoo.llama_8b(batch_size=1024),
                                               l8["layers"], l8["d_model"]),
        "Llama 8B (bs 256 x 4096)": (lambda: zoo.llama_8b(batch_size=256, remat=True),
                                     l8["layers"], l8["d_model"]),
        "Llama 70B (bs 2048 x 4096)": (lambda: zoo.llama_70b(batch_size=2048, remat=True),
                                       l70["layers"], l70["d_model"]),
    }


GOAL_ROWS = [
    Row("GPT-2 small (bs 8 x 1024)", "8 x H100 (1 node)", "balanced", 0.5),
    Row("Llama 8B (bs 1024 x 4096)", "512 x H100 (64 nodes of 8, IB 400G/GPU)", "balanced", 5.0),
    Row("Llama 70B (bs 2048 x 4096)", "4096 x H100 (512 nodes of 8, IB 400G/GPU)", "balanced",
        10.0),
]
MORE_ROWS = [
    Row("Llama 8B scan (bs 1024 x 4096)", "512 x H100 (64 nodes of 8, IB 400G/GPU)",
        "balanced"),
    Row("Llama 8B no remat (bs 1024 x 4096)", "512 x H100 (64 nodes of 8, IB 400G/GPU)",
        "balanced"),
    # fewer sequences than devices: the model axis is the only way to use them all
    Row("Llama 8B (bs 256 x 4096)", "512 x H100 (64 nodes of 8, IB 400G/GPU)", "throughput"),
    Row("Llama 8B (bs 1024 x 4096)", "512 x H100 (64 nodes of 8, 400G/node)", "balanced"),
    Row("Llama 8B (bs 1024 x 4096)", "512 x H100 (64 nodes of 8, 100GbE/node)", "balanced"),
    # WAP at scale: how many nodes each objective would use
    Row("Llama 8B (bs 1024 x 4096)", "512 x H100 (64 nodes of 8, IB 400G/GPU)", "throughput"),
    Row("Llama 8B (bs 1024 x 4096)", "512 x H100 (64 nodes of 8, IB 400G/GPU)", "energy"),
    Row("Llama 8B (bs 1024 x 4096)", "512 x H100 (64 nodes of 8, 100GbE/node)", "energy"),
]


def model_flops(w: Any, layers: int, d_model: int) -> float:
    """6 N T + 12 L d s T (PaLM's MFU convention) for a transformer workload."""
    params = sum(int(x.size) for x in jax.tree.leaves(w.params))
    batch, seq = jax.tree.leaves(w.args[2])[0].shape[:2]
    tokens = batch * seq
    return 6.0 * params * tokens + 12.0 * layers * d_model * seq * tokens


def plan_row(row: Row, built: dict[str, Any], hw: dict[str, jaxwap.Cluster]) -> dict[str, Any]:
    w, layers, d_model = built[row.model]
    cluster = hw[row.cluster]
    times = []
    plan = None
    for i in range(3):
        if i < 2:     # the first call and the repeat: jaxwap's kept analyses forgotten
            jaxwap.clear_caches()
        t0 = time.perf_counter()
        try:
            plan = jaxwap.plan(w.step, *w.args, params=w.params, hardware=cluster,
                               verify=0, cache=False, objective=row.objective)
        except MemoryError as e:     # an answer too: nothing fits, and why
            times.append(time.perf_counter() - t0)
            error = str(e)
            continue
        times.append(time.perf_counter() - t0)
    if plan is None:
        return {"model": row.model, "cluster": row.cluster, "objective": row.objective,
                "planning_time_s": {"first": times[0], "repeat": times[1], "again": times[2]},
                "goal_s": row.goal_s,
                "meets_goal": None if row.goal_s is None else times[1] <= row.goal_s,
                "error": error}
    pr = plan.predicted
    flops = model_flops(w, layers, d_model)
    # MFU against the datasheet's peak, as MFU is quoted (the profile's peak_flops is the
    # rate a matmul reaches, below it)
    sheet = DATASHEETS.get(cluster.device.name)
    peak = sheet.peak_flops if sheet is not None else cluster.device.peak_flops
    mfu = flops / (plan.num_devices * peak * pr.step_time_s)
    counts = Counter(p.strategy for p in plan.params)
    nodes = -(-plan.num_devices // cluster.node_size)
    return {
        "model": row.model, "cluster": row.cluster, "objective": row.objective,
        "planning_time_s": {"first": times[0], "repeat": times[1], "again": times[2]},
        "planning_phases_s": dict(plan.planning_time_s), "goal_s": row.goal_s,
        "meets_goal": None if row.goal_s is None else times[1] <= row.goal_s,
        "mesh_shape": dict(plan.mesh_shape), "num_devices": plan.num_devices,
        "nodes_used": nodes, "num_nodes": cluster.num_nodes,
        "strategies": dict(counts.most_common()), "step": plan.step.to_dict(),
        "power_limit_w": plan.power_limit_w,
        "predicted_step_time_s": pr.step_time_s, "predicted_mfu": mfu,
        "predicted_energy_per_step_j": pr.energy_per_step_j,
        "predicted_peak_memory_bytes": pr.peak_memory_bytes,
        "predicted_exposed_comm_s": pr.exposed_comm_time_s,
        "predicted_tp_comm_s": pr.tp_comm_time_s,
        "model_flops_per_step": flops, "candidates": len(plan.candidates),
        "notes": list(plan.notes),
    }


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    out = [
        f"Planned on this machine ({platform.machine()}, {os.cpu_count()} cores, 8 simulated "
        f"CPU devices) for the clusters described; command: `{command}`. Planning time is "
        f"**measured** (wall time of `jaxwap.plan`, repeat call, jaxwap's kept analyses "
        f"forgotten; in brackets the first call, and a call again with them kept); "
        f"step time, MFU, energy are **predicted** by jaxwap's model (H100 datasheet "
        f"figures, analytic plans: nothing here ran on an H100).",
        "",
        "| model | cluster | objective | planning s (measured) | goal | mesh | nodes used | "
        "strategies | step (and GPU power limit) | step time (predicted) | MFU (predicted) | "
        "energy/step (predicted) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pt = r["planning_time_s"]
        times = f"{pt['repeat']:.2f} ({pt['first']:.2f}; again {pt['again']:.2f})"
        goal = "" if r["goal_s"] is None else \
            f"<= {r['goal_s']:g} s {'met' if r['meets_goal'] else 'MISSED'}"
        if "error" in r:
            out.append(f"| {r['model']} | {r['cluster']} | {r['objective']} | "
                       f"{times} | {goal} | no plan fits: "
                       f"{r['error'].split('. ')[0]} | | | | | | |")
            continue
        mesh = " x ".join(f"{k}={v}" for k, v in r["mesh_shape"].items())
        strat = ", ".join(f"{k} {v}" for k, v in list(r["strategies"].items())[:4])
        step = r["step"]
        variant = ", ".join(x for x in (
            f"{step['micro_batches']} micro-batches" if step["micro_batches"] > 1 else "",
            f"remat {step['remat']}" if step["remat"] != "none" else "") if x) or "as written"
        if r.get("power_limit_w") is not None:
            variant += f", capped at {r['power_limit_w']:.0f} W"
        out.append(
            f"| {r['model']} | {r['cluster']} | {r['objective']} | {times} | {goal} | {mesh} "
            f"| {r['nodes_used']} of {r['num_nodes']} "
            f"| {strat} | {variant} | {r['predicted_step_time_s'] * 1e3:.1f} ms | "
            f"{r['predicted_mfu']:.0%} | {r['predicted_energy_per_step_j'] / 1e3:.3g} kJ |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="the planning-time goal rows only")
    ap.add_argument("--render", action="store_true",
                    help="only write cpu.md again from cpu.json (no planning)")
    args = ap.parse_args()
    if args.render:
        doc = json.loads((RESULTS / "cpu.json").read_text())
        (RESULTS / "cpu.md").write_text(markdown(doc["rows"], doc["command"]))
        return
    rows = GOAL_ROWS + ([] if args.quick else MORE_ROWS)
    builders = workloads()
    built = {name: (builders[name][0](), *builders[name][1:])
             for name in sorted({r.model for r in rows})}
    hw = clusters()
    results = []
    for row in rows:
        r = plan_row(row, built, hw)
        results.append(r)
        if "error" in r:
            print(f"{row.model} | {row.cluster} | {row.objective}: no plan fits "
                  f"({r['planning_time_s']['repeat']:.2f} s): {r['error'][:300]}", flush=True)
            continue
        print(f"{row.model} | {row.cluster} | {row.objective}: planned in "
              f"{r['planning_time_s']['repeat']:.2f} s (first {r['planning_time_s']['first']:.2f}"
              f" s), mesh {r['mesh_shape']}, {r['nodes_used']} nodes, step "
              f"{r['predicted_step_time_s'] * 1e3:.1f} ms, MFU {r['predicted_mfu']:.0%} "
              f"(predicted)", flush=True)
    command = "python -m benchmarks.planning.scale" + (" --quick" if args.quick else "")
    doc = {"command": command,
           "date_utc": harness.date_utc(),
           "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
           "jax_version": jax.__version__, "jaxwap_version": jaxwap.__version__,
           "basis": "planning time measured here; step time, MFU, energy predicted "
                    "(analytic plans for hardware not present)",
           "rows": results}
    harness.write_record(RESULTS / ("cpu_quick" if args.quick else "cpu"), doc,
                         markdown(results, command), indent=2)
    print(markdown(results, command))


if __name__ == "__main__":
    main()
