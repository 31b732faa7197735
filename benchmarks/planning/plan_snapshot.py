"""A snapshot of the planner's decisions, to show a refactor leaves plans unchanged.

    .venv/bin/python -m benchmarks.planning.plan_snapshot --out /tmp/before.json    # old code
    .venv/bin/python -m benchmarks.planning.plan_snapshot --check /tmp/before.json  # new code

Plans, through the public API only (`jaxwap.plan`, so it runs on any version), a grid of
questions and records each decision: the mesh, every parameter's spec, optimizer-state
spec and host offload, and the step variant (micro-batches, remat):

- analytic (`verify=0`): the four zoo models at full size (AlexNet, VGG-16, ResNet-50,
  GPT-2 small, bf16) on four clusters (8 x H100 NVLink, 8 x H100 PCIe, 4 x A100-40GB,
  2 x V100) under four objectives (balanced, throughput, energy, least energy within 5%);
- memory pressure (`verify=0`): the same models on 8 x H100 with budgets of 1, 2 and 4 x
  the parameter bytes, as written and as `make_train_step` steps (which may be
  micro-batched);
- verified (`verify=3`, XLA compiles on the 8 simulated CPU devices): the CI-sized zoo
  models on 2 and 8 H100s, and on 8 with a tight budget.

`--check FILE` plans again and compares decisions with FILE: the mesh, specs and step
variant must be equal for every row; predicted step times are printed where they moved.
Exit status 1 when any decision differs. Every figure here is predicted (or the model
fed XLA:CPU's compiled figures); nothing is measured.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# first: sets up 8 simulated devices before jax starts
from benchmarks.models import candidates  # noqa: F401  # isort: skip

import jax

import jaxwap
from benchmarks import harness
from benchmarks.models import zoo

CLUSTERS = {
    "h100x8": lambda: jaxwap.Cluster("h100-sxm", 8),
    "h100x8-pcie": lambda: jaxwap.Cluster("h100-sxm", 8, link_bandwidth=25e9,
                                          link_latency=10e-6),
    "a100-40x4": lambda: jaxwap.Cluster("a100-sxm-40gb", 4),
    "v100x2": lambda: jaxwap.Cluster("v100-sxm2", 2),
}
OBJECTIVES = {
    "balanced": lambda: "balanced",
    "throughput": lambda: "throughput",
    "energy": lambda: "energy",
    "slowdown5": lambda: jaxwap.Objective(max_slowdown=0.05),
}
MODELS = ("alexnet", "vgg16", "resnet50", "gpt2")
# memory budgets in parameter bytes (ResNet-50's activations dwarf its weights); ResNet's
# step (batch-norm state) is not a make_train_step step
BUDGETS = {"alexnet": (1, 2, 4), "vgg16": (1, 2, 4), "resnet50": (8, 16, 32), "gpt2": (1, 2, 4)}
RESTRUCTURABLE = ("alexnet", "vgg16", "gpt2")


def cases() -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """(row name, workload, keyword arguments of jaxwap.plan)."""
    for name in MODELS:
        w = zoo.WORKLOADS[name]()
        for cn, cluster in CLUSTERS.items():
            for on, obj in OBJECTIVES.items():
                yield (f"analytic/{name}/{cn}/{on}", w,
                       dict(hardware=cluster(), objective=obj(), verify=0))
        for restructurable in (False, True) if name in RESTRUCTURABLE else (False,):
            wr = zoo.WORKLOADS[name](restructurable=True) if restructurable else w
            for k in BUDGETS[name]:
                tag = "make_train_step" if restructurable else "as-written"
                yield (f"memory/{name}/{tag}/budget={k}x-params", wr,
                       dict(hardware=CLUSTERS["h100x8"](), objective="balanced", verify=0,
                            memory_budget=float(k * w.param_bytes)))
    for name in MODELS:
        w = zoo.small(name)
        for n in (2, 8):
            yield (f"verified/{name}-small/h100x{n}", w,
                   dict(hardware=jaxwap.Cluster("h100-sxm", n), objective="balanced",
                        verify=3))
        if name not in RESTRUCTURABLE:
            continue
        wr = zoo.small(name, restructurable=True)
        yield (f"verified/{name}-small/h100x8/budget=3x-params", wr,
               dict(hardware=CLUSTERS["h100x8"](), objective="balanced", verify=3,
                    memory_budget=float(3 * w.param_bytes)))


def decision(plan: jaxwap.Plan) -> dict[str, Any]:
    return {
        "mesh": dict(plan.mesh_shape),
        "params": [[p.keystr, list(map(str, p.spec)),
                    None if p.state_spec is None else list(map(str, p.state_spec)),
                    bool(p.offload)] for p in plan.params],
        "step": plan.step.to_dict(),
    }


def snapshot(only: str | None) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for row, w, kw in cases():
        if only and only not in row:
            continue
        t0 = time.perf_counter()
        try:
            plan = jaxwap.plan(w.step, *w.args, params=w.params, cache=False, **kw)
            rows[row] = {**decision(plan), "predicted_step_s": plan.predicted.step_time_s}
        except MemoryError as e:
            rows[row] = {"error": f"MemoryError: {str(e)[:160]}"}
        dt = time.perf_counter() - t0
        r = rows[row]
        shown = r.get("error") or (" x ".join(f"{k}={v}" for k, v in r["mesh"].items())
                                   + f" step {r['step']}")
        print(f"{row:58s} {dt:6.2f} s  {shown}", flush=True)
    return rows


def compare(before: dict[str, Any], after: dict[str, Any]) -> int:
    differ = 0
    for row in before:
        if row not in after:
            continue
        b, a = before[row], after[row]
        same = {k: b.get(k) for k in ("mesh", "params", "step", "error")} == \
            {k: a.get(k) for k in ("mesh", "params", "step", "error")}
        if not same:
            differ += 1
            print(f"DIFFERS {row}: before {b.get('mesh')} {b.get('step')} "
                  f"{b.get('error', '')}; after {a.get('mesh')} {a.get('step')} "
                  f"{a.get('error', '')}")
            for pb, pa in zip(b.get("params", []), a.get("params", []), strict=False):
                if pb != pa:
                    print(f"    {pb} -> {pa}")
        elif "predicted_step_s" in b and abs(a["predicted_step_s"] / b["predicted_step_s"]
                                             - 1) > 1e-9:
            print(f"same decision, predicted step time moved {row}: "
                  f"{b['predicted_step_s'] * 1e3:.4f} -> {a['predicted_step_s'] * 1e3:.4f} ms")
    compared = sum(1 for r in before if r in after)
    print(f"{compared} rows compared, {differ} decisions differ")
    return 1 if differ else 0


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--out", type=Path, help="write the snapshot here")
    p.add_argument("--check", type=Path, help="compare with this snapshot")
    p.add_argument("--only", help="rows whose name contains this")
    args = p.parse_args()
    print(f"jax {jax.__version__}, jaxwap {jaxwap.__version__}, {len(jax.devices())} devices")
    rows = snapshot(args.only)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {args.out}")
    if args.check:
        return compare(json.loads(args.check.read_text()), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
