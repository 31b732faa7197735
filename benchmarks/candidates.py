"""Every candidate the planner considers for a workload, predicted and compiled.

Shared by `fidelity.py` (predicted vs compiled, per quantity) and `plan_quality.py` (the
planner's choice vs the best compiled candidate). For each mesh of up to 8 devices that
the search keeps (meshes whose model axis no parameter uses only duplicate work and are
left out), three layouts are priced by the model and then compiled by XLA from abstract
arguments on the simulated CPU devices:

- the planner's own per-parameter assignment for that mesh,
- plain data parallelism (every parameter replicated), where the mesh has a data axis,
- ZeRO-3 / FSDP (every parameter that can be, sharded over the data axis), likewise.

Compiling is the slow part (seconds per candidate for the full-size models on 2 CPU
cores), so results are kept in `benchmarks/results/candidates_<workload>.json` and reused
by the next script when the workload, hardware and jaxwap version match.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import zoo  # noqa: E402

import jaxwap  # noqa: E402
from jaxwap.compile import compile_layout  # noqa: E402
from jaxwap.cost import mesh_costs, predict  # noqa: E402
from jaxwap.hlo import compiled_figures  # noqa: E402
from jaxwap.planner import Planned, make_plan  # noqa: E402
from jaxwap.records import CompiledFigures  # noqa: E402
from jaxwap.solve import param_strategies, uses_model_axis  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
HARDWARE = jaxwap.Cluster("h100-sxm", 8)
VARIANTS = ("planner", "data-parallel", "fsdp")


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


def _variant_choice(strats: Sequence[Sequence[Any]], variant: str,
                    planner: Sequence[str]) -> list[int] | None:
    names = {"planner": None, "data-parallel": "replicate", "fsdp": "fsdp"}[variant]
    out = []
    for j, options in enumerate(strats):
        want = planner[j] if names is None else names
        idx = next((i for i, s in enumerate(options) if s.name == want), None)
        if idx is None:  # "fsdp" where no dim divides: keep it replicated
            idx = 0
        out.append(idx)
    return out


Key = tuple[int, int, tuple[str, ...]]


def enumerate_candidates(w: zoo.Workload, planned: Planned, known: dict[Key, Any],
                         cluster: jaxwap.Cluster = HARDWARE,
                         log: Any = print) -> list[Record]:
    """Every (mesh, variant) priced by the current model; compiled figures come from
    `known` (layouts compiled before: XLA's figures do not depend on jaxwap's model) or
    from a compile now. Identical layouts appear once."""
    graph, search = planned.graph, planned.search
    assert graph is not None and search is not None
    devices = jax.devices()
    records: list[Record] = []
    seen: set[Key] = set()
    for r in search.results:
        if not uses_model_axis(r) or r.variant != "planner":  # the baseline comes below
            continue
        strats = [param_strategies(graph, j, r.d, r.m) for j in range(len(graph.params))]
        mc = mesh_costs(graph, cluster, r.d, r.m, strats)
        planner_names = [s.name for s in r.strategies]
        for variant in VARIANTS:
            if variant != "planner" and r.d == 1:
                continue
            choice = _variant_choice(strats, variant, planner_names)
            layout = tuple(strats[j][c].name for j, c in enumerate(choice))
            key = (r.d, r.m, layout)
            if key in seen:
                continue
            seen.add(key)
            pred = predict(graph, cluster, mc, choice)
            if key in known:
                figs, err = known[key]
            else:
                specs = [strats[j][c].spec for j, c in enumerate(choice)]
                t0 = time.perf_counter()
                try:
                    cs = compile_layout(w.step, planned.layout, r.d, r.m, specs, devices)
                    figs = compiled_figures(cs.compiled, (r.d, r.m), cluster,
                                            cs.compile_time_s)
                    err = None
                except Exception as e:  # noqa: BLE001 - recorded, not hidden
                    figs, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                log(f"  {w.name:14s} {r.d}x{r.m} {variant:13s} compiled in "
                    f"{time.perf_counter() - t0:5.1f} s" + (f"  ERROR {err}" if err else ""))
            records.append(Record(r.d, r.m, variant, layout, pred, figs, err))
    return records


def load_or_compile(w: zoo.Workload, small: bool, refresh: bool = False,
                    log: Any = print) -> tuple[Planned, list[Record]]:
    """The records for a workload: predictions from the current model, XLA's figures from
    the results file for layouts compiled before (same workload, hardware, jax and
    devices), compiles for the rest; the file is rewritten with everything known."""
    path = RESULTS / f"candidates_{w.name}.json"
    planned = plan_analytic(w)
    meta = {"workload": w.name, "description": w.description, "small": small,
            "hardware": HARDWARE.to_dict(), "jax": jax.__version__,
            "devices": len(jax.devices())}
    known: dict[Key, Any] = {}
    saved_records: list[dict[str, Any]] = []
    if path.exists() and not refresh:
        try:
            saved = json.loads(path.read_text())
            if saved.get("meta") == meta:
                saved_records = saved["records"]
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
