"""How close jaxwap's predictions are to XLA's own analysis of the compiled step.

    .venv/bin/python -m benchmarks.accuracy.fidelity           # AlexNet, VGG-16, ResNet-50, GPT-2
    .venv/bin/python -m benchmarks.accuracy.fidelity --small   # CI-sized versions, a few minutes

For AlexNet, VGG-16 (batch 128, 224 px), ResNet-50 with batch norm (batch 128, 224 px)
and a GPT-2-small-shaped NNX decoder (12 layers, d=768, seq 1024, vocab 50257, batch 8),
all bf16 compute with Adam, every candidate of `benchmarks/models/candidates.py` (each
mesh of up to 8 simulated devices with the planner's layout, plain data parallelism and
FSDP) is priced by the model and compiled by XLA. Per device, three quantities are compared:

- memory: the model's peak live bytes vs XLA's argument + output + temp - alias;
- flops: the model's per-device flops vs `Compiled.cost_analysis()["flops"]`;
- communication: the model's bytes sent per device vs the collectives in the compiled
  HLO priced by the same ring formulas.

Every figure here is predicted (the model) or compiled (XLA's analysis for the simulated
CPU devices); nothing is measured. Writes `benchmarks/results/fidelity/cpu.json` and
`cpu.md` (`cpu_small.*` with `--small`), and prints the median and worst relative error per
quantity.
"""

from __future__ import annotations

import statistics
from typing import Any

# first: sets up 8 simulated devices before jax starts
from benchmarks.models import candidates  # isort: skip

import jax

import jaxwap
from benchmarks import harness
from jaxwap.core.units import si

QUANTITIES = {
    "memory": ("peak_memory_bytes", "memory_bytes"),
    "flops": ("flops_as_xla_counts", "flops"),
    "comm": ("comm_bytes", "comm_bytes"),
}
GOAL_MEDIAN, GOAL_WORST = 0.10, 0.25


def rel_error(pred: float, comp: float) -> float:
    """|predicted - compiled| / compiled; a quantity XLA says is zero and the model does
    not counts as a 100% miss."""
    if comp == 0:
        return 0.0 if pred == 0 else 1.0
    return abs(pred - comp) / comp


def rows_for(name: str, records: list[candidates.Record]) -> list[dict[str, Any]]:
    rows = []
    for r in records:
        if r.compiled is None:
            continue
        row: dict[str, Any] = {"model": name, "mesh": f"{r.d}x{r.m}", "variant": r.variant}
        for q, (pf, cf) in QUANTITIES.items():
            p, c = getattr(r.predicted, pf), getattr(r.compiled, cf)
            row[q] = {"predicted": p, "compiled": c, "rel_error": rel_error(p, c)}
        rows.append(row)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for q in QUANTITIES:
        errs = [r[q]["rel_error"] for r in rows]
        worst = max(rows, key=lambda r: r[q]["rel_error"]) if rows else None
        out[q] = {"median": statistics.median(errs) if errs else float("nan"),
                  "worst": max(errs) if errs else float("nan"), "n": len(errs),
                  "worst_at": f"{worst['model']} {worst['mesh']} {worst['variant']}"
                  if worst else ""}
    return out


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any], per_model: dict) -> str:
    lines = ["| quantity | median error | worst error | worst at | candidates |",
             "|---|---|---|---|---|"]
    for q, s in summary.items():
        lines.append(f"| {q} | {100 * s['median']:.1f}% | {100 * s['worst']:.1f}% | "
                     f"{s['worst_at']} | {s['n']} |")
    lines += ["", "| model | memory median / worst | flops median / worst | "
              "comm median / worst |", "|---|---|---|---|"]
    for m, s in per_model.items():
        cells = [f"{100 * s[q]['median']:.0f}% / {100 * s[q]['worst']:.0f}%" for q in QUANTITIES]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "| model | mesh | layout | memory pred / XLA | flops pred / XLA | "
              "comm pred / XLA |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{si(r[q]['predicted'], sep='')} / {si(r[q]['compiled'], sep='')}"
                 for q in QUANTITIES]
        lines.append(f"| {r['model']} | {r['mesh']} | {r['variant']} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--models", default="alexnet,vgg16,resnet50,gpt2")
    p.add_argument("--small", action="store_true", help="CI-sized versions of the models")
    p.add_argument("--refresh", action="store_true", help="recompile, ignore saved records")
    args = p.parse_args()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    rows, errors = [], []
    per_model = {}
    for name in names:
        w = candidates.build(name, args.small)
        print(f"{w.name}: {w.description}", flush=True)
        _, records = candidates.load_or_compile(w, args.small, args.refresh)
        errors += [f"{w.name} {r.d}x{r.m} {r.variant}: {r.error}" for r in records if r.error]
        mrows = rows_for(w.name, records)
        per_model[w.name] = summarize(mrows)
        rows += mrows
    summary = summarize(rows)
    print(f"\n{'quantity':10s} {'median':>8s} {'worst':>8s}  worst at")
    for q, s in summary.items():
        ok = s["median"] <= GOAL_MEDIAN and s["worst"] <= GOAL_WORST
        print(f"{q:10s} {100 * s['median']:7.1f}% {100 * s['worst']:7.1f}%  {s['worst_at']}"
              f"   (goal <= {100 * GOAL_MEDIAN:.0f}% / {100 * GOAL_WORST:.0f}%: "
              f"{'met' if ok else 'missed'})")
    for m, s in per_model.items():
        print(f"  {m:16s} " + "  ".join(
            f"{q} {100 * s[q]['median']:.0f}%/{100 * s[q]['worst']:.0f}%" for q in QUANTITIES))
    for e in errors:
        print("compile failed:", e)
    out = harness.results_dir("fidelity")
    record = {"command": harness.command("benchmarks.accuracy.fidelity"),
              "date_utc": harness.date_utc(),
              "jax": jax.__version__, "jaxwap": jaxwap.__version__,
              "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind} (simulated)",
              "hardware_profile": candidates.HARDWARE.to_dict(),
              "basis": "predicted = jaxwap's model; compiled = XLA's analysis of the compiled "
                       "step on the simulated CPU devices; nothing measured",
              "summary": summary, "per_model": per_model, "rows": rows,
              "compile_errors": errors}
    stem = out / ("cpu_small" if args.small else "cpu")
    harness.write_record(stem, record, markdown(rows, summary, per_model))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
