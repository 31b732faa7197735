"""The built-in profiles against published training throughputs on GPUs nobody here measured.

    python -m benchmarks.accuracy.published_devices           # every row (minutes)
    python -m benchmarks.accuracy.published_devices --quick   # two small rows (the test's)

Each row is a published training run (img/s, tokens/s per GPU, or Tflop/s per GPU, as
the source prints it, labelled **published**) beside what jaxwap's model **predicts** for
the same job: the same model written in Flax, the same global batch, precision and GPU
count, laid out as the run laid it out (data parallel for the CNNs, FSDP for torchtitan,
Megatron's tensor x data mesh), planned with `jaxwap.plan(..., verify=0)` for a cluster
of the built-in profile (`jaxwap/hardware/builtin_profiles.py`; docs/guide/profiles.md
says where each of its figures comes from). None of these rows was used to set a
profile's figure: the profiles are datasheets times shares measured on an H100 and an
H200 here (carried to the A100 and V100 by stated rules) and published GEMM
microbenchmarks. Planning time is **measured** on this machine.

Each row names what differs between the published run and the model, which the error
includes rather than hides: the framework (PyTorch, eager or compiled, against XLA), the
kernels (cuDNN's grouped convolutions, fused attention), the data loader.

Writes `benchmarks/results/published_devices/cpu.{json,md}`.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import jaxwap  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.models import zoo  # noqa: E402
from jaxwap.cost.prediction import at_power_limit  # noqa: E402
from jaxwap.hardware.builtin_profiles import device_spec  # noqa: E402

RESULTS = harness.results_dir("published_devices")
GOAL_MEDIAN, GOAL_WORST = 0.15, 0.30
GB = 1e9


@dataclass(frozen=True)
class Row:
    """One published run and how to plan the same job.

    `build(global_batch)` makes the workload; `figure(prediction, row)` turns the
    predicted step into the figure the source prints (`unit`)."""

    job: str
    build: Callable[[int], Any]
    batch_per_gpu: int
    gpus: int
    hardware: str
    unit: str
    published: float
    source: str
    differences: tuple[str, ...]
    mesh: dict[str, int] | None = None
    strategies: tuple[str, ...] | None = None
    power_limit_w: float | None = None
    memory_gb: float | None = None
    tokens_per_sample: int = 1
    flops_per_sample: float | None = None
    devices_per_node: int = 8
    inter_node_gbs: float | None = None

    @property
    def global_batch(self) -> int:
        return self.batch_per_gpu * self.gpus


def cluster(row: Row) -> jaxwap.Cluster:
    spec = device_spec(row.hardware)
    if row.memory_gb is not None:      # the same GPU with less memory (a V100 16 GB)
        spec = dataclasses.replace(spec, name=f"{spec.name} ({row.memory_gb:g} GB)",
                                   memory_bytes=row.memory_gb * GB)
    kw = {} if row.inter_node_gbs is None else {"inter_node_bandwidth": row.inter_node_gbs * GB}
    return jaxwap.Cluster(spec, row.gpus, devices_per_node=min(row.devices_per_node, row.gpus),
                          **kw)


def predicted_figure(row: Row, step_s: float) -> float:
    """The figure the source prints, from the predicted step time."""
    if row.unit == "img/s":
        return row.global_batch / step_s
    if row.unit == "img/s per GPU":
        return row.batch_per_gpu / step_s
    if row.unit == "tokens/s per GPU":
        return row.batch_per_gpu * row.tokens_per_sample / step_s
    if row.unit == "Tflop/s per GPU":
        return row.global_batch * (row.flops_per_sample or 0.0) / step_s / row.gpus / 1e12
    raise ValueError(f"row {row.job!r}: unknown unit {row.unit!r}")


def run_row(row: Row) -> dict[str, Any]:
    w = row.build(row.global_batch)
    hw = cluster(row)
    t0 = time.perf_counter()
    kw: dict[str, Any] = {"num_devices": row.gpus}
    if row.mesh is not None:
        kw = {"mesh_shape": row.mesh}
    base = {"job": row.job, "hardware": hw.device.name, "gpus": row.gpus,
            "global_batch": row.global_batch, "unit": row.unit, "published": row.published,
            "source": row.source, "differences": row.differences, "model": w.description}
    try:
        plan = jaxwap.plan(w.step, *w.args, params=w.params, hardware=hw, verify=0,
                           cache=False, objective="throughput", strategies=row.strategies,
                           **kw)
    except (MemoryError, ValueError) as e:    # no plan: a row of its own, not an error
        return {**base, "predicted": None, "error": None, "no_plan": str(e),
                "planning_s": time.perf_counter() - t0}
    planning_s = time.perf_counter() - t0
    pred = plan.predicted
    if row.power_limit_w is not None:
        pred = at_power_limit(pred, hw, row.global_batch, row.power_limit_w)
    got = float(predicted_figure(row, float(pred.step_time_s)))
    strategies = sorted({p.strategy for p in plan.params})
    return {**base, "predicted": got, "error": got / row.published - 1,
            "mesh": dict(plan.mesh_shape), "strategies": strategies,
            "micro_batches": plan.step.micro_batches, "remat": plan.step.remat,
            "stages": plan.step.stages, "power_limit_w": row.power_limit_w,
            "step_s": float(pred.step_time_s), "planning_s": planning_s,
            "peak_memory_gb": float(pred.peak_memory_bytes) / GB}


# ------------------------------------------------------------------------------ the rows
ZEUS = ("Zeus trace (You et al., NSDI'23), github.com/ml-energy/zeus examples/"
        "research_reproducibility/zeus_nsdi23/trace/summary_power_v100.csv: an ImageNet epoch "
        "at the 250 W default limit")

#: what differs between a published run and the model, by key: the model prices what
#: XLA would run, so a run whose framework does something XLA does not (unfused kernels,
#: another memory format, an input pipeline) differs by that much. `UNMODELLED` are the
#: differences the model has no term for, whose size the error then mostly is.
NOTES: dict[str, str] = {
    "torch": "PyTorch with cuDNN (its own kernel choices and memory formats) against XLA; "
             "SGD there, Adam here",
    "epoch": "the published figure is an epoch's time, data loading included",
    "tf32": "TF32: PyTorch runs it in NCHW (channels-last only for AMP, configs.yml), and "
            "every DLE table's TF32 figure is about 2.6x below its AMP one (ResNet-50's too: "
            "938 against 2470 img/s); the model prices XLA's NHWC TF32 convolutions at the "
            "TF32 GEMM share, no TF32 convolution having been measured here",
    "se": "the squeeze-and-excitation gate (a pool, two small dense layers, a sigmoid, a "
          "broadcast multiply over the block's output) runs in PyTorch eager as kernels of "
          "their own, each a pass over the activation map, which XLA fuses",
    "loader": "8 GPUs: configs.yml feeds them with the PyTorch data loader (CPU JPEG "
              "decoding), and the published 1-to-8-GPU scaling is 6.5-7.7x where the model, "
              "which has no input pipeline, gives 8x",
    "eager": "PyTorch eager (no torch.compile): elementwise ops unfused, which XLA fuses",
    "compile": "torch.compile (Inductor) against XLA: both fuse the elementwise ops",
    "sac": "torchtitan's op-level selective checkpointing against the matmul-output policy",
    "hbm2e": "96 GB HBM2e parts at a 500 W limit priced with the HBM3 card's bandwidth (the "
             "limit is modelled)",
    "megatron": "Megatron's fused kernels against XLA's; a SwiGLU MLP of 8h/3 rounded to 256 "
                "(GPT's 4h MLP's flops within 1%, as Llama rounds it) and rotary positions in "
                "the Flax model",
}
UNMODELLED = ("tf32", "se", "loader", "eager")


def megatron_flops(layers: int, hidden: int, seq: int = 2048, vocab: int = 51200) -> float:
    """Megatron's count of one sequence's training flops with full recomputation
    (Narayanan et al., SC'21, eq. 3 over the batch): 96 s l h^2 (1 + s/6h + V/16lh)."""
    return 96 * seq * layers * hidden**2 * (1 + seq / (6 * hidden)
                                            + vocab / (16 * layers * hidden))


def _megatron(params_b: float, heads: int, hidden: int, layers: int, tp: int, gpus: int,
              batch: int, tflops: float) -> Row:
    dp = gpus // tp

    def build(global_batch: int) -> Any:
        return zoo.llama("llama_8b", batch_size=global_batch, seq_len=2048, scan=True,
                         remat=True, layers=layers, d_model=hidden, heads=heads,
                         kv_heads=heads, ffn=256 * round(8 * hidden / 3 / 256), vocab=51200)

    return Row(
        job=f"GPT {params_b}B, TP{tp} x DP{dp}, {gpus} A100-80GB (Megatron-LM)", build=build,
        batch_per_gpu=batch // gpus if batch % gpus == 0 else 0, gpus=gpus,
        hardware="a100-sxm-80gb", unit="Tflop/s per GPU", published=tflops,
        source="Narayanan et al., SC'21, Table 1 (seq 2048, vocab 51,200, full "
               "recomputation, mixed precision)",
        differences=("megatron",),
        mesh={"data": dp, "model": tp}, flops_per_sample=megatron_flops(layers, hidden),
        inter_node_gbs=25.0)


def megatron_rows() -> list[Row]:
    """Table 1's rows without pipeline parallelism (the rows that pipeline need the
    many-micro-batch schedules of the expert-plans issue to be laid out as published)."""
    return [_megatron(1.7, 24, 2304, 24, 1, 32, 512, 137),
            _megatron(3.6, 32, 3072, 30, 2, 64, 512, 138),
            _megatron(7.5, 32, 4096, 36, 4, 128, 512, 142),
            _megatron(18.4, 48, 6144, 40, 8, 256, 1024, 135)]


def zeus_rows() -> list[Row]:
    from benchmarks.gpu.power import IMAGENET_TRAIN, ZEUS_RESNET50

    return [Row(job=f"ResNet-50 FP32, batch {bs}, 1 V100 PCIe (Zeus)",
                build=lambda b: zoo.resnet50(batch_size=b, dtype="float32"),
                batch_per_gpu=bs, gpus=1, hardware="v100-pcie", unit="img/s",
                published=IMAGENET_TRAIN / by_limit[250][0], source=ZEUS,
                differences=("torch", "epoch"))
            for bs, by_limit in ZEUS_RESNET50.items()]


DLE = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/{}/README.md, "
       "training performance (pytorch-21.03 NGC container; commit 729963d); batch per GPU "
       "from its configs.yml")
#: (model, precision, system) -> (batch per GPU, 1-GPU img/s, 8-GPU img/s), as printed
DLE_ROWS: dict[tuple[str, str, str], tuple[int, float, float]] = {
    ("resnext101-32x4d", "TF32", "a100"): (128, 456, 3471),
    ("resnext101-32x4d", "AMP", "a100"): (128, 1211, 7925),
    ("resnext101-32x4d", "FP32", "v100"): (64, 147, 1133),
    ("resnext101-32x4d", "AMP", "v100"): (128, 587, 4065),
    ("se-resnext101-32x4d", "TF32", "a100"): (128, 395, 2991),
    ("se-resnext101-32x4d", "AMP", "a100"): (128, 855, 5779),
    ("se-resnext101-32x4d", "FP32", "v100"): (64, 132, 1004),
    ("se-resnext101-32x4d", "AMP", "v100"): (112, 443, 2971),
}
SYSTEMS = {"a100": ("a100-sxm-80gb", None, "DGX A100 (A100 80GB)"),
           "v100": ("v100-sxm2", 16.0, "DGX-1 (V100 16GB)")}


def cnn_rows() -> list[Row]:
    """DeepLearningExamples' ResNeXt-101 32x4d and SE-ResNeXt-101 32x4d, data parallel on 1
    and 8 GPUs. AMP is float16 compute over float32 weights (as the Flax model computes in
    `dtype` over float32 parameters); TF32 and FP32 are float32 (TF32 tensor cores on an
    A100, as XLA's default precision uses them; the V100's CUDA cores)."""
    out = []
    for (model, precision, system), (bs, one, eight) in DLE_ROWS.items():
        profile, memory, name = SYSTEMS[system]
        dtype = "float16" if precision == "AMP" else "float32"
        se = model.startswith("se-")
        for gpus, published in ((1, one), (8, eight)):
            out.append(Row(
                job=f"{'SE-' if se else ''}ResNeXt-101 32x4d {precision}, {gpus} x {name}, "
                    f"batch {bs}/GPU",
                build=lambda b, se=se, dtype=dtype: zoo.resnext101(batch_size=b, dtype=dtype,
                                                                   se=se),
                batch_per_gpu=bs, gpus=gpus, hardware=profile, memory_gb=memory,
                unit="img/s", published=published, source=DLE.format(model),
                differences=("torch", *(("tf32",) if precision == "TF32" else ()),
                             *(("se",) if se else ()), *(("loader",) if gpus > 1 else ())),
                mesh={"data": gpus}, strategies=("replicate",)))
    return out


TORCHTITAN = ("pytorch/torchtitan {} (Llama 3.1 8B: seq 8192 from the benchmarked "
              "commit's llama3_8b.toml, bf16 mixed precision, selective op AC)")


def _llama_8b(global_batch: int) -> Any:
    return zoo.llama_8b(batch_size=global_batch, seq_len=8192, scan=True, remat="dots",
                        attention="cudnn")


def torchtitan_rows() -> list[Row]:
    """torchtitan's Llama 3.1 8B under FSDP, compiled and not: 8 and 128 H100s (Grand
    Teton, 96 GB HBM2e parts at a 500 W limit, local batch 2) and 64 A100-80GB (local
    batch 1, eager only). The model: `zoo.llama_8b` with cuDNN's fused attention (SDPA's
    flash kernel there) and selective remat (matmul outputs kept)."""
    h100 = TORCHTITAN.format("benchmarks/llama3_h100_202412_torchtitan.md (31a17bf), "
                             "Tables 1 and 3, TPS/GPU at iteration 90")
    return [
        *(Row(job=f"Llama 3.1 8B FSDP{label}, {n} H100 (96 GB HBM2e, 500 W), local batch 2",
              build=_llama_8b, batch_per_gpu=2, gpus=n, hardware="h100-sxm",
              memory_gb=96.0, power_limit_w=500.0, unit="tokens/s per GPU",
              published=tps, source=h100, tokens_per_sample=8192,
              differences=(mode, "sac", "hbm2e"), mesh={"data": n}, strategies=("fsdp",))
          for label, mode, figures in ((" + torch.compile", "compile", ((8, 6667), (128, 6514))),
                                       ("", "eager", ((8, 5762), (128, 5605))))
          for n, tps in figures),
        Row(job="Llama 3 8B FSDP, 64 A100-80GB, local batch 1", build=_llama_8b,
            batch_per_gpu=1, gpus=64, hardware="a100-sxm-80gb", unit="tokens/s per GPU",
            published=2973, source=TORCHTITAN.format("docs/performance.md (157a12c), "
                                                     "selective op AC"),
            tokens_per_sample=8192, differences=("eager", "sac"), mesh={"data": 64},
            strategies=("fsdp",)),
    ]


def all_rows() -> list[Row]:
    return [*cnn_rows(), *zeus_rows(), *torchtitan_rows(), *megatron_rows()]


def quick_rows() -> list[Row]:
    """Two small rows for CI: one CNN on a V100, one transformer on A100s."""
    rows = all_rows()
    return [next(r for r in rows if r.job.startswith("ResNet-50 FP32, batch 32")),
            next(r for r in rows if r.job.startswith("GPT 1.7B"))]


# ------------------------------------------------------------------------------ the table
def _errors_summary(errors: list[float]) -> dict[str, Any]:
    med, worst = float(statistics.median(errors)), float(max(errors))
    return {"rows": len(errors), "median_abs_error": med, "worst_abs_error": worst,
            "median_goal_met": med <= GOAL_MEDIAN, "worst_goal_met": worst <= GOAL_WORST,
            "within_15": sum(e <= GOAL_MEDIAN for e in errors),
            "within_30": sum(e <= GOAL_WORST for e in errors)}


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Errors over the rows that got a plan (`no_plan` counts the others, a miss each),
    and apart over the rows with none of the `UNMODELLED` differences."""
    planned = [r for r in results if r["error"] is not None]
    out = _errors_summary([abs(r["error"]) for r in planned])
    out["no_plan"] = len(results) - len(planned)
    modelled = [abs(r["error"]) for r in planned
                if not set(r["differences"]) & set(UNMODELLED)]
    if modelled:
        out["without_unmodelled"] = _errors_summary(modelled)
    return out


def _goals(s: dict[str, Any]) -> str:
    return (f"median |error| {s['median_abs_error']:.1%} (goal <= {GOAL_MEDIAN:.0%}: "
            f"{'met' if s['median_goal_met'] else 'missed'}), worst "
            f"{s['worst_abs_error']:.1%} (goal <= {GOAL_WORST:.0%}: "
            f"{'met' if s['worst_goal_met'] else 'missed'}); {s['within_15']} of {s['rows']} "
            f"rows within 15%, {s['within_30']} within 30%")


def _plan_text(r: dict[str, Any]) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
    extra = [", ".join(r["strategies"])]
    if r["micro_batches"] > 1:
        extra.append(f"{r['micro_batches']} micro-batches")
    if r["remat"] != "none":
        extra.append(f"remat {r['remat']}")
    if r["power_limit_w"]:
        extra.append(f"{r['power_limit_w']:.0f} W")
    return f"{mesh} ({'; '.join(extra)})"


def markdown(results: list[dict[str, Any]], command: str) -> str:
    s = summary(results)
    lines = [
        "# Built-in profiles against published training runs", "",
        f"Command: `{command}`. **Published**: the figure as its source prints it. "
        "**Predicted**: jaxwap's model with the built-in profile (`verify=0`, nothing ran), "
        "the job laid out as the run laid it out. Planning time **measured** on this "
        "machine. No row was used to set a profile's figure "
        "(docs/guide/profiles.md says where each comes from).", "",
        "| job | profile | plan | unit | published | predicted | error | differences | "
        "planning s |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        diffs = ", ".join(r["differences"])
        if r["predicted"] is None:
            lines.append(f"| {r['job']} | {r['hardware']} | no plan: {r['no_plan'][:160]} | "
                         f"{r['unit']} | {r['published']:,.0f} | - | - | {diffs} | "
                         f"{r['planning_s']:.1f} |")
            continue
        lines.append(f"| {r['job']} | {r['hardware']} | {_plan_text(r)} | {r['unit']} | "
                     f"{r['published']:,.0f} | {r['predicted']:,.0f} | {r['error']:+.1%} | "
                     f"{diffs} | {r['planning_s']:.1f} |")
    lines += ["", f"All {s['rows']} rows with a plan: {_goals(s)}; {s['no_plan']} row(s) "
              "without a plan."]
    if "without_unmodelled" in s:
        lines += ["", f"The {s['without_unmodelled']['rows']} rows with none of the "
                  f"differences the model has no term for ({', '.join(UNMODELLED)}): "
                  f"{_goals(s['without_unmodelled'])}. The split is by what each run is "
                  "published to do, not by its error."]
    lines += ["", "What differs between each run and the model (in the error, not tuned "
              "away):", ""]
    used = dict.fromkeys(k for r in results for k in r["differences"])
    lines += [f"- **{k}**{' (no term in the model)' if k in UNMODELLED else ''}: {NOTES[k]}"
              for k in used]
    lines += ["", "Sources:", ""]
    lines += [f"- {src}" for src in dict.fromkeys(r["source"] for r in results)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = harness.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="two small rows (CI)")
    p.add_argument("--only", help="rows whose job contains this")
    p.add_argument("--no-save", action="store_true", help="print only")
    args = p.parse_args(argv)
    rows = quick_rows() if args.quick else all_rows()
    if args.only:
        rows = [r for r in rows if args.only in r.job]
    results = []
    for row in rows:
        results.append(run_row(row))
        r = results[-1]
        if r["predicted"] is None:
            print(f"{r['job']}: no plan: {r['no_plan']}", flush=True)
            continue
        print(f"{r['job']}: {_plan_text(r)}: predicted {r['predicted']:,.0f} {r['unit']} "
              f"against {r['published']:,.0f} published ({r['error']:+.1%}), planned in "
              f"{r['planning_s']:.1f} s", flush=True)
    command = harness.command("benchmarks.accuracy.published_devices", argv)
    record = {**harness.environment("benchmarks.accuracy.published_devices", argv),
              "summary": summary(results), "rows": results}
    text = markdown(results, command)
    print(text)
    if not args.no_save and not args.quick and not args.only:
        harness.write_record(RESULTS / "cpu", record, text)
    return record


if __name__ == "__main__":
    main()
