"""A decoder layer's memory, predicted against compiled, on the device present.

    python -m benchmarks.gpu.memory_rules                 # on a GPU: XLA:GPU's figures
    .venv/bin/python -m benchmarks.gpu.memory_rules       # here: XLA:CPU's (the path)

The memory model follows XLA's fusion and buffer assignment by rules read from XLA's
passes and checked against XLA:CPU (`analysis/fusion.py`, `liveness`: what XLA keeps whole
rather than fuse into its readers, a view a matmul reads written by its fusion, the
batch held to the end). XLA:GPU fuses by its own cost model, and an unrolled model's
checkpointed blocks save memory there, where XLA:CPU computes every recomputation ahead
of the backward pass. The largest plans rest on both: the unrolled Llama 3 405B plans
within 0.3 GB of its 72 GB budget with full per-layer remat. This compiles what
`jaxwap.plan(..., verify=1)` compiles for one device, a small Llama-style decoder
(`zoo.llama`), as written and with each per-layer remat policy, scanned and unrolled, at
2 and 4 layers, and sets the model's peak beside XLA's (`Plan.compiled.memory_bytes`): a
layer's bytes are half the difference between the two depths, so what does not grow with
depth (the embedding, the head, the optimizer's temporaries) drops out. Writes
`results/memory_rules/<device>.{json,md}` (or under `--out`). Figures: **predicted** (the
model) and **compiled** (XLA's memory analysis of the compiled step); nothing runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

MODULE = "benchmarks.gpu.memory_rules"
#: the decoder: batch x sequence, width, heads, MLP width (as `zoo.llama` takes them)
SHAPE = {"batch_size": 16, "seq_len": 256, "d_model": 256, "heads": 4, "kv_heads": 4,
         "ffn": 1024}
DEPTHS = (2, 4)
POLICIES = ("none", "layer_dots", "layer_full")


def figures(scan: bool, policy: str, layers: int, dtype: str) -> dict[str, float]:
    """The predicted and compiled peak of one decoder's step, on one present device."""
    import jaxwap
    from benchmarks.models import zoo
    from jaxwap.core.records import StepVariant

    w = zoo.llama("llama_tiny", scan=scan, dtype=dtype, layers=layers, **SHAPE)
    step = w.step.with_variant(StepVariant(remat=policy))
    t0 = time.perf_counter()
    plan = jaxwap.plan(step, *w.args, params=w.params, mesh_shape={"data": 1}, verify=1,
                       cache=False)
    return {"predicted": float(plan.predicted.peak_memory_bytes),
            "compiled": float(plan.compiled.memory_bytes),
            "seconds": time.perf_counter() - t0}


def rows(dtypes: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every form, policy and dtype: the step's peak at each depth and a layer's bytes."""
    out = []
    for dtype in dtypes:
        for scan in (False, True):
            for policy in POLICIES:
                at = {n: figures(scan, policy, n, dtype) for n in DEPTHS}
                lo, hi = (at[n] for n in DEPTHS)
                per = {k: (hi[k] - lo[k]) / (DEPTHS[1] - DEPTHS[0])
                       for k in ("predicted", "compiled")}
                out.append({"written": "scanned" if scan else "unrolled", "remat": policy,
                            "dtype": dtype, "step": at, "per_layer": per,
                            "per_layer_ratio": per["predicted"] / per["compiled"]
                            if per["compiled"] > 0 else None})
                print(f"{dtype} {out[-1]['written']:<8} {policy:<10} a layer: "
                      f"{per['predicted'] / 1e6:8.2f} MB predicted, "
                      f"{per['compiled'] / 1e6:8.2f} MB compiled", flush=True)
    return out


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"# A decoder layer's memory: predicted against compiled on {record['device']}", "",
        f"Command: `{record['command']}`. One device, `mesh_shape={{'data': 1}}`, "
        f"`verify=1`. Decoder {record['shape']}; a layer's bytes are half the difference "
        f"between {DEPTHS[0]} and {DEPTHS[1]} layers. **Predicted**: jaxwap's model; "
        f"**compiled**: XLA's memory analysis of the compiled step.", "",
        "| dtype | written | remat | a layer, predicted | a layer, compiled | ratio | "
        f"step at {DEPTHS[1]} layers, predicted / compiled |",
        "|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        p, c = r["per_layer"]["predicted"], r["per_layer"]["compiled"]
        s = r["step"][DEPTHS[1]]
        ratio = "-" if r["per_layer_ratio"] is None else f"{r['per_layer_ratio']:.2f}x"
        lines.append(f"| {r['dtype']} | {r['written']} | {r['remat']} | {p / 1e6:.2f} MB | "
                     f"{c / 1e6:.2f} MB | {ratio} | {s['predicted'] / 1e6:.1f} / "
                     f"{s['compiled'] / 1e6:.1f} MB |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = harness.parser(__doc__)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--out", type=Path, help="the folder to write to (default: the records)")
    args: argparse.Namespace = p.parse_args(argv)
    record = {**harness.environment(MODULE, argv), "shape": SHAPE,
              "rows": rows(tuple(args.dtypes))}
    text = markdown(record)
    print(text)
    folder = args.out or harness.results_dir("memory_rules")
    harness.write_record(folder / record["device"].replace(" ", "_").lower(), record, text)
    return record


if __name__ == "__main__":
    main()
