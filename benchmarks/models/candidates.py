"""Every candidate the planner considers for a workload, predicted and compiled.

Shared by `accuracy/fidelity.py` (predicted vs compiled, per quantity) and
`planning/plan_quality.py` (the planner's choice vs the best compiled candidate). For each
mesh of up to 8 devices that the search keeps (meshes whose model axis no parameter uses
only duplicate work and are left out), three layouts are priced by the model and then
compiled by XLA from abstract arguments on the simulated CPU devices:

- the planner's own per-parameter assignment for that mesh,
- plain data parallelism (every parameter replicated), where the mesh has a data axis,
- ZeRO-3 / FSDP (every parameter that can be, sharded over the data axis), likewise.

The two forced layouts are what the planner itself finds on that mesh with
`PlanOptions(strategies=("replicate",))` / `("fsdp",)` (the same `solve.solve_mesh`), and
every candidate is compiled by `verify.compile_candidate`, the function verification and
`auto_shard` compile through: the weight spec, the optimizer-state spec and its memory
kind are the candidate's own (a ZeRO-1 candidate compiles with its state sharded).

Compiling is the slow part (seconds per candidate for the full-size models on 2 CPU
cores), so results are kept in `benchmarks/results/candidates/<workload>.json` and reused
by the next script when the workload, hardware and jaxwap version match.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

import jaxwap  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.models import zoo  # noqa: E402
from benchmarks.models.layouts import variant_candidate  # noqa: E402
from jaxwap.core.records import CompiledFigures  # noqa: E402
from jaxwap.decide.verify import compile_candidate  # noqa: E402
from jaxwap.planner import Planned, make_plan  # noqa: E402
from jaxwap.search.solve import uses_model_axis  # noqa: E402

RESULTS = harness.results_dir("candidates")
HARDWARE = jaxwap.Cluster("h100-sxm", 8)
COMPILED_VARIANTS = ("planner", "data-parallel", "fsdp")
# Bumped when what a record's compiled figures describe changes: saved records of another
# format are compiled again. 2: candidates compiled by verify.compile_candidate with their
# real placements (format 1 laid ZeRO-1 / offloaded optimizer state out like the weight).
# 3: an FSDP embedding table gathered before its lookup (`compile.gathered_first`), and no
# column split that leaks into the residual stream among the planner's layouts. 4: nor
# one a fused q/k/v split cuts, nor an unpaired row-parallel layer where another kind can.
# 5: after a column-parallel layer, only a row-parallel one where it can be. 6: a ZeRO-1
# gradient pinned to its weight's layout where it is made (`jaxwap.runtime.grad_pins`). 7: an FSDP
# norm scale (any data-sharded parameter no matmul reads that XLA would gather again)
# gathered first, its gradient pinned whole (`compile.gathered_first`).
FORMAT = 7
# {older format: which of its records still describe what is compiled now (by strategies)}
STILL_VALID: dict[int, Callable[[Sequence[str]], bool]] = {
    6: lambda strategies: not any("fsdp" in s for s in strategies)}


@dataclass(frozen=True)
class Record:
    """One compiled candidate: mesh, layout variant, strategy per param, both figures."""

    d: int
    m: int
    variant: str
    strategies: tuple[str, ...]
    predicted: jaxwap.Prediction
    compiled: CompiledFigures | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"d": self.d, "m": self.m, "variant": self.variant,
                "strategies": list(self.strategies), "predicted": self.predicted.to_dict(),
                "compiled": self.compiled.to_dict() if self.compiled else None,
                "error": self.error}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        return cls(d["d"], d["m"], d["variant"], tuple(d["strategies"]),
                   jaxwap.Prediction.from_dict(d["predicted"]),
                   CompiledFigures.from_dict(d["compiled"]) if d["compiled"] else None,
                   d.get("error"))


def build(name: str, small: bool) -> zoo.Workload:
    return zoo.small(name) if small else zoo.WORKLOADS[name]()


def plan_analytic(w: zoo.Workload, cluster: jaxwap.Cluster = HARDWARE) -> Planned:
    """The search alone (no verification, no cache): every mesh with its assignment."""
    return make_plan(w.step, w.args, {}, params=w.params,
                     options=jaxwap.PlanOptions(objective="balanced", hardware=cluster,
                                                verify=0, cache=False))


Key = tuple[int, int, tuple[str, ...]]


def enumerate_candidates(w: zoo.Workload, planned: Planned, known: dict[Key, Any],
                         cluster: jaxwap.Cluster = HARDWARE,
                         log: Any = print) -> list[Record]:
    """Every (mesh, variant) priced by the current model; compiled figures come from
    `known` (layouts compiled before: XLA's figures do not depend on jaxwap's model) or
    from a compile now. Identical layouts appear once."""
    search = planned.search
    assert search is not None
    devices = jax.devices()
    records: list[Record] = []
    seen: set[Key] = set()
    for r in search.results:
        if not uses_model_axis(r) or r.variant != "planner":  # the baseline comes below
            continue
        for variant in COMPILED_VARIANTS:
            if variant != "planner" and r.d == 1:
                continue
            cand = variant_candidate(planned.graph, r, variant, cluster)
            layout = tuple(s.name for s in cand.strategies)
            key = (r.d, r.m, layout)
            if key in seen:
                continue
            seen.add(key)
            if key in known:
                figs, err = known[key]
            else:
                t0 = time.perf_counter()
                try:
                    figs, _ = compile_candidate(w.step, planned.layout, cand, devices, cluster)
                    err = None
                except Exception as e:  # noqa: BLE001 - recorded, not hidden
                    figs, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                log(f"  {w.name:14s} {r.d}x{r.m} {variant:13s} compiled in "
                    f"{time.perf_counter() - t0:5.1f} s" + (f"  ERROR {err}" if err else ""))
            records.append(Record(r.d, r.m, variant, layout, cand.predicted, figs, err))
    return records


def _same_question(saved: Any, meta: dict[str, Any]) -> bool:
    """Whether saved records answer this compile question: XLA's figures (memory, flops,
    the collectives and their bytes) depend on the workload, jax, the device count and the
    record format, not on the profile's figures, which only price them later."""
    def key(m: dict[str, Any]) -> dict[str, Any]:
        hw = m.get("hardware") or {}
        return {**{k: v for k, v in m.items() if k != "hardware"},
                "hardware": ((hw.get("device") or {}).get("name"), hw.get("num_devices"))}
    return isinstance(saved, dict) and key(saved) == key(meta)


def load_or_compile(w: zoo.Workload, small: bool, refresh: bool = False,
                    log: Any = print) -> tuple[Planned, list[Record]]:
    """The records for a workload: predictions from the current model, XLA's figures from
    the results file for layouts compiled before (same workload, hardware, jax and
    devices), compiles for the rest; the file is rewritten with everything known."""
    path = RESULTS / f"{w.name}.json"
    planned = plan_analytic(w)
    meta = {"format": FORMAT, "workload": w.name, "description": w.description, "small": small,
            "hardware": HARDWARE.to_dict(), "jax": jax.__version__,
            "devices": len(jax.devices())}
    known: dict[Key, Any] = {}
    saved_records: list[dict[str, Any]] = []
    if path.exists() and not refresh:
        try:
            saved = json.loads(path.read_text())
            was = (saved.get("meta") or {}).get("format")
            valid = (lambda strategies: True) if was == FORMAT else STILL_VALID.get(was)
            if valid is not None and _same_question({**saved["meta"], "format": FORMAT}, meta):
                saved_records = [r for r in saved["records"] if valid(r["strategies"])]
                for rec in map(Record.from_dict, saved_records):
                    known[(rec.d, rec.m, rec.strategies)] = (rec.compiled, rec.error)
        except (ValueError, KeyError, TypeError):
            known, saved_records = {}, []
    records = enumerate_candidates(w, planned, known, log=log)
    current = {(r.d, r.m, r.strategies) for r in records}
    keep = [d for d in saved_records
            if (d["d"], d["m"], tuple(d["strategies"])) not in current]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "records": keep + [r.to_dict() for r in records]},
                               indent=1) + "\n")
    return planned, records


def compiled_lookup(records: Sequence[Record]) -> dict[Key, CompiledFigures]:
    return {(r.d, r.m, r.strategies): r.compiled for r in records if r.compiled is not None}
