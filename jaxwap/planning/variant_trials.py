"""The step variants a plan has tried: each attempt's planning (`Trials.attempt`: traced,
analysed, searched and, with `verify=`, checked by XLA) and the record of those that did
not fit, which the error names when none does (`Trials.no_fit`). `step_variants` says
which variants to attempt, in which order; `micro_batch_search` which counts of
micro-batches."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxwap.analysis.graph import Graph, analyze
from jaxwap.analysis.graph_cache import kept
from jaxwap.analysis.trace import ArgLayout, trace_layout
from jaxwap.core.records import StepVariant
from jaxwap.core.units import si
from jaxwap.decide.attention_advice import fused_alternative
from jaxwap.decide.choose import PlanContext
from jaxwap.decide.no_fit import nothing_fits, nothing_fits_compiled
from jaxwap.decide.verify import Verification
from jaxwap.options import PlanOptions
from jaxwap.planning.verified_search import step_searcher, tighten, verify_finalists
from jaxwap.runtime.train_step import TrainStep, planned_trace, restructured
from jaxwap.search.constraints import LayoutRules
from jaxwap.search.memory_repair import micro_batch_floor
from jaxwap.search.meshes import mesh_shapes
from jaxwap.search.pipeline_search import Pipelines, with_pipelines
from jaxwap.search.solve import SearchResult


@dataclass(frozen=True)
class FoundVariant:
    """The step variant that fits, and what its planning found."""

    rung: StepVariant
    fn: Callable
    graph: Graph
    search: SearchResult
    verification: Verification | None
    closed: Any = None     # its traced jaxpr, which the attention advice reads again


def variant_fn(fn: Callable, variant: StepVariant) -> Callable | None:
    """The step restructured as `variant` says (None: the step as written)."""
    return None if variant.is_plain else restructured(fn, variant)


def failed_note(e: BaseException) -> str:
    """An optional branch's failure, as a plan note says it: the exception and its first
    line (the branch is skipped; the plan goes on without it)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


class Trials:
    """The variants tried so far, for one `search_variants` call: each attempt's planning
    (graph, search, verification) and the record of those that did not fit (`tried`, the
    first one's error, the step as written's graph for the micro-batch floor and the
    fused-attention sentence). A working state, not a record: attempts add to it."""

    def __init__(self, fn: Callable, layout: ArgLayout, closed: Any, ctx: PlanContext,
                 options: PlanOptions, usable: int, timing: dict[str, float],
                 notes: list[str], pipes: Pipelines, rules: LayoutRules | None) -> None:
        self.fn, self.layout, self.closed, self.ctx = fn, layout, closed, ctx
        self.options, self.usable, self.timing, self.notes = options, usable, timing, notes
        self.pipes, self.rules = pipes, rules
        self.tried: list[str] = []
        self.first_error: str | None = None
        self.plain_graph: Graph | None = None
        self.graphs: dict[StepVariant, Graph] = {}     # every variant traced, by rung
        self.misses: set[StepVariant] = set()          # those that did not fit
        self.floors: dict[StepVariant, float] = {}     # lower bounds, per device, untraced
        self.needs: dict[StepVariant, float] = {}      # the least predicted, those traced
        self.unsearched: Graph | None = None           # the step as written, not searched

    def attempt(self, rung: StepVariant, bounded: bool = False) -> FoundVariant | None:
        """Plan one variant; None (and what was tried, and why not) when nothing fits.
        `bounded` (the step as written, where restructurings follow and no pipeline
        stands beside it): not searched where no layout of any mesh can fit
        (`_over_floor`)."""
        ctx, options = self.ctx, self.options
        fn_v = variant_fn(self.fn, rung) or self.fn
        ta = time.perf_counter()
        traced = self._graph(rung, fn_v)
        if traced is None:
            return None
        graph, closed = traced
        if bounded and self._over_floor(rung, graph):
            self.timing["analyze"] += time.perf_counter() - ta
            return None
        tb = time.perf_counter()
        base = step_searcher(ctx, options, self.usable, self.rules, rung.micro_batches)

        def searcher(budget: float) -> SearchResult:   # tighten searches smaller budgets
            return base(graph, budget=budget)
        try:
            result = searcher(ctx.budget)
        except ValueError as e:
            if rung.is_plain:
                raise
            self.tried.append(f"{rung.describe()}: {str(e).split('(')[0].strip()}")
            return None
        if rung.is_plain:
            result = with_pipelines(result, self.pipes, ctx.objective, ctx.cluster,
                                    only=options.forced_pipeline is not None)
        self.timing["analyze"] += tb - ta
        self.timing["search"] += time.perf_counter() - tb
        best = result.results[result.best]
        result, ver, error = self._checked(result, fn_v, searcher)
        if error is None:
            return FoundVariant(rung, fn_v, graph, result, ver, closed)
        self.first_error = self.first_error or error
        self.tried.append(f"{rung.describe()}: " + (
            f"needs {si(best.predicted.peak_memory_bytes, 'B')} per device (predicted)"
            if not best.fits else "no candidate fits by XLA's analysis"))
        self.misses.add(rung)
        self.needs[rung] = float(best.predicted.peak_memory_bytes)
        return None

    def _over_floor(self, rung: StepVariant, graph: Graph) -> bool:
        """Whether `rung`'s least possible peak on every mesh the search would try
        (`memory_repair.micro_batch_floor`: each parameter at its smallest share, the
        bound `solve.solve_mesh` prunes a mesh by) is over the budget: then no candidate
        fits, and searching would only price each mesh at that bound. Said in `tried`;
        the search runs after all if no variant fits, for the error (`no_fit`)."""
        floor = self.floor(graph, rung.micro_batches)
        if not self.ctx.budget < floor < float("inf"):   # (no mesh at all: the search says why)
            return False
        self.tried.append(f"{rung.describe()}: needs at least {si(floor, 'B')} per device "
                          f"(a lower bound)")
        self.misses.add(rung)
        self.needs[rung] = floor
        self.unsearched = graph
        return True

    def floor(self, graph: Graph, micro_batches: int) -> float:
        """`memory_repair.micro_batch_floor` of `graph`'s step split into
        `micro_batches`, on the meshes this plan may use (the options' devices, mesh,
        offload and layout rules)."""
        options = self.options
        return micro_batch_floor(graph, self.ctx.cluster, self.usable, micro_batches,
                                 offload=options.offload, allowed=self.rules,
                                 num_devices_exact=options.num_devices, mesh=options.mesh)

    def meshes(self, graph: Graph, micro_batches: int = 1) -> list[tuple[int, int]]:
        """The (data, model) meshes this plan may use for `graph`'s step split into
        `micro_batches` (`meshes.mesh_shapes`: each micro-batch split evenly over the data
        axis, the options' devices and mesh, the cluster's nodes)."""
        options = self.options
        return mesh_shapes(self.usable, graph.batch_size, graph, options.num_devices,
                           micro_batches, options.mesh, self.ctx.cluster.mesh_node_size)[0]

    def attempt_unless_bounded(self, rung: StepVariant) -> FoundVariant | None:
        """`attempt`, except for a rung whose floor (`floors`, 5% margin for the estimate)
        is over the budget, or that holds at least what a rung that did not fit holds on
        the device (`holds_at_least`): that is said in `tried`, not traced."""
        floor = self.floors.get(rung)
        if floor is not None and floor > 1.05 * self.ctx.budget:
            self.tried.append(f"{rung.describe()}: needs at least {si(floor, 'B')} per "
                              f"device (estimated)")
            return None
        below = next((r for r in self.misses if holds_at_least(rung, r)), None)
        if below is not None:
            self.tried.append(f"{rung.describe()}: not traced, it keeps on the device at "
                              f"least what {below.remat} does, which did not fit")
            return None
        return self.attempt(rung)

    def _graph(self, rung: StepVariant, fn_v: Callable) -> tuple[Graph, Any] | None:
        """The variant traced and analysed, and its trace (the step as written: its trace
        already made); None, with a note, where a restructuring cannot be built."""
        layout = self.layout
        try:
            def build() -> tuple[Graph, Any]:
                closed = self.closed if rung.is_plain else planned_trace(
                    lambda f: trace_layout(f, layout), fn_v)
                return analyze(closed, layout.inputs.roles, layout.outputs.roles,
                               layout.params, layout.inputs.batch_size), closed
            # kept: by its trace for the step as written (jax hands back the same trace
            # of the same function), by what it is built from for a restructured step,
            # a new function each plan
            key = ("plain", self.closed, layout) if rung.is_plain \
                else _variant_key(self.fn, rung, layout)
            graph, closed = kept(key, build)
            graph = dataclasses.replace(graph, tree_calls=self.ctx.tree_calls)
        except Exception as e:  # noqa: BLE001 - a restructuring is optional: skip it, say why
            if rung.is_plain:
                raise
            self.tried.append(f"{rung.describe()}: could not be built ({failed_note(e)})")
            self.notes.append(f"step variant skipped: {self.tried[-1]}")
            return None
        if rung.is_plain:
            self.plain_graph = graph
        self.graphs[rung] = graph
        return graph, closed

    def _checked(self, result: SearchResult, fn_v: Callable,
                 searcher: Callable[[float], SearchResult]
                 ) -> tuple[SearchResult, Verification | None, str | None]:
        """(the search, its verification, why nothing fits or None): the model's verdict,
        then, with `verify=`, XLA's on the compiled finalists (searched again with a
        tightened budget where XLA needs more than predicted)."""
        ctx, options = self.ctx, self.options
        B = self.layout.inputs.batch_size
        if not result.results[result.best].fits:
            return result, None, nothing_fits(result, ctx.budget, B, self.rules, ctx.params)
        if not options.verify:
            return result, None, None
        verifier = functools.partial(verify_finalists, fn_v, self.layout, ctx, options)
        ver = verifier(result)
        self.timing["verify"] = self.timing.get("verify", 0.0) + ver.verify_time_s
        if ver.best < 0 and ver.figures:
            result, ver = tighten(result, ver, searcher, verifier, ctx.budget, self.timing,
                                  self.notes)
        error = nothing_fits_compiled(ver, result, ctx.budget, B) if ver.best < 0 else None
        return result, ver, error

    def no_fit(self) -> MemoryError:
        """The error when no variant fits: the first one's reason, what else was tried,
        and what cuDNN's fused attention would give the step as written."""
        tried, layout = self.tried, self.layout
        first = self.first_error
        if self.unsearched is not None:   # the step as written, bounded: its search's error
            first = nothing_fits(step_searcher(self.ctx, self.options, self.usable, self.rules)(
                self.unsearched), self.ctx.budget, layout.inputs.batch_size, self.rules,
                self.ctx.params)
        more = (f" Also tried restructuring the step: {'; '.join(tried[1:])}."
                if len(tried) > 1 else "")
        more += fused_alternative(
            self.plain_graph, self.closed, layout.inputs.roles, layout.outputs.roles,
            layout.params, self.ctx.cluster.device,
            step_searcher(self.ctx, self.options, self.usable, self.rules))
        return MemoryError(f"{first}{more}")


def _variant_key(fn: TrainStep, rung: StepVariant, layout: ArgLayout) -> tuple[Any, ...]:
    """What a restructured step's analysis follows from: its loss and optimizer (only a
    `make_train_step` step is restructured), the variant, the arguments' layout."""
    return ("variant", fn.loss_and_aux(), fn.optimizer, rung, layout)


def holds_at_least(a: StepVariant, b: StepVariant) -> bool:
    """Whether variant `a` keeps at least what `b` does in device memory, by what jax's
    checkpoint policies keep: at the same micro-batches, every per-layer policy keeps
    each layer's input, as full remat does (`layer_full` keeps nothing else), and the
    offload policy keeps what selective remat keeps beside it, in host memory, with the
    device holding the inputs still."""
    return (a.micro_batches == b.micro_batches and a.stages == b.stages == 1
            and b.remat == "layer_full" and a.remat in ("layer_dots", "layer_offload"))


__all__ = ["FoundVariant", "Trials", "failed_note", "holds_at_least", "variant_fn"]
