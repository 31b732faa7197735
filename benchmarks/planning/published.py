"""Expert plans at scale: jaxwap's own plans for published large-model runs, each model
written twice, beside the published step.

    python -m benchmarks.planning.published            # every row (minutes)
    python -m benchmarks.planning.published --quick    # two small rows (the test's)
    python -m benchmarks.planning.published --only 18.4B

The yardstick is what experts reached by hand on the same job: Megatron-LM's GPT runs on
A100-80GB (Narayanan et al., SC'21, Table 1: 1.7 B on 32 GPUs to 1 T on 3,072),
MaxText's Llama-3-70B on 128-2,048 H100s (NVIDIA's DGX Cloud benchmarking recipe),
MosaicML's measured FSDP runs of MPT-30B and MPT-70B on 8-64 A100-80GB (llm-foundry's
benchmark table: the yardstick for plans that shard everything over data) and
Llama 3's 405B on 8,192 H100s (the Llama 3 paper's Table 4: 126 layers, which no power
of two of stages divides, on 16 stages). Each model is written twice:

- **expert**: as its experts write it: the blocks stacked and run by `lax.scan`, each
  block checkpointed (`nn.remat`, full recomputation, as Megatron's and MaxText's runs
  do), and on H100s
  cuDNN's fused attention (MaxText's `cudnn_flash_te`);
- **newcomer**: a Python loop over the blocks, no remat, attention written out (XLA's).

Neither is told a layout: `jaxwap.plan(..., objective="throughput", verify=0)` on a
cluster of the built-in profile with 8 GPUs a node (NVLink inside, 25 GB/s of
InfiniBand a GPU between nodes for the A100 runs, as the paper's; the profile's 50 GB/s
for the H100s) chooses the mesh, the schedule, the remat policy and the micro-batches.
The plan's step is **predicted** (nothing runs), the published step is **published**
(Megatron's from its Tflop/s per GPU and the paper's flop count, which counts the
recomputation: 96 B s l h^2 (1 + s/6h + V/16lh); Llama 3's from its TFLOP/s per GPU and
PaLM's model-flop count, `palm_flops`; MosaicML's from its measured tokens per second),
the planning time **measured** on the
machine running this. The "balanced" and "energy" columns are what those objectives pick
among the same plan's candidates (its meshes and power limits), ranked by the planner's
own rankers. "Published layout predicted" is the expert's model planned on the experts'
mesh and stage count (the rest still jaxwap's choice): the model's error on their own
layout, apart from what the plan's layout changes.

Writes `benchmarks/results/published/cpu.{json,md}`.
"""

from __future__ import annotations

import os
import re

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import jaxwap  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.accuracy.published_devices import megatron_flops  # noqa: E402
from benchmarks.models import zoo  # noqa: E402
from jaxwap.core.objective import Objective  # noqa: E402
from jaxwap.hardware.builtin_profiles import device_spec  # noqa: E402

RESULTS = harness.results_dir("published")
GB = 1e9
#: the goals: predicted / published step
EXPERT_RANGE, NEWCOMER_RANGE = (0.85, 1.15), (0.85, 1.25)
PLANNING_GOAL_S = 10.0
WRITINGS = ("expert", "newcomer")

MEGATRON = ("Narayanan et al., SC'21, Table 1 (A100-80GB, NVLink 300 GB/s, 25 GB/s "
            "InfiniBand per GPU, seq 2048, vocab 51,200, full recomputation)")
MAXTEXT = ("NVIDIA dgxc-benchmarking, MaxText Llama3 70B recipe 25.02 (catalog.ngc.nvidia.com"
           "/orgs/nvidia/teams/dgxc-benchmarking/resources/maxtext-llama3-70b-dgxc-"
           "benchmarking-d): BF16, seq 8192, 2 sequences per GPU, FSDP over 128 GPUs and "
           "data parallel beyond")
MOSAIC = ("MosaicML llm-foundry, scripts/train/benchmarking/README.md, table \"A100 80GB with "
          "1600 Gbps node-node interconnect (RoCE)\" (25 GB/s a GPU): MPT pretraining with "
          "FSDP FULL_SHARD, activation checkpointing, bf16, seq 2048 (model shapes from "
          "scripts/train/yamls/pretrain/mpt-*.yaml); step = the global batch's tokens over "
          "the measured tokens per second")
LLAMA3 = ("Llama Team, Meta, The Llama 3 Herd of Models (2024), Table 4: Llama 3 405B on "
          "8,192 H100s (RoCE, 400 Gb/s per GPU), TP8 x CP1 x PP16 x DP64, seq 8192, 16M "
          "tokens a batch, 430 TFLOP/s per GPU (BF16 MFU 43%); step from the PaLM model-"
          "flop count, 6N + 12 L H Q T per token (a causal count, half the attention term, "
          "makes it 4% shorter)")


@dataclass(frozen=True)
class Job:
    """One published run: the model's shape, the cluster and batch, the published step
    and the layout its experts chose (for the table; the planner is not told it)."""

    name: str
    family: str                  # "megatron", "maxtext", "mosaic" or "llama3"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    gpus: int
    global_batch: int
    hardware: str
    published_step_s: float
    published_layout: str
    source: str
    inter_node_gbs: float | None = None
    #: the published layout as `jaxwap.plan` options (mesh_shape, pipeline)
    layout: tuple[tuple[str, Any], ...] = ()

    def workload(self, written: str, global_batch: int | None = None) -> Any:
        """The model as written `written` ("expert" or "newcomer") at `global_batch`."""
        expert = written == "expert"
        return zoo.llama(
            "llama_8b", batch_size=global_batch or self.global_batch, seq_len=self.seq,
            scan=expert, remat=expert,
            attention="cudnn" if expert and self.hardware.startswith("h100") else "xla",
            layers=self.layers, d_model=self.hidden, heads=self.heads,
            kv_heads=self.kv_heads, ffn=self.ffn, vocab=self.vocab)

    def cluster(self) -> jaxwap.Cluster:
        kw = {} if self.inter_node_gbs is None else {
            "inter_node_bandwidth": self.inter_node_gbs * GB}
        return jaxwap.Cluster(device_spec(self.hardware), self.gpus, devices_per_node=8, **kw)


def _gpt(params_b: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int,
         batch: int, tflops: float) -> Job:
    """A Table 1 row: GPT with Megatron's 4h MLP written as Llama's SwiGLU of 8h/3 rounded
    to 256 (the same flops within 1%), vocab 51,200, seq 2048."""
    step = batch * megatron_flops(layers, hidden) / (tflops * 1e12 * gpus)
    dp = gpus // (tp * pp)
    layout = (("mesh_shape", {"data": dp, "model": tp}),
              ("pipeline", {"stages": pp} if pp > 1 else False))
    return Job(f"GPT {params_b}B, {gpus} A100", "megatron", layers, hidden, heads, heads,
               256 * round(8 * hidden / 3 / 256), 51200, 2048, gpus, batch, "a100-sxm-80gb",
               step, f"TP{tp} x PP{pp} x DP{dp}", MEGATRON, 25.0, layout)


def megatron_jobs() -> list[Job]:
    return [_gpt("1.7", 24, 2304, 24, 1, 1, 32, 512, 137),
            _gpt("3.6", 32, 3072, 30, 2, 1, 64, 512, 138),
            _gpt("7.5", 32, 4096, 36, 4, 1, 128, 512, 142),
            _gpt("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135),
            _gpt("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138),
            _gpt("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140),
            _gpt("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148),
            _gpt("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155),
            _gpt("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163),
            _gpt("1008", 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def maxtext_jobs() -> list[Job]:
    published = {128: 15.563, 256: 15.444, 512: 15.519, 1024: 15.603, 2048: 15.898}
    return [Job(f"Llama-3-70B, {n} H100", "maxtext", 80, 8192, 64, 8, 28672, 128256, 8192,
                n, 2 * n, "h100-sxm", s,
                f"FSDP{n if n <= 256 else 128}" + (f" x DP{n // 128}" if n > 256 else ""),
                MAXTEXT, layout=(("mesh_shape", {"data": n} if n <= 256 else
                                  {"replica": n // 128, "data": 128}),
                                 ("pipeline", False)))
            for n, s in published.items()]


def mosaic_jobs() -> list[Job]:
    """MosaicML's measured FSDP runs (ZeRO-3 over every GPU, nothing else) of MPT on
    A100-80GB, on a node and on 4 and 8 nodes over 25 GB/s a GPU: the yardstick for plans
    that shard everything over data, as jaxwap's plans of Megatron's mid-size jobs do.
    MPT's 4h GELU MLP is written as Llama's SwiGLU of 8h/3 rounded to 256 (the same flops
    within 1%); its ALiBi, LayerNorm and tied embedding as rotary, RMSNorm and an untied
    head (0.6% more parameters at 70 B). The step is the global batch over the measured
    throughput, whatever micro-batches MosaicML ran it in."""
    def job(name: str, layers: int, hidden: int, heads: int, gpus: int, batch: int,
            tokens_per_s: float) -> Job:
        return Job(f"MPT-{name}, {gpus} A100", "mosaic", layers, hidden, heads, heads,
                   256 * round(8 * hidden / 3 / 256), 50368, 2048, gpus, batch,
                   "a100-sxm-80gb", batch * 2048 / tokens_per_s, f"FSDP{gpus}", MOSAIC,
                   25.0, (("mesh_shape", {"data": gpus}), ("pipeline", False)))
    return [job("30B", 48, 7168, 56, 8, 504, 7330),
            job("70B", 80, 8192, 64, 32, 1024, 11962),
            job("70B", 80, 8192, 64, 64, 2048, 26274)]


def palm_flops(params: float, layers: int, heads: int, head_dim: int, seq: int) -> float:
    """One sequence's model flops as PaLM's MFU counts them (Chowdhery et al., 2022, App.
    B): 6N per token for the weights and 12 L H Q T for attention, no recomputation."""
    return seq * (6 * params + 12 * layers * heads * head_dim * seq)


def llama3_jobs() -> list[Job]:
    """Llama 3's 405B pretraining at 8,192 H100s (its Table 4): 126 layers of 16,384, a
    stack no power of two of stages divides, on Meta's layout of 16 stages."""
    layers, hidden, heads, kv, ffn, vocab, seq = 126, 16384, 128, 8, 53248, 128256, 8192
    hd = hidden // heads
    params = layers * (2 * hidden * hidden + 2 * hidden * kv * hd + 3 * hidden * ffn
                       + 2 * hidden) + 2 * vocab * hidden + hidden
    gpus, batch = 8192, 2048
    step = batch * palm_flops(params, layers, heads, hd, seq) / (430e12 * gpus)
    return [Job("Llama-3.1-405B, 8192 H100", "llama3", layers, hidden, heads, kv, ffn, vocab,
                seq, gpus, batch, "h100-sxm", step, "TP8 x PP16 x DP64", LLAMA3,
                layout=(("mesh_shape", {"data": 64, "model": 8}),
                        ("pipeline", {"stages": 16})))]


def all_jobs() -> list[Job]:
    return megatron_jobs() + maxtext_jobs() + mosaic_jobs() + llama3_jobs()


def quick_jobs() -> list[tuple[Job, int | None]]:
    """Two small rows for CI: the smallest Megatron job (1.7 B on 32 GPUs), written each
    way."""
    return [(megatron_jobs()[0], None)]


# ------------------------------------------------------------------------------ planning
def _choice(c: Any) -> dict[str, Any]:
    p = c.predicted
    return {"mesh": dict(c.mesh_shape), "devices": _devices(dict(c.mesh_shape)),
            "power_limit_w": c.power_limit_w, "step_s": float(p.step_time_s),
            "energy_j": float(p.energy_per_step_j)}


def _devices(mesh: dict[str, int]) -> int:
    n = 1
    for v in mesh.values():
        n *= v
    return n


def by_objective(plan: jaxwap.Plan, cluster: jaxwap.Cluster) -> dict[str, dict[str, Any]]:
    """What each objective picks among the plan's fitting candidates (their meshes and
    power limits), by the planner's own ranking."""
    fitting = [c for c in plan.candidates if c.fits]
    out = {}
    for objective in ("balanced", "energy"):
        best = cluster.ranker(Objective.parse(objective))([c.predicted for c in fitting]).best
        out[objective] = _choice(fitting[best])
    return out


def run(job: Job, written: str, global_batch: int | None = None) -> dict[str, Any]:
    """Plan `job` written `written`; the row of the table."""
    batch = global_batch or job.global_batch
    w = job.workload(written, batch)
    hw = job.cluster()
    published = job.published_step_s * batch / job.global_batch
    base = {"job": job.name, "written": written, "gpus": job.gpus, "global_batch": batch,
            "hardware": hw.device.name, "published_step_s": published,
            "published_layout": job.published_layout, "source": job.source,
            "model": w.description}
    t0 = time.perf_counter()
    try:
        plan = jaxwap.plan(w.step, *w.args, params=w.params, hardware=hw, verify=0,
                           cache=False, objective="throughput")
    except (MemoryError, ValueError) as e:     # no plan: a row of its own, a miss
        return {**base, "planning_s": time.perf_counter() - t0, "no_plan": str(e),
                "step_s": None, "ratio": None}
    planning_s = time.perf_counter() - t0
    step = plan.step
    pred = plan.predicted
    as_published = _as_published(job, w, hw, published) if written == "expert" else None
    return {**base, "planning_s": planning_s, "no_plan": None, "as_published": as_published,
            "mesh": dict(plan.mesh_shape), "devices": _devices(dict(plan.mesh_shape)),
            "strategies": sorted({p.strategy for p in plan.params}),
            "stages": step.stages, "repeats": getattr(step, "repeats", 1),
            "micro_batches": step.micro_batches, "remat": step.remat,
            "step_s": float(pred.step_time_s), "ratio": float(pred.step_time_s) / published,
            "peak_memory_gb": float(pred.peak_memory_bytes) / GB,
            "energy_j": float(pred.energy_per_step_j), "objectives": by_objective(plan, hw)}


def _as_published(job: Job, w: Any, hw: jaxwap.Cluster, published: float
                  ) -> dict[str, Any]:
    """The expert's model planned on the published layout (its mesh and stage count; the
    layouts of its parameters, the schedule and micro-batches still jaxwap's): how far
    the model's prediction of the experts' own layout is from their step, apart from how
    the plan's layout differs from theirs."""
    try:
        plan = jaxwap.plan(w.step, *w.args, params=w.params, hardware=hw, verify=0,
                           cache=False, objective="throughput", **dict(job.layout))
    except (MemoryError, ValueError) as e:
        return {"step_s": None, "ratio": None, "no_plan": str(e)}
    step_s = float(plan.predicted.step_time_s)
    return {"step_s": step_s, "ratio": step_s / published, "no_plan": None,
            "schedule": plan.step.describe()}


# ------------------------------------------------------------------------------ the table
def in_goal(r: dict[str, Any]) -> bool:
    lo, hi = EXPERT_RANGE if r["written"] == "expert" else NEWCOMER_RANGE
    return r["ratio"] is not None and lo <= r["ratio"] <= hi


def plan_text(r: dict[str, Any]) -> str:
    if r["no_plan"]:
        need = re.search(r"the smallest, mesh (.*?), needs ([0-9.]+ [kMGT]?B) per device",
                         r["no_plan"])
        return (f"no plan: the smallest, {need.group(1)}, needs {need.group(2)} a device"
                if need else f"no plan: {r['no_plan'][:140]}")
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
    parts = [mesh]
    if r["stages"] > 1:
        parts.append(f"{r['stages']} stages")
    if r["micro_batches"] > 1:
        parts.append(f"{r['micro_batches']} micro-batches")
    if r["remat"] != "none":
        parts.append(f"remat {r['remat']}")
    return "; ".join(parts)


def _published_text(r: dict[str, Any]) -> str:
    a = r.get("as_published")
    if not a:
        return "-"
    if a["no_plan"]:
        need = re.search(r"needs ([0-9.]+ [kMGT]?B) per device", a["no_plan"])
        return "no plan" + (f" (needs {need.group(1)} a device)" if need else "")
    return f"{a['step_s']:.2f} s ({a['ratio']:.2f}x)"


def _objective_text(r: dict[str, Any], objective: str) -> str:
    if r["no_plan"]:
        return "-"
    c = r["objectives"][objective]
    cap = f", {c['power_limit_w']:.0f} W" if c["power_limit_w"] else ""
    return f"{c['devices']} GPUs{cap}: {c['step_s']:.2f} s, {c['energy_j'] / 1e3:,.1f} kJ"


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for written in WRITINGS:
        rows = [r for r in results if r["written"] == written]
        planned = [r for r in rows if r["ratio"] is not None]
        out[written] = {
            "rows": len(rows), "planned": len(planned),
            "in_goal": sum(in_goal(r) for r in rows),
            "median_ratio": statistics.median(r["ratio"] for r in planned) if planned else None,
            "max_planning_s": max(r["planning_s"] for r in rows) if rows else None}
    out["planned_within_goal_s"] = sum(r["planning_s"] <= PLANNING_GOAL_S for r in results)
    return out


def markdown(results: list[dict[str, Any]], command: str) -> str:
    s = summary(results)
    lines = [
        "# Expert plans at scale: jaxwap's plans against published runs", "",
        f"Command: `{command}`. **Predicted**: the plan's step (`jaxwap.plan(..., "
        "objective=\"throughput\", verify=0)`, nothing ran). **Published**: the run's step "
        "(Megatron's and Llama 3's from their Tflop/s per GPU, MosaicML's from its measured "
        "tokens per second). Planning time **measured** on this machine "
        "(see the record's `cpu`). Expert: scanned blocks, per-block remat, cuDNN attention "
        "on H100s; newcomer: unrolled blocks, no remat, XLA attention. Goals: expert "
        f"{EXPERT_RANGE[0]}-{EXPERT_RANGE[1]}x, newcomer {NEWCOMER_RANGE[0]}-"
        f"{NEWCOMER_RANGE[1]}x, planning <= {PLANNING_GOAL_S:g} s.", "",
        "| job | written | published layout | jaxwap's plan (throughput) | planning s | "
        "predicted step s | published step s | ratio | published layout predicted | "
        "balanced picks | energy picks |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        pred = "-" if r["step_s"] is None else f"{r['step_s']:.2f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x" + (
            "" if in_goal(r) else " (miss)")
        lines.append(
            f"| {r['job']} | {r['written']} | {r['published_layout']} | {plan_text(r)} | "
            f"{r['planning_s']:.1f} | {pred} | {r['published_step_s']:.2f} | {ratio} | "
            f"{_published_text(r)} | {_objective_text(r, 'balanced')} | "
            f"{_objective_text(r, 'energy')} |")
    lines.append("")
    for written in WRITINGS:
        w = s[written]
        if not w["rows"]:                   # --written: the other writing was not run
            continue
        med = "-" if w["median_ratio"] is None else f"{w['median_ratio']:.2f}x"
        lines.append(f"- {written}: {w['planned']} of {w['rows']} rows planned, "
                     f"{w['in_goal']} within the goal, median ratio {med}, slowest planning "
                     f"{w['max_planning_s']:.1f} s")
    lines += [f"- {s['planned_within_goal_s']} of {len(results)} rows planned within "
              f"{PLANNING_GOAL_S:g} s", "", "Sources:", ""]
    lines += [f"- {src}" for src in dict.fromkeys(r["source"] for r in results)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = harness.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="two small rows (CI)")
    p.add_argument("--only", help="jobs whose name contains this")
    p.add_argument("--written", choices=WRITINGS, help="one way of writing only")
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument("--render", action="store_true",
                   help="rewrite the saved record's table from its rows (no planning)")
    args = p.parse_args(argv)
    if args.render:
        record = json.loads((RESULTS / "cpu.json").read_text())
        text = markdown(record["rows"], record["command"])
        (RESULTS / "cpu.md").write_text(text)
        print(text)
        return record
    jobs = quick_jobs() if args.quick else [(j, None) for j in all_jobs()]
    if args.only:
        jobs = [(j, b) for j, b in jobs if args.only in j.name]
    results = []
    for job, batch in jobs:
        for written in WRITINGS if args.written is None else (args.written,):
            r = run(job, written, batch)
            results.append(r)
            ratio = "" if r["ratio"] is None else f" ({r['ratio']:.2f}x)"
            print(f"{r['job']}, {written}: {plan_text(r)}; predicted "
                  f"{r['step_s'] or float('nan'):.2f} s against {r['published_step_s']:.2f} "
                  f"published{ratio}; planned in {r['planning_s']:.1f} s", flush=True)
    command = harness.command("benchmarks.planning.published", argv)
    record = {**harness.environment("benchmarks.planning.published", argv),
              "summary": summary(results), "rows": results}
    text = markdown(results, command)
    print(text)
    if not (args.no_save or args.quick or args.only or args.written):
        harness.write_record(RESULTS / "cpu", record, text)
    return record


if __name__ == "__main__":
    main()
