"""Where a GPU step's time went, by kind of kernel, beside jaxwap's model of the same kinds.

    .venv/bin/python -m benchmarks.gpu.gpu_trace /work/.device/1/gpu_sweep_work.tgz
    .venv/bin/python -m benchmarks.gpu.gpu_trace /tmp/h100/gpu_sweep_work   # unpacked

Reads what `gpu_sweep.py --trace` keeps: per model a trace of 3 training steps and the
program that ran (`trace_<model>_<batch>.xplane.pb`, `.hlo.txt`), the calibration and the
measured rows. The model is tuned by kind (a convolution share, a matmul curve, a
bandwidth), so where a prediction is off is asked by kind: measured (kernel times),
compiled (HLO shapes), predicted (`op_time.op_times`). Writes
`results/gpu_trace/<device>.*`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the model side needs no device

from benchmarks import harness  # noqa: E402

MODULE = "benchmarks.gpu.gpu_trace"   # this script, as `python -m` runs it

CONV = tuple(f"conv {f} {p}" for f in ("first layer", "1x1", "3x3+")
             for p in ("forward", "input gradient", "kernel gradient"))
LAYOUT, FUSED = "copies, transposes (XLA's)", "fusions together"
KINDS = (*CONV, "matmul", "matmul (batched)", "pooling forward", "pooling gradient",
         "fusion (elementwise)", "fusion (reduction)", FUSED, LAYOUT, "gather, scatter",
         "other", "fresh memory (model's term)", "unmatched events")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s64": 8, "f64": 8}
_NO_KERNEL = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all",
              "opt-barrier", "partition-id", "replica-id"}
_HELPER = re.compile(r"^[Mm]emset|AddPadding|nchwToNhwc|nhwcToNchw")  # serve a library call
_NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    line: str
    body: str = ""      # a fusion's computation and those it calls

    def arrays(self) -> list[tuple[str, list[int]]]:
        return [(t, [int(d) for d in s.split(",") if d])
                for t, s in re.findall(r"(\w+)\[([\d,]*)\]", self.shape)]


def nbytes(arrays: list[tuple[str, list[int]]]) -> float:
    return sum(math.prod(d) * _BYTES.get(t, 1) for t, d in arrays)


def parse_hlo(text: str) -> tuple[dict[str, Instr], list[str]]:
    """Every instruction by name (unique module-wide), and the entry's launching ones (no
    parameters, bitcasts, tuples) in schedule order: the order the stream runs them."""
    from jaxwap.decide.xla_figures import computations

    comps = computations(text)
    instrs: dict[str, Instr] = {}
    for line in (x for lines in comps.values() for x in lines[1:]):
        m = _NAME.match(line)
        rest = line[m.end():] if m else ""
        cut = rest.find(") ") + 1 if rest.startswith("(") else rest.find(" ")
        if m and (op := re.match(r"([\w\-]+)\(([^)]*)\)", rest[cut:].lstrip())):
            instrs[m.group(1)] = Instr(m.group(1), rest[:cut], op.group(1),
                                       re.findall(r"%([\w.\-]+)", op.group(2)), line)

    def body(name: str, depth: int = 0) -> str:
        t = "\n".join(comps.get(name, [])[1:])
        return t + "".join(body(c, depth + 1) for c in re.findall(
            r"(?:calls|to_apply)=%([\w.\-]+)", t)) if depth < 3 else t
    order = []
    for line in next(v for v in comps.values() if v[0].startswith("ENTRY"))[1:]:
        ins = instrs.get(m.group(1)) if (m := _NAME.match(line)) else None
        if ins is not None and ins.opcode not in _NO_KERNEL:
            c = re.search(r"calls=%([\w.\-]+)", ins.line)
            ins.body = body(c.group(1)) if c else ""
            order.append(ins.name)
    return instrs, order


def kind_of(ins: Instr, instrs: dict[str, Instr]) -> tuple[str, dict[str, Any]]:
    """An HLO op's kind of work and compiled flops and bytes: a cuDNN call by family (first
    layer: under 8 input channels; 1x1; 3x3+) and pass (a `convForward` under `transpose(`
    is an input gradient XLA rewrote) from the forward convolution its `dim_labels` describe;
    a matmul from its dot; XLA:GPU's pooling gradient: an argmax reduce-window, a scatter."""
    res = ins.arrays()[:1] if ins.opcode == "custom-call" else ins.arrays()  # no workspace
    b, io = ins.body, nbytes(res + [a for o in ins.operands for a in instrs[o].arrays()])
    if "__cudnn$conv" in ins.line:
        target = re.search(r'custom_call_target="([^"]+)"', ins.line).group(1)
        rhs = re.search(r"dim_labels=\w+_(\w+)->", ins.line).group(1)
        a, z = (instrs[o].arrays()[0] for o in ins.operands[:2])
        x, w, y = (res[0], z, a) if "BackwardInput" in target else (a, res[0], z) \
            if "BackwardFilter" in target else (a, z, res[0])
        cout, win = w[1][rhs.index("o")], [w[1][i] for i, c in enumerate(rhs) if c.isdigit()]
        fam = "first layer" if math.prod(w[1]) / cout / math.prod(win) < 8 else \
            "1x1" if math.prod(win) == 1 else "3x3+"
        pas = "kernel gradient" if "Filter" in target else "input gradient" \
            if "BackwardInput" in target or "transpose(" in ins.line else "forward"
        return f"conv {fam} {pas}", {"family": fam, "pass": pas, "bytes": nbytes([x, w, y]),
                                     "flops": 2.0 * math.prod(y[1]) * math.prod(w[1]) / cout}
    if "__cublas" in ins.line or (ins.opcode == "fusion" and " dot(" in b):
        dot = ins if ins.opcode != "fusion" else instrs[_NAME.match(
            next(x for x in b.splitlines() if " dot(" in x)).group(1)]
        lhs, out = instrs[dot.operands[0]].arrays()[0], dot.arrays()[0]
        dims = [[int(d) for d in re.findall(r"\d+", m.group(1))] if m else [] for m in (
            re.search(rf'lhs_{k}_dim(?:ension)?s"?[:=]\s*[\[{{]([^\]}}]*)', dot.line)
            for k in ("batch", "contracting"))]
        # XLA's split-K carves a batch dim out of the contracted one, partial sums in f32
        batched = bool(dims[0]) and not (out[0] == "f32" and lhs[0] != "f32")
        k = math.prod(lhs[1][d] for d in dims[1])
        return "matmul (batched)" if batched else "matmul", {
            "flops": 2.0 * math.prod(out[1]) * k, "bytes": io, "shape": out[1]}
    if ins.opcode != "fusion":
        return (LAYOUT if ins.opcode == "copy" else "other"), {"bytes": io}
    return ("pooling gradient" if "reduce-window(" in b and "iota(" in b or " scatter(" in b
            and "select_and_sc" in ins.line + b else "pooling forward" if "reduce-window(" in b
            else "gather, scatter" if re.search(r" (scatter|gather)\(", b) else LAYOUT
            if re.search(r" transpose\(|ROOT \S+ = \S+ copy\(", b) else "fusion (reduction)"
            if " reduce(" in b else "fusion (elementwise)"), {"bytes": io}


def align(step: list[Any], instrs: dict[str, Instr], order: list[str]
          ) -> list[tuple[Any, str | None]]:
    """Each event of a step and its HLO op (None: none found). Its `hlo_op` stat names it,
    but inside a command buffer (a CUDA graph) only an XLA kernel names one of the fusions it
    serves, so an event is the schedule's next op of its sort (one stream runs the schedule
    in order); a helper (memset, cuDNN's padding) goes with the library call after it."""
    index = {n: i for i, n in enumerate(order)}
    # XLA:GPU emits one kernel for identical fusions (`deduplicated_name`; a weight's cast
    # carries none: the same shapes and computation)
    groups = {n: m.group(1) if (m := re.search(r'deduplicated_name="([^"]+)"', x.line)) else
              n if x.opcode != "fusion" else re.sub(r"%[\w.\-]+|, metadata=.*", "", x.line + x.body)
              for n, x in ((n, instrs[n]) for n in order)}
    kernel = {n.replace(".", "_").replace("-", "_"): groups[n] for n in order}
    out, pos, pending = [], 0, []
    for e in step:
        if e[3] in index:
            j: int | None = index[e[3]]
        elif _HELPER.search(e[2]) and e[2] not in kernel:
            pending.append(e)
            continue
        else:
            test = ((lambda n, g=kernel[e[2]]: groups[n] == g) if e[2] in kernel else
                    (lambda n: instrs[n].opcode == "copy") if "memcpy" in e[2].lower() else
                    (lambda n: instrs[n].opcode == "custom-call"))
            j = next((i for i in range(pos, len(order)) if test(order[i])), None)
        name, pos = (order[j], max(pos, j + 1)) if j is not None else (None, pos)
        out += [(p, name if name and instrs[name].opcode == "custom-call" else None)
                for p in pending] + [(e, name)]
        pending = []
    return out + [(p, None) for p in pending]


def measure(stem: Path) -> dict[str, Any]:
    """Per step (after its host `PjitFunction` call), each kind's and op's kernel time and
    count, and the span: kernels, their union (programmatic dependent launch overlaps them
    a little), idle between them, the gap to the next step (the host's)."""
    from jax.profiler import ProfileData

    instrs, order = parse_hlo(stem.with_suffix(".hlo.txt").read_text())
    events, calls, cuts, end = [], [], [], -1.0
    for plane in ProfileData.from_file(str(stem.with_suffix(".xplane.pb"))).planes:
        for e in (e for line in plane.lines for e in line.events):
            if plane.name.startswith("/device:GPU") and ("kernel_details" in (
                    s := dict(e.stats)) or "emset" in e.name or "emcpy" in e.name):
                events.append((e.start_ns, e.duration_ns, e.name, str(s.get("hlo_op", ""))))
            elif plane.name == "/host:CPU" and e.name.startswith("PjitFunction("):
                calls.append((e.start_ns, e.start_ns + e.duration_ns))
    for a, z in sorted(calls):   # the outer of nested calls
        cuts, end = (cuts + [a], z) if a > end else (cuts, end)
    steps: list[list[Any]] = [[e for e in sorted(events) if a <= e[0] < z]
                              for a, z in zip(cuts, [*cuts[1:], math.inf], strict=True)]
    n, per_op = len(steps), {}
    tot = dict.fromkeys(("kernel_sum_s", "busy_s", "span_s", "gap_between_steps_s"), 0.0)
    for i, step in enumerate(steps):
        for e, name in align(step, instrs, order):
            if (name or "?") not in per_op:
                kind, info = kind_of(instrs[name], instrs) if name else ("unmatched events", {})
                per_op[name or "?"] = {"kind": kind, "s": 0.0, "events": 0.0, **info}
            op = per_op[name or "?"]
            op["s"], op["events"] = op["s"] + e[1] * 1e-9 / n, op["events"] + 1 / n
        end = step[0][0]
        for start, dur, *_ in step:
            tot["busy_s"] += max(0.0, start + dur - max(start, end)) * 1e-9 / n
            end = max(end, start + dur)
        tot["kernel_sum_s"] += sum(e[1] for e in step) * 1e-9 / n
        tot["span_s"] += (end - step[0][0]) * 1e-9 / n
        if i + 1 < n:
            tot["gap_between_steps_s"] += (steps[i + 1][0][0] - end) * 1e-9 / (n - 1)
    for x in [x for x, op in per_op.items() if op["kind"] == "pooling gradient"]:
        if " scatter(" in instrs[x].body and per_op.get(
                c := instrs[x].operands[0], {}).get("kind") == LAYOUT:  # the buffer it writes
            per_op[c]["kind"] = "pooling gradient"
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for op in per_op.values():
        for k in (op["kind"], FUSED)[:1 + op["kind"].startswith("fusion")]:
            for key, v in (("s", "s"), ("kernels", "events"), ("bytes", "bytes")):
                kinds[k][key] += op.get(v, 0.0)
    return {"steps": n, "kinds": dict(kinds), "per_op": per_op, **tot,
            "batched_dot_relayouts": batched_dot_relayouts(per_op, instrs),
            "idle_in_step_s": tot["span_s"] - tot["busy_s"],
            "host_cycle_s": (cuts[-1] - cuts[0]) * 1e-9 / max(n - 1, 1)}


def predict(name: str, batch: int, cluster: Any) -> dict[str, Any]:
    """`gpu_sweep`'s one-device prediction's op times by kind: a conv's family by `conv_kind`
    and its window (a kernel gradient's: its result's), its pass by `conv_grad_bytes` (a
    kernel gradient) and name stack (an input gradient is under `transpose`)."""
    import jax.numpy as jnp

    from benchmarks.gpu.gpu_sweep import predict_point
    from benchmarks.models import zoo
    from jaxwap.analysis.flatten import flatten
    from jaxwap.analysis.trace import layout_of
    from jaxwap.cost.op_time import op_times, relayout_times

    w = zoo.WORKLOADS[name](batch_size=batch, dtype=jnp.bfloat16)
    planned, r, _ = predict_point(w, cluster, cluster)
    g, prog = planned.graph, flatten(layout_of(w.step, w.args, {}, w.params, None)[1])
    if len(prog.ops) != len(g.flops):
        raise RuntimeError(f"{name}: the plan's graph is not the step as written")
    times = op_times(g, cluster, 1.0)
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for k, op in enumerate(prog.ops):
        eqn, kind = op.eqn, ""
        if g.conv[k]:
            dn, grad = eqn.params["dimension_numbers"], bool(g.conv_grad_bytes[k])
            v, spec = (eqn.outvars[0], dn.out_spec) if grad else (eqn.invars[1], dn.rhs_spec)
            fam = "first layer" if g.conv[k] == 3 else "1x1" if all(
                v.aval.shape[d] == 1 for d in spec[2:]) else "3x3+"
            kind = f"conv {fam} " + ("kernel gradient" if grad else "input gradient" if
                                     "transpose" in str(eqn.source_info.name_stack) else "forward")
        elif op.prim == "dot_general":
            kind = "matmul (batched)" if eqn.params["dimension_numbers"][1][0] else "matmul"
        elif g.window_taps[k] or g.window_grad_elems[k]:
            kind = "pooling forward" if g.window_taps[k] else "pooling gradient"
        elif op.prim.startswith(("gather", "scatter")):
            kind = "gather, scatter"
        elif times[k] > 0:
            kind = "fusion (reduction)" if g.reduced[k] else "fusion (elementwise)"
        for kd in (kind, FUSED)[:1 + kind.startswith("fusion")] if kind else ():
            for key, val in (("s", times[k]), ("ops", 1), ("bytes", g.bytes[k])):
                out[kd][key] += float(val)
    out[LAYOUT]["s"] += (p := r.predicted).layout_change_time_s
    out["fresh memory (model's term)"]["s"] += p.fresh_memory_time_s
    flag_on = type(cluster)(dataclasses.replace(cluster.device, relayouts_batched_dots=True), 1)
    return {"kinds": dict(out), "step_s": float(p.step_time_s),
            "kernels": float(g.kernels.sum()),
            "dot_relayout_bytes": float(g.dot_relayout_bytes.sum()),
            "dot_relayout_s_if_priced": float(relayout_times(g, flag_on, 1.0).sum())}


def rates(ops: list[dict[str, Any]], spec: Any) -> dict[str, dict[str, Any]]:
    """Per conv family (and pass) and matmul kind: compiled flops and bytes, measured time,
    its share of the calibrated matmul curve and of the bandwidth, the higher floor."""
    out: dict[str, dict[str, Any]] = {}
    for op in (op for op in ops if "flops" in op):
        mm = (w := op["flops"]) / (spec.peak_flops * float(spec.matmul_eff(w, spec.peak_flops)))
        for key in ((op["family"], f"{op['family']} {op['pass']}") if "family" in op
                    else (op["kind"],)):
            acc = out.setdefault(key, dict.fromkeys(("ops", "s", "flops", "bytes", "mm_s"), 0.0))
            for k, v in (("ops", 1), ("s", op["s"]), ("flops", w), ("bytes", op["bytes"]),
                         ("mm_s", mm + spec.kernel_overhead_s)):
                acc[k] += v
    for a in out.values():
        a.update(share=a["mm_s"] / a["s"], bw_share=a["bytes"] / spec.memory_bandwidth / a["s"],
                 bound="memory" if a["bytes"] / spec.memory_bandwidth > a["mm_s"] else "compute")
    return out


def batched_dot_relayouts(per_op: dict[str, Any], instrs: dict[str, Instr]) -> dict[str, Any]:
    """The copy and transpose kernels that make a batched matmul's operands or read its
    result (through bitcasts and tuple elements): what XLA:GPU relayouts around them."""
    readers: dict[str, list[str]] = defaultdict(list)
    for ins, o in ((x, o) for x in instrs.values() for o in x.operands):
        readers[o].append(ins.name)

    def near(names: list[str], up: bool) -> set[str]:
        thru = {n for n in names if instrs[n].opcode in ("bitcast", "get-tuple-element")}
        nxt = [x for n in thru for x in (instrs[n].operands[:1] if up else readers[n])]
        return {n for n in names if per_op.get(n, {}).get("kind") == LAYOUT} | (
            near(nxt, up) if nxt else set())
    dots = [n for n, op in per_op.items() if op["kind"] == "matmul (batched)"]
    before = near([o for d in dots for o in instrs[d].operands], True)
    found = before | near([x for d in dots for x in readers[d]], False)
    return {"batched_dots": len(dots), "dot_s": sum(per_op[d]["s"] for d in dots),
            "operand_ops": len(before), "result_ops": len(found - before), "ops": len(found),
            "s": sum(per_op[m]["s"] for m in found),
            "bytes_written": sum(nbytes(instrs[m].arrays()) for m in found),
            "names": sorted({re.sub(r"\.\d+$", "", m) for m in found})}


def ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def table(head: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(str(c) for c in r) + " |" for r in rows), ""]


def answers(rows: list[dict[str, Any]], spec: Any) -> list[str]:
    """The four questions' figures, each labelled by where it comes from."""
    by, out = {r["model"]: r for r in rows}, ["## Answers", ""]
    if "gpt2" in by:
        p, q = by["gpt2"]["predicted"], (m := by["gpt2"]["measured"])["batched_dot_relayouts"]
        out += ["### 1. Batched matmuls' operands (GPT-2)", "",
                f"Measured (trace), compiled (HLO): {q['batched_dots']} batched matmuls run "
                f"{ms(q['dot_s'])} ms/step; {q['ops']} copy/transpose kernels "
                f"({', '.join(q['names'])}) make their operands ({q['operand_ops']}) or read "
                f"only their results ({q['result_ops']}): {ms(q['s'])} ms/step, "
                f"{q['bytes_written'] / 1e9:.2f} GB written, of {ms(m['kinds'][LAYOUT]['s'])} "
                f"ms/step of copies and transposes. Predicted (model): the graph counts "
                f"{p['dot_relayout_bytes'] / 1e9:.2f} GB of such relayouts, priced only where "
                f"relayouts_batched_dots (here {spec.relayouts_batched_dots}): "
                f"{ms(p['kinds'][LAYOUT]['s'])} ms/step of layout changes priced in all, "
                f"{ms(p['dot_relayout_s_if_priced'])} ms with the flag on.", ""]
    cols = ("pooling gradient", "pooling forward", "forward", "input gradient", "kernel gradient")
    out += ["### 2. Pooling gradients against convolutions (ms/step; GB: the tables above)",
            "", *table(["model", "", *cols[:2], *(f"conv {c}" for c in cols[2:])],
        [[r["model"], side, *(ms(sum(v["s"] for k, v in r[side]["kinds"].items() if k == c
                                     or k.startswith("conv") and k.endswith(c))) for c in cols)]
         for r in rows if "pooling gradient" in r["measured"]["kinds"]
         for side in ("measured", "predicted")]),
        "### 3. Convolutions' share of the calibrated bf16 matmul rate", "",
        f"Share: compiled flops priced on the calibrated matmul curve ({spec.peak_flops / 1e12:.0f}"
        " Tflop/s, launch included, as `conv_probe.py` prices them) over the measured time. GB: "
        "input + kernel + output (compiled; a floor), at the calibrated "
        f"{spec.memory_bandwidth / 1e9:.0f} GB/s over the measured time: the bandwidth share; "
        "bound: the higher floor. Matmuls (operands and result) for reference. These are per "
        "kernel; `conv_probe.py` times whole value_and_grad programs (the loss's kernels and "
        "the dispatch too), which lowers its shares most for short convolutions.", "",
        *table(["model", "family / pass", "ops", "measured ms/step", "Gflop", "GB",
                "share of matmul rate", "bandwidth share", "bound"],
               [[r["model"], k, f"{a['ops']:.0f}", ms(a["s"]), f"{a['flops'] / 1e9:.0f}",
                 f"{a['bytes'] / 1e9:.2f}", f"{a['share']:.2f}", f"{a['bw_share']:.2f}",
                 a["bound"]] for r in rows for k, a in sorted(r["rates"].items())]),
        "### 4. What the model under-prices (predicted - measured, ms/step)", ""]
    for r in (by[n] for n in ("resnet50", "gpt2") if n in by):
        m, p = r["measured"], r["predicted"]
        d = sorted((p["kinds"].get(k, {}).get("s", 0.0) - m["kinds"].get(k, {}).get("s", 0.0), k)
                   for k in {*p["kinds"], *m["kinds"]} if not k.startswith("fusion ("))
        slow = sorted(((op, rates([op], spec)[op.get("family", op["kind"])])
                       for op in m["per_op"].values() if "flops" in op),
                      key=lambda x: x[1]["mm_s"] - x[0]["s"])[:3]
        out.append(
            f"- {r['model']}: predicted {ms(p['step_s'])} ms against {ms(r['step_s'])} waited "
            f"({p['step_s'] / r['step_s'] - 1:+.0%}), {ms(r['queued_s'])} queued "
            f"({p['step_s'] / r['queued_s'] - 1:+.0%}) and {ms(m['kernel_sum_s'])} of kernels "
            f"in the trace ({p['step_s'] / m['kernel_sum_s'] - 1:+.0%}), which idled "
            f"{ms(m['idle_in_step_s'])} ms between kernels and {ms(m['gap_between_steps_s'])} "
            "ms between steps (the host's dispatch and wait: the model prices neither). By "
            "kind, most under-priced first: " + "; ".join(
                f"{k} {v * 1e3:+.2f}" for v, k in d if abs(v) >= 5e-5) + ". Furthest below "
            "the calibrated matmul curve (measured ms/step at its share): " + "; ".join(
                f"{op['kind']} {'x'.join(map(str, op.get('shape', [])))}".strip()
                + f" {ms(op['s'])} at {a['share']:.2f}" for op, a in slow) + ".")
    return out + [""]


def markdown(rec: dict[str, Any]) -> str:
    s = rec["spec"]
    out = [f"# Where the GPU step went: {rec['device']}", "", f"Command: `{rec['command']}` "
           f"({rec['date_utc']}; traces: jax {rec['jax']}, XLA:GPU, bf16, 3 training steps "
           "each, `gpu_sweep.py --trace`). **Measured (trace)**: kernel time per step, each "
           "kernel mapped to the HLO op that launched it. **Compiled (HLO)**: flops and bytes "
           "from the program's shapes (bytes: each op's operands and results, a library call's "
           "workspace left out). **Predicted (model)**: jaxwap's per-op times, the "
           f"planner's one-device candidate, calibrated profile ({s['peak_flops'] / 1e12:.0f} "
           f"Tflop/s bf16, {s['memory_bandwidth'] / 1e9:.0f} GB/s, convolutions at "
           f"{s['conv_efficiency']:.2f}, first layers {s['narrow_conv_efficiency']:.3f} of the "
           "matmul rate). jaxpr ops and XLA kernels are not one to one (XLA fuses elementwise "
           "ops into reductions, a cuDNN call runs several kernels, select-and-scatter an argmax "
           f"reduce-window, a scatter, a copy): compare by kind, fusions together ('{FUSED}').", ""]
    for r in rec["rows"]:
        m, p = r["measured"], r["predicted"]
        out += [f"## {r['model']}, batch {r['batch']}", "",
                f"Step: measured {ms(r['step_s'])} ms waited, {ms(r['queued_s'])} queued "
                f"(rows.jsonl). Trace (measured): a step every {ms(m['host_cycle_s'])} ms; "
                f"kernels {ms(m['kernel_sum_s'])} ms (their union {ms(m['busy_s'])}), idle "
                f"between kernels {ms(m['idle_in_step_s'])} ms of the {ms(m['span_s'])} ms "
                f"span, {ms(m['gap_between_steps_s'])} ms between steps. Predicted (model): "
                f"{ms(p['step_s'])} ms, {p['kernels']:.0f} kernels.", "",
                *table(["kind", "measured kernels/step", "measured ms/step", "predicted ops",
                        "predicted ms/step", "predicted - measured", "GB: compiled / model's"],
                       [[k, f"{a['kernels']:.0f}", ms(a["s"]), f"{b['ops']:.0f}", ms(b["s"]),
                         f"{(b['s'] - a['s']) * 1e3:+.2f}", f"{a.get('bytes', 0) / 1e9:.2f} / "
                         f"{b.get('bytes', 0) / 1e9:.2f}"] for k in KINDS
                        if k in m["kinds"] or k in p["kinds"]
                        for a, b in [(m["kinds"].get(k, {"s": 0.0, "kernels": 0}),
                                      p["kinds"].get(k, {"s": 0.0, "ops": 0}))]])]
    return "\n".join(out + rec["answers"]) + "\n"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("source", help="gpu_sweep's work folder (gpu_sweep_work/) or its .tgz")
    ap.add_argument("--models", default="alexnet,gpt2,vgg16,resnet50")
    ap.add_argument("--out", default=str(harness.results_dir("gpu_trace")))
    args = ap.parse_args()
    import jaxwap
    from benchmarks.gpu.gpu_sweep import recorded_spec
    from jaxwap.hardware.calibration import Calibration

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.source)
        if work.is_file():
            with tarfile.open(work) as t:
                t.extractall(tmp, filter="data")
            work = next(Path(tmp).rglob("calibration.json")).parent
        raw = json.loads((work / "calibration.json").read_text())
        cal = Calibration.from_dict(raw)
        cal = dataclasses.replace(cal, spec=recorded_spec(raw)[0])   # today's backend flags
        measured = [json.loads(x) for x in (work / "rows.jsonl").read_text().splitlines()]
        rows = []
        for trace in (t for n in args.models.split(",")
                      for t in sorted(work.glob(f"trace_{n}_*.xplane.pb"))[:1]):
            stem = trace.parent / trace.name.removesuffix(".xplane.pb")
            name, batch = stem.name.removeprefix("trace_").rsplit("_", 1)
            row = next(x for x in measured if x["model"] == name and x["batch"] == int(batch))
            rows.append({"model": name, "batch": int(batch), "measured": (m := measure(stem)),
                         "step_s": row["measured"]["step_time_s"],
                         "queued_s": row["measured"]["queued_step_time_s"],
                         "predicted": predict(name, int(batch), jaxwap.Cluster(cal.spec, 1)),
                         "rates": rates(list(m["per_op"].values()), cal.spec)})
    rec = {"command": ".venv/bin/" + harness.command(MODULE),
           "device": cal.device_kind, "jax": cal.jax_version,
           "date_utc": harness.date_utc(minutes=True),
           "basis": "measured: the trace; compiled: the HLO's shapes; predicted: jaxwap's model",
           "spec": cal.spec.to_dict(), "rows": rows, "answers": answers(rows, cal.spec)}
    stem = Path(args.out) / re.sub(r"\W", "-", cal.device_kind.lower())
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(markdown(rec))   # before the JSON drops the short ops
    for r in rows:   # the record keeps each model's 40 longest ops
        ops = sorted(r["measured"].pop("per_op").items(), key=lambda kv: -kv[1]["s"])
        r["measured"]["longest_ops"] = dict(ops[:40])
    harness.write_record(stem, rec)
    print(f"wrote {stem}.json, .md")


if __name__ == "__main__":
    main()
