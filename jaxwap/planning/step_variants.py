"""The step variants a plan weighs, cheapest first, until one fits: the step as written
(with its pipelined candidates beside it), then, for a step built by `make_train_step`,
the ladder of restructurings (`train_step.ladder`: per-layer remat policies where the loss
has layers, a layer scan or an unrolled model's repeated blocks, then micro-batches, the
fewest found by bisection).

Each variant is traced and analysed, searched (`verified_search.step_searcher`) and, with
`verify=`, checked by XLA (`verified_search.verify_finalists`, `verified_search.tighten`).
Pipelines and restructurings are optional branches: one that cannot be built is skipped
with a note, and only the step as written must succeed. When nothing fits, the error says
what was tried and what cuDNN's fused attention would give (`attention_advice`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from jaxwap.analysis.graph import Graph, analyze
from jaxwap.analysis.trace import ArgLayout, trace_layout
from jaxwap.core.records import StepVariant
from jaxwap.core.units import si
from jaxwap.decide.attention_advice import fused_alternative
from jaxwap.decide.choose import PlanContext
from jaxwap.decide.no_fit import nothing_fits, nothing_fits_compiled
from jaxwap.decide.verify import Verification
from jaxwap.hardware.cluster import Cluster
from jaxwap.options import PlanOptions
from jaxwap.planning.verified_search import step_searcher, tighten, verify_finalists
from jaxwap.runtime.layer_blocks import RepeatedBlocks, find_layers, saved_dot_bytes
from jaxwap.runtime.layer_scan import NoLayerScan, batch_size_of, trace_loss
from jaxwap.runtime.train_step import TrainStep, ladder, restructured
from jaxwap.search.constraints import LayoutRules
from jaxwap.search.memory_repair import micro_batch_floor
from jaxwap.search.meshes import mesh_shapes
from jaxwap.search.pipeline_search import Pipelines, plan_pipelines, with_pipelines
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


def _failed(e: BaseException) -> str:
    """An optional branch's failure, as a plan note says it: the exception and its first
    line (the branch is skipped; the plan goes on without it)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def optional_pipelines(fn: Callable, layout: ArgLayout, cluster: Cluster,
                       options: PlanOptions, usable: int, budget: float,
                       rules: LayoutRules | None, calls: int, notes: list[str]
                       ) -> Pipelines:
    """The pipelined candidates, an optional branch: a step that jaxwap cannot build into
    stages (a failure anywhere in tracing, cutting or solving its stages) is planned
    without them, the reason in `notes`. Only a pipeline the user forced makes the
    failure the plan's."""
    t0 = time.perf_counter()
    try:
        pipes = plan_pipelines(fn, layout, cluster, options.objective, options, usable,
                               budget, rules, tree_calls=calls)
    except Exception as e:  # noqa: BLE001 - the plan goes on without pipelines, saying why
        if options.forced_pipeline is not None:
            raise
        pipes = Pipelines((), f"building the stages failed ({_failed(e)})",
                          time.perf_counter() - t0)
    if pipes.reason is not None:
        if options.forced_pipeline is not None:
            raise ValueError(f"pipeline={options.forced_pipeline} cannot be used: "
                             f"{pipes.reason}")
        notes.append(f"pipelining not considered: {pipes.reason}")
    return pipes


class _Trials:
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

    def attempt(self, rung: StepVariant) -> FoundVariant | None:
        """Plan one variant; None (and what was tried, and why not) when nothing fits."""
        ctx, options = self.ctx, self.options
        fn_v = variant_fn(self.fn, rung) or self.fn
        ta = time.perf_counter()
        traced = self._graph(rung, fn_v)
        if traced is None:
            return None
        graph, closed = traced
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

    def attempt_unless_bounded(self, rung: StepVariant) -> FoundVariant | None:
        """`attempt`, except for a rung whose floor (`floors`, 5% margin for the estimate)
        is over the budget, or that holds at least what a rung that did not fit holds on
        the device (`_holds_at_least`): that is said in `tried`, not traced."""
        floor = self.floors.get(rung)
        if floor is not None and floor > 1.05 * self.ctx.budget:
            self.tried.append(f"{rung.describe()}: needs at least {si(floor, 'B')} per "
                              f"device (estimated)")
            return None
        below = next((r for r in self.misses if _holds_at_least(rung, r)), None)
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
            closed = self.closed if rung.is_plain else trace_layout(fn_v, layout)
            graph = dataclasses.replace(
                analyze(closed, layout.inputs.roles, layout.outputs.roles, layout.params,
                        layout.inputs.batch_size),
                tree_calls=self.ctx.tree_calls)
        except Exception as e:  # noqa: BLE001 - a restructuring is optional: skip it, say why
            if rung.is_plain:
                raise
            self.tried.append(f"{rung.describe()}: could not be built ({_failed(e)})")
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
        more = (f" Also tried restructuring the step: {'; '.join(tried[1:])}."
                if len(tried) > 1 else "")
        more += fused_alternative(
            self.plain_graph, self.closed, layout.inputs.roles, layout.outputs.roles,
            layout.params, self.ctx.cluster.device,
            step_searcher(self.ctx, self.options, self.usable, self.rules))
        return MemoryError(f"{self.first_error}{more}")


def search_variants(fn: Callable, layout: ArgLayout, closed: Any, ctx: PlanContext,
                    options: PlanOptions, usable: int, timing: dict[str, float],
                    notes: list[str], platform: str, pipes: Pipelines,
                    rules: LayoutRules | None = None) -> FoundVariant:
    """The step as written first; a step built by make_train_step may then be
    restructured (per-layer remat, micro-batches), in order of expected cost, until a
    plan fits. `platform` ("cpu" or "accelerator") is what XLA compiles the step for: the
    present devices', or the described cluster's when the plan is for more devices than
    are present (an accelerator's ladder has a host-offload rung, a CPU's no checkpointed
    unrolled blocks). The pipelined candidates `pipes` are weighed beside the step as written (alone
    when forced)."""
    # a forced pipeline is its own restructuring: no other rung may stand in for it
    restructurable = (isinstance(fn, TrainStep) and fn.variant.is_plain
                      and options.forced_pipeline is None)
    timing.update(analyze=0.0, search=0.0)
    trials = _Trials(fn, layout, closed, ctx, options, usable, timing, notes, pipes, rules)
    # the step as written; then per-layer remat policies, in order; then the fewest
    # micro-batches that fit
    found = trials.attempt(StepVariant())
    no_layers = None
    if found is None and restructurable:
        # the pipelined search found the layer scan when it considered pipelines at all
        layers, no_layers = ("scan", None) if pipes.reason is None else _layers(fn, layout)
        rungs = ladder(layout.inputs.batch_size, platform, layers=layers)
        if layers is not None and all(r.remat == "none" for r in rungs):
            # the ladder's CPU rule (`train_step.ladder`)
            no_layers = ("the loss's layers are unrolled blocks, and XLA:CPU computes "
                         "their recomputations all ahead of the backward pass, so "
                         "checkpointing them saves nothing there")
        layered = no_layers is None
        if layered and (kept := _selective_floor(fn, layout, usable)) is not None:
            trials.floors[StepVariant(remat="layer_dots")] = kept
        fixed = [r for r in rungs if r.micro_batches == 1]
        micro = [r for r in rungs if r.micro_batches > 1]
        found = next((f for f in map(trials.attempt_unless_bounded, fixed) if f is not None),
                     None)
        if found is None:
            found = _fewest_micro_batches(trials, micro)
        if found is None or (layered and found.rung.micro_batches > 1):
            # full per-layer remat holds less per micro-batch: fewer of them may fit, and
            # the objective weighs the recomputation against the micro-batches saved; the
            # counts worth tracing bounded from the full-remat step, where it was traced
            remat = [dataclasses.replace(r, remat="layer_full") for r in micro]
            full = trials.graphs.get(StepVariant(remat="layer_full"))
            found = _preferred(ctx, found, _fewest_micro_batches(
                trials, remat, base=full, floor=full is not None) if layered else None)
    if found is None:
        raise trials.no_fit()
    if found.graph.unmodeled:
        notes.append("ops priced by a generic rule (no roofline rule): "
                     + ", ".join(found.graph.unmodeled))
    if not found.rung.is_plain:
        notes.append(f"the step as written does not fit ({trials.tried[0]}); restructured: "
                     f"{found.rung.describe()}")
    if no_layers is not None:
        notes.append(f"per-layer rematerialization not tried: {no_layers}; micro-batches "
                     f"were")
    return found


def _loss_layers(fn: TrainStep, layout: ArgLayout) -> tuple[Any, Any] | str:
    """(the loss's traced jaxpr, its layers: `layer_blocks.find_layers` on the step's
    abstract arguments), or why there are none."""
    args, kw = jax.tree_util.tree_unflatten(layout.args_treedef, layout.inputs.avals)
    if kw or len(args) != 3:
        return "the step is not called as step(params, opt_state, batch)"
    params, _, batch = args
    try:
        closed, _ = trace_loss(fn.loss_and_aux(), params, batch)
        return closed, find_layers(closed.jaxpr, len(jax.tree_util.tree_leaves(params)),
                                   batch_size_of(batch))
    except NoLayerScan as e:
        return f"no layers found ({e})"


def _layers(fn: TrainStep, layout: ArgLayout) -> tuple[str | None, str | None]:
    """What the step's loss has to checkpoint layer by layer ("scan": a layer scan,
    "blocks": an unrolled model's repeated blocks, None) and, for None, why."""
    got = _loss_layers(fn, layout)
    if isinstance(got, str):
        return None, got
    return ("blocks" if isinstance(got[1], RepeatedBlocks) else "scan"), None


def _selective_floor(fn: TrainStep, layout: ArgLayout, usable: int) -> float | None:
    """A lower bound on what selective per-layer remat (`layer_dots`) holds per device:
    the weight matmuls' outputs it keeps, every layer's (`layer_blocks.saved_dot_bytes`),
    split over all `usable` devices (no layout splits them further): a Llama-3-70B
    written as a loop keeps 28 TB of them at 256 x 8192 tokens, 220 GB on each of 128
    GPUs, where tracing the variant costs seconds and could only confirm the miss. None
    where the loss has no layers to say it of."""
    got = _loss_layers(fn, layout)
    return None if isinstance(got, str) else saved_dot_bytes(got[0].jaxpr, got[1]) / usable


def _holds_at_least(a: StepVariant, b: StepVariant) -> bool:
    """Whether variant `a` keeps at least what `b` does in device memory, by what jax's
    checkpoint policies keep: at the same micro-batches, every per-layer policy keeps
    each layer's input, as full remat does (`layer_full` keeps nothing else), and the
    offload policy keeps what selective remat keeps beside it, in host memory, with the
    device holding the inputs still."""
    return (a.micro_batches == b.micro_batches and a.stages == b.stages == 1
            and b.remat == "layer_full" and a.remat in ("layer_dots", "layer_offload"))


def _preferred(ctx: PlanContext, *found: FoundVariant | None) -> FoundVariant | None:
    """The variant whose best candidate the objective ranks first (None: none found)."""
    got = [f for f in found if f is not None]
    if len(got) < 2:
        return got[0] if got else None
    best = [f.search.results[f.search.best].predicted for f in got]
    return got[ctx.cluster.ranker(ctx.objective)(best).best]


def _fewest_micro_batches(trials: _Trials, micro: list[StepVariant],
                          base: Graph | None = None, floor: bool = True
                          ) -> FoundVariant | None:
    """The fewest micro-batches that fit: a few traces instead of one per count.

    More micro-batches hold fewer activations at once on a given mesh, but each
    micro-batch's rows must split evenly over the data axis, so a count whose micro-batch
    has fewer rows than a wide data axis loses that mesh, and with it the sharding of the
    weights and optimizer state over those devices: past that count a step can need more
    per device, not less (a 1T model with full remat on 3,072 GPUs: 86.8 GB at 4
    micro-batches, 88.8 at 8, 92.7 at 16). So the counts are taken in runs that keep the
    same meshes (`_same_meshes`), where whether a count fits is monotone, and each run is
    bisected; the next run is tried only when none of the last fits, and none once a run
    needs more than the run before it (from there each count has fewer devices to shard
    the weights over, and a device holds the same activations, a row of each
    micro-batch). Counts under their floor are not traced (`_above_floor`, estimated
    from `base`: the step as written (None), or for remat rungs, whose activations the
    step as written does not bound, the step with that remat and no micro-batches;
    `floor=False` where that step was not traced)."""
    before = None      # the least need of the last run traced
    for lo, hi in _same_meshes(trials, micro, base):
        if floor:
            lo = _above_floor(trials, micro, base, lo, hi)
        found = _bisected(trials, micro, lo, hi)
        if found is not None:
            return found
        need = min((trials.needs[r] for r in micro[lo:hi + 1] if r in trials.needs),
                   default=None)
        if need is not None and before is not None and need >= before[1]:
            # past the counts that keep the widest data axis, each count halves the
            # devices sharding the weights while a device's activations stay the same:
            # a run needing more than the one before is the need turning up for good
            for r in micro[hi + 1:]:
                trials.tried.append(
                    f"{r.describe()}: not traced, {micro[hi].micro_batches} micro-batches "
                    f"already needed more than {before[0]} (fewer devices to shard the "
                    f"weights over, the same activations on each)")
            return None
        before = before if need is None else (micro[hi].micro_batches, need)
    return None


def _bisected(trials: _Trials, micro: list[StepVariant], lo: int, hi: int
              ) -> FoundVariant | None:
    """The fewest micro-batches among `micro[lo:hi + 1]` that fit, where whether a count
    fits is monotone: the smallest count first (the likeliest plan where the floor
    let it through), then bisection."""
    found = None
    mid = lo
    while found is None and lo <= hi:
        got = trials.attempt(micro[mid])
        if got is None:
            lo = mid + 1
        else:
            found, hi = got, mid - 1
            while lo <= hi:   # a smaller count may fit too
                mid = (lo + hi) // 2
                smaller = trials.attempt(micro[mid])
                if smaller is None:
                    lo = mid + 1
                else:
                    found, hi = smaller, mid - 1
        mid = (lo + hi) // 2
    return found


def _same_meshes(trials: _Trials, micro: list[StepVariant], base: Graph | None = None
                 ) -> list[tuple[int, int]]:
    """`micro`'s counts as runs (first and last index) over which the meshes a plan may
    use stay the same (`meshes.mesh_shapes`: each micro-batch split evenly over the data
    axis); one run where no graph is at hand to say."""
    graph = base if base is not None else trials.plain_graph
    if not micro:
        return []
    if graph is None:
        return [(0, len(micro) - 1)]
    cluster, options = trials.ctx.cluster, trials.options
    node = cluster.node_size if cluster.num_nodes > 1 else None
    sets = [frozenset(mesh_shapes(trials.usable, graph.batch_size, graph, options.num_devices,
                                  r.micro_batches, options.mesh, node)[0]) for r in micro]
    runs, first = [], 0
    for i in range(1, len(micro) + 1):
        if i == len(micro) or sets[i] != sets[first]:
            runs.append((first, i - 1))
            first = i
    return runs


def _above_floor(trials: _Trials, micro: list[StepVariant], base: Graph | None = None,
                 lo: int = 0, hi: int | None = None) -> int:
    """The index of the first count in `micro[lo:hi + 1]` worth tracing (`hi + 1`: none
    is): counts whose activations alone, estimated from `base` (None: the step as
    written) at 1/k of its rows, leave no layout within the budget are skipped, each said
    in `trials.tried` (5% margin for the estimate, a lower bound: `micro_batch_floor`).
    The last count is skipped too where its floor is over: tracing a large model again
    costs seconds and could only confirm the miss."""
    hi = len(micro) - 1 if hi is None else hi
    base = base if base is not None else trials.plain_graph
    if not micro or base is None:
        return lo
    ctx, options = trials.ctx, trials.options
    floor = functools.partial(micro_batch_floor, base, ctx.cluster, trials.usable,
                              offload=options.offload, allowed=trials.rules,
                              num_devices_exact=options.num_devices, mesh=options.mesh)
    while lo <= hi and (need := floor(micro[lo].micro_batches)) > 1.05 * ctx.budget:
        trials.tried.append(f"{micro[lo].describe()}: needs at least {si(need, 'B')} per "
                            f"device (estimated)")
        lo += 1
    return lo


__all__ = ["FoundVariant", "optional_pipelines", "search_variants", "variant_fn"]
