"""The GPU power limit as a planned decision: AlexNet, VGG-16 and GPT-2 small on 1-8 H100s.

Each row is `jaxwap.plan` (analytic, `verify=0`: nothing runs on an H100, every figure is
**predicted**) for a cluster of n H100s, three times: "throughput" (never caps), "least
energy within 5% of the fastest" with power limits weighed (the default), and the same
with no limit allowed (the H100 profile without its limit range), so the table splits
what the layout saves from what the cap adds. Planning time is measured on this machine.

It also sets the power model against the published figures found (`jaxwap.power` cites
each): which are inputs of the model and which could check it.

    python benchmarks/power.py     # writes results/power.{json,md}
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import zoo  # noqa: E402

import jaxwap  # noqa: E402
from jaxwap.hardware import device_spec  # noqa: E402
from jaxwap.power import DVFS_EXPONENT, H100_SXM  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SLOWDOWN = 0.05
H100 = device_spec("h100-sxm")
H100_UNCAPPABLE = dataclasses.replace(
    H100, name="h100-sxm (no power limits)",
    power=dataclasses.replace(H100_SXM, limit_range_w=None, default_limit_w=None))


def workloads() -> dict[str, Any]:
    return {"AlexNet (bs 128)": lambda: zoo.alexnet(batch_size=128),
            "VGG-16 (bs 128)": lambda: zoo.vgg16(batch_size=128),
            "GPT-2 small (bs 8 x 1024)": lambda: zoo.gpt2(batch_size=8)}


def figures(plan: jaxwap.Plan) -> dict[str, Any]:
    p = plan.predicted
    return {"mesh": dict(plan.mesh_shape), "power_limit_w": plan.power_limit_w,
            "step_ms": p.step_time_s * 1e3, "energy_j": p.energy_per_step_j,
            "watts_per_device": p.avg_power_w / p.num_devices,
            "frontier_points": len(plan.frontier()),
            "capped_on_frontier": sum(c.power_limit_w is not None for c in plan.frontier())}


def row(name: str, make: Any, n: int) -> dict[str, Any]:
    w = make()
    out: dict[str, Any] = {"workload": name, "devices": n}
    t0 = time.perf_counter()
    for key, spec, objective in (
            ("throughput", H100, "throughput"),
            ("capped", H100, jaxwap.Objective(max_slowdown=SLOWDOWN)),
            ("uncapped", H100_UNCAPPABLE, jaxwap.Objective(max_slowdown=SLOWDOWN))):
        plan = jaxwap.plan(w.step, *w.args, params=w.params, hardware=jaxwap.Cluster(spec, n),
                           verify=0, cache=False, objective=objective)
        out[key] = figures(plan)
    out["planning_time_s"] = (time.perf_counter() - t0) / 3
    base = out["throughput"]["energy_j"]
    out["saved_layout"] = 1 - out["uncapped"]["energy_j"] / base
    out["saved_with_cap"] = 1 - out["capped"]["energy_j"] / base
    return out


def published() -> list[dict[str, Any]]:
    """The published figures beside the model: inputs (the model takes them) and the one
    check in reach."""
    idle = H100.idle_watts
    gb300_idle = (100.0, 200.0)   # GB300's idle is not published in reach: a range
    model = [((500 - i) / (1400 - i)) ** (1 / DVFS_EXPONENT) for i in gb300_idle]
    return [
        {"figure": "H100/H200 SXM accepted limits", "published": "200-700 W, default 700 W",
         "model": f"{H100_SXM.limit_range_w[0]:.0f}-{H100_SXM.limit_range_w[1]:.0f} W",
         "kind": "input (stackhpc/ansible-slurm-appliance#975)"},
        {"figure": "Hopper SXM idle", "published": "78.8 W", "model": f"{idle:.0f} W",
         "kind": "input (same source)"},
        {"figure": "H100 waiting in a job (P0, 72 GB allocated, 0-4% util)",
         "published": "140-145 W", "model": f"{H100_SXM.comm_watts:.0f} W",
         "kind": "input (wilicc/gpu-burn#114)"},
        {"figure": "H200 memory-bound LLM decode", "published": "137-300 W",
         "model": f"{H100_SXM.memory_watts:.0f} W at full bandwidth",
         "kind": "input (arXiv 2605.11999)"},
        {"figure": "GB300 cuBLAS GEMM at a 500 W cap of 1400 W, share of full throughput",
         "published": "0.28-0.39 (617 of 1600-2174 Tflop/s)",
         "model": f"{min(model):.2f}-{max(model):.2f} (DVFS cube law, idle 100-200 W)",
         "kind": "check (facebookexperimental/triton#2023): the model is optimistic at a "
                 "deep cap"},
    ]


def main() -> None:
    rows = [row(name, make, n) for name, make in workloads().items() for n in (1, 2, 4, 8)]
    pub = published()
    RESULTS.mkdir(exist_ok=True)
    meta = {"command": "python benchmarks/power.py", "machine": platform.machine(),
            "jax": jaxwap.__dict__.get("__version__", ""), "basis": "predicted (H100 "
            "profile, analytic plans); planning time measured here"}
    (RESULTS / "power.json").write_text(json.dumps({"meta": meta, "rows": rows,
                                                    "published": pub}, indent=1))
    lines = [
        "# The power limit as a planned decision (H100, predicted)", "",
        "Command: `python benchmarks/power.py`. Every figure is **predicted** by jaxwap's "
        "model for H100 SXM clusters (analytic plans, `verify=0`); no GPU ran. The clock "
        "under a limit is the DVFS model (no published per-limit table was in reach), so "
        "the capped figures are modelled.", "",
        f"Energy saved per step against the throughput plan, within {SLOWDOWN:.0%} of its "
        "step time: by the layout alone (no limits) and with power limits weighed too.", "",
        "| workload | GPUs | throughput plan | ms | J/step | W/GPU | least energy within 5% "
        "(no limits) | saved | with limits | limit | ms | W/GPU | saved |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def mesh(f: dict[str, Any]) -> str:
        return "x".join(str(v) for v in f["mesh"].values())

    for r in rows:
        t, u, c = r["throughput"], r["uncapped"], r["capped"]
        lim = f"{c['power_limit_w']:.0f} W" if c["power_limit_w"] else "default"
        lines.append(
            f"| {r['workload']} | {r['devices']} | {mesh(t)} | {t['step_ms']:.2f} | "
            f"{t['energy_j']:.2f} | {t['watts_per_device']:.0f} | {mesh(u)} | "
            f"{r['saved_layout']:.1%} | {mesh(c)} | {lim} | {c['step_ms']:.2f} | "
            f"{c['watts_per_device']:.0f} | {r['saved_with_cap']:.1%} |")
    lines += ["", "Power model against published figures (`jaxwap/power.py` cites each):", "",
              "| figure | published | model | kind |", "|---|---|---|---|"]
    lines += [f"| {p['figure']} | {p['published']} | {p['model']} | {p['kind']} |"
              for p in pub]
    lines += ["", "Not checked, because no figure was in reach: a per-GPU training power "
              "for a workload this model can plan (only whole-node 8xH100 figures were "
              "found), and the WAP paper's 149 W for AlexNet (its GPU model could not be "
              "confirmed).",
              f"Planning time per plan: {min(r['planning_time_s'] for r in rows):.1f}-"
              f"{max(r['planning_time_s'] for r in rows):.1f} s (measured here)."]
    (RESULTS / "power.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
