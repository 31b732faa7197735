"""The pipelined candidates of a plan: stages, micro-batches and rounds, searched.

A step `make_train_step` built, whose loss runs a `lax.scan` over stacked layer
parameters (`layer_scan.find_layer_scan`), can run its stack as a pipeline over a stage mesh
axis (`schedule.pipelined`). For each stage count p (one the devices divide into,
leaving each stage at least two layers: divisors of the layers first, then the splits
with the fewest empty slots, spread from the fewest stages to the most;
`pipeline_shapes.stage_counts`) the step is traced once
more with the stack cut to ceil(L / p) layers: that *stage step* is what each stage's
devices run, the layers outside the stack split over the stages' rows. It is solved like
any other step on each (data, model) mesh a stage may get (every parameter's layout
chosen as usual, tensor parallelism included), and `pipeline_cost` adds what the
pipeline changes for every micro-batch count and number of rounds worth trying; the best
of each stage count joins the search's candidates, its stacked parameters' leading dim
over the stage axis (where the layers do not divide, another dim:
`pipeline_shapes.staged_layouts`). `mesh_shape` fixes the stage's (data, model) mesh:
the stage axis is added outside it.

When pipelining is not considered, the reason is returned for `explain()`.

A stacked parameter the stage's solution shards over data (FSDP) stays sharded inside
the stage (`StepVariant.stage_specs`): the loop gathers each layer where it runs it, on
every loop step, where the stage's solve priced one gather a pass. So where it does, the
stage is also solved with its stacked weights whole over data (`LayoutRules.
whole_over_data`; their optimizer state may be ZeRO-1, as Megatron's data-parallel
stages keep them), and the objective weighs both. One it splits over the model axis
stays split: XLA partitions the layer inside the loop (`schedule.pipelined`).

Not searched (yet): hybrid-sharded stages, stages of one layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax

from jaxwap.analysis.graph import Graph
from jaxwap.analysis.trace import ArgLayout
from jaxwap.core.objective import Objective
from jaxwap.core.records import StepVariant, Strategy
from jaxwap.cost.pipeline_cost import (
    loop_held,
    loop_memory,
    pipeline_prediction,
    stack_shares,
)
from jaxwap.hardware.cluster import Cluster
from jaxwap.runtime.layer_scan import (
    NO_SCAN,
    LayerScan,
    NoLayerScan,
    find_layer_scan,
    has_scan,
)
from jaxwap.runtime.layer_scan_rewrite import check_micro_batches
from jaxwap.runtime.stage_layout import chunking
from jaxwap.runtime.train_step import TrainStep
from jaxwap.search.constraints import LayoutRules
from jaxwap.search.meshes import even_split_counts, mesh_shapes
from jaxwap.search.pipeline_shapes import (
    carry_split,
    inputs_split,
    schedule_shapes,
    stack_kept,
    stage_counts,
    stage_specs,
    staged_layouts,
)
from jaxwap.search.solve import MeshResult, SearchResult, solve_mesh, uses_model_axis
from jaxwap.search.stage_graphs import stage_graph
from jaxwap.search.strategies import pins_hold

if TYPE_CHECKING:  # the record only: the options sit above the search, which reads its fields
    from jaxwap.options import PlanOptions

# Sizes of a stage's data axis tried per stage count: all the devices, half, ...
MESH_SIZES = 4
# Times a stage mesh is solved again with less room where the loop's own holdings leave
# none of its schedules within the budget.
RESOLVES = 2


@dataclass(frozen=True)
class Pipelines:
    """The pipelined candidates found (best per stage count), or why there are none."""

    results: tuple[MeshResult, ...]
    reason: str | None      # why pipelining was not considered (None: it was)
    seconds: float


def plan_pipelines(fn: Callable, layout: ArgLayout, cluster: Cluster, objective: Objective,
                   options: PlanOptions, usable: int, budget: float,
                   rules: LayoutRules | None = None, tree_calls: int = 0,
                   traced: Any = None) -> Pipelines:
    """The best pipelined candidate per stage count for this step (its arguments as
    `layout` holds them: global, abstract), or the reason there are none (not a
    `make_train_step` step, no layer scan, too few devices, ...). `tree_calls`: the Python
    calls a call makes on the step's pytrees (`Graph.tree_calls`). `traced`: the step's
    trace, where at hand: with no scan in it, the loss is not traced again to find none."""
    t0 = time.perf_counter()
    args, kw = jax.tree_util.tree_unflatten(layout.args_treedef, layout.inputs.avals)
    kwargs = dict(zip(layout.kw_names, kw, strict=True))
    batch = layout.inputs.batch_size

    def none(reason: str) -> Pipelines:
        return Pipelines((), reason, time.perf_counter() - t0)

    forced = options.forced_pipeline
    if options.pipeline is False:
        return none("pipeline=False")
    if not isinstance(fn, TrainStep):
        return none("the step is not built by jaxwap.make_train_step, so jaxwap cannot "
                    "restructure it into stages")
    if not fn.variant.is_plain:
        return none(f"the step is already restructured ({fn.variant.describe()})")
    if kwargs or len(args) != 3:
        return none("the step is not called as step(params, opt_state, batch)")
    if usable < 2:
        return none("one device")
    if options.replicas > 1:
        return none("the mesh is hybrid-sharded (mesh_shape names replicas): its stages "
                    "are not searched")
    params, _, batch_tree = args
    if traced is not None and not has_scan(traced.jaxpr):
        return none(NO_SCAN)
    try:
        scan = find_layer_scan(fn.loss_and_aux(), params, batch_tree)
        check_micro_batches(fn.loss_and_aux(), scan, params, batch_tree)
    except NoLayerScan as e:
        return none(str(e))
    L = scan.length
    counts = stage_counts(L, options.num_devices or usable, forced)
    if not counts:
        return none(f"no stage count splits the {L} layers into stages of two or more "
                    f"over {options.num_devices or usable} devices")
    out = []
    for p in counts:
        try:
            best = _best_for_stages(fn, args, scan, p, cluster, objective, options, usable,
                                    budget, batch, forced, rules, tree_calls)
        except NoLayerScan as e:        # what one stage count meets, every count meets
            return none(str(e))
        if best is not None:
            out.append(best)
    if not out:
        return none(f"no stage count of {counts} leaves a stage mesh the batch of {batch} "
                    f"splits over with micro-batches")
    return Pipelines(tuple(out), None, time.perf_counter() - t0)


def with_pipelines(result: SearchResult, found: Pipelines, objective: Objective,
                   cluster: Cluster, only: bool = False) -> SearchResult:
    """The search's candidates and the pipelined ones (only those, when forced), ranked
    together by the objective."""
    if not found.results:
        return result
    results = list(found.results) if only else [*result.results, *found.results]
    ranking = cluster.ranker(objective)(
        [r.predicted if r.fits and uses_model_axis(r) else None for r in results])
    best = ranking.best
    if best < 0:
        best = min(range(len(results)), key=lambda i: results[i].predicted.peak_memory_bytes)
    return SearchResult(tuple(results), ranking.scores, best, result.skipped,
                        -1 if only else result.baseline)


def _best_for_stages(fn: TrainStep, args: Sequence[Any], scan: LayerScan, p: int,
                     cluster: Cluster, objective: Objective, options: PlanOptions,
                     usable: int, budget: float, batch: int | None,
                     forced: dict[str, int] | None, rules: LayoutRules | None,
                     tree_calls: int = 0) -> MeshResult | None:
    """The best pipelined candidate with p stages: the stage step solved on each (data,
    model) mesh a stage may get (all the devices, or fewer; `mesh_shape` fixes it), then
    every micro-batch count and number of rounds priced. Where memory binds (none of
    those fits, or one the objective prefers to the best that fits does not), the same
    with each loop step keeping only its input (`remat="stage"`: a stage's layers run
    forward again in its backward pass, so the loop's residuals no longer grow with the
    layers a stage holds, and fewer micro-batches may fit), the better of the two kept."""
    B = batch or scan.batch_size
    n = options.num_devices or usable
    if options.mesh is not None:
        sizes = [options.mesh[0] * options.mesh[1]] if p * math.prod(options.mesh) <= n \
            else []
    else:
        # a stage's devices: all of them, or fewer (energy may prefer fewer devices)
        sizes = [n // p >> i for i in range(1 if options.num_devices else MESH_SIZES)
                 if n % p == 0 and n // p >> i >= 1]
    if not sizes or B % p:
        return None
    priced = functools.partial(_priced, fn, args, scan, p, B, sizes, cluster, objective,
                               options, budget, forced, rules, tree_calls)
    best, stack_live, graph, binds = priced(False)
    if best is None or (best.fits and binds) or (
            not best.fits and _inputs_only_may_fit(best, stack_live, graph, scan, B, budget)):
        inputs_only = priced(True)[0]
        if inputs_only is not None and (best is None or _better(inputs_only, best, objective,
                                                                 cluster)):
            best = inputs_only
    return best


def _inputs_only_may_fit(best: MeshResult, stack_live: float, graph: Graph | None,
                         scan: LayerScan, B: int, budget: float) -> bool:
    """Whether keeping only each loop step's input could bring `best` (the schedule that
    keeps what its layers keep) within the budget: its peak less what the loop holds
    (all the loop's residuals, the stack's weights it holds: `loop_held`) plus what the
    loop holds keeping the inputs alone, at its own mesh, in its rounds or GPipe's
    (whose bubble is computed, one chunk fewer held). Where not, its stage step is not
    traced again."""
    step = best.step
    if step is None or graph is None:
        return True
    row = scan.carry_row_bytes / carry_split(scan, best.m)
    k = chunking(scan.length, step.stages)[0]
    relaid = k * step.stages != scan.length
    share, gathered = stack_shares(graph, best.strategies, scan.stacked, best.d, best.m)

    def holds(v: StepVariant) -> float:
        return (loop_memory(stack_live, row, B, best.d, v, scan.row_const_bytes)
                + loop_held(share, gathered, k, v, relaid))
    lean = min(holds(dataclasses.replace(step, remat="stage", repeats=r))
               for r in {step.repeats, 1})
    return best.predicted.peak_memory_bytes - holds(step) + lean <= budget


def _priced(fn: TrainStep, args: Sequence[Any], scan: LayerScan, p: int, B: int,
            sizes: Sequence[int], cluster: Cluster, objective: Objective,
            options: PlanOptions, budget: float, forced: dict[str, int] | None,
            rules: LayoutRules | None, tree_calls: int, stage_remat: bool
            ) -> tuple[MeshResult | None, float, Graph | None, bool]:
    """`_best_for_stages`' search for one kind of loop step: keeping what its layers
    keep, or (`stage_remat`) its input alone; what the stack keeps for the backward
    pass (`stack_kept`, with no layout splitting it); the stage graph; and whether the
    budget binds: a candidate that does not fit ranks above the best one that does, or
    the best one's layouts hold something in host memory, which no layout does but to fit
    (its PCIe transfers never save time): the stage step had less room than its fastest
    layouts need, which a loop keeping only its inputs may give it."""
    # the stage step at the rows the layers outside the stack see (the batch is split
    # over stage x data), and again with twice the layers: what the stack's k layers
    # keep for the backward pass is the difference (the pipeline keeps it for all its
    # micro-batches, p times these rows; with `stage_remat`, what its recomputation
    # holds, for one micro-batch at a time)
    k = chunking(scan.length, p)[0]                # layer slots per stage
    fixed_rows = bool(options.batch_size)
    graph = dataclasses.replace(stage_graph(fn, args, scan, k, B // p, fixed_rows, stage_remat),
                                tree_calls=tree_calls)
    if not (graph.repeat == k).any():
        return None, 0.0, None, False
    twice = stage_graph(fn, args, scan, 2 * k, B // p, fixed_rows, stage_remat)
    whole = [Strategy("replicate", (None,) * len(x.shape)) for x in graph.params]
    stack_live = stack_kept(graph, twice, whole, 1)     # none split over a model axis
    stacked = set(scan.stacked)
    if options.mesh is None and not options.num_devices:
        # a stage's rows with few factors of two split over few of the halvings: the
        # stage sizes that split them and shard the stage's weights further
        sizes = sorted(set(sizes) | even_split_counts(
            sizes[0], B // p, graph, 1, cluster.mesh_node_size, list(sizes)), reverse=True)
    meshes = [dm for size in sizes for dm in mesh_shapes(
        size, B // p, graph, num_devices_exact=size, mesh=options.mesh,
        node_size=cluster.mesh_node_size)[0]
        if pins_hold(graph, rules, *dm, options.offload) is None]
    remat = "stage" if stage_remat else "none"
    best: MeshResult | None = None
    free: MeshResult | None = None         # the best with no budget
    for d, m in meshes:
        variants = [StepVariant(micro_batches=mb, stages=p, repeats=rr, remat=remat)
                    for mb, rr in schedule_shapes(B // d, p, scan.length, forced)]
        if not variants:
            continue
        solved = functools.partial(_solved, graph, twice, cluster, d, m, stacked, scan,
                                   variants, k, B, stack_live, budget, options.offload)
        cands = solved(rules)
        if any(c.strategies[j].data_sharded for c in cands for j in stacked):
            # the stage step is solved as a step that runs each layer once a pass, where
            # an FSDP layer's weights are gathered once; the loop gathers them on every
            # loop step, forward and backward: the stage with its stacked weights whole
            # over the data axis (their optimizer state may still be ZeRO-1) is priced too
            cands += solved((rules or LayoutRules()).keeping_whole(stacked))
        for cand in cands:
            if best is None or _better(cand, best, objective, cluster):
                best = cand
            if free is None or _ranks_above(cand, free, objective, cluster):
                free = cand
    binds = free is not None and not free.fits or (
        best is not None and best.fits and any(s.offload for s in best.strategies))
    return best, stack_live, graph, binds


def _solved(graph: Graph, twice: Graph, cluster: Cluster, d: int, m: int, stacked: set[int],
            scan: LayerScan, variants: Sequence[StepVariant], k: int, B: int,
            stack_live: float, budget: float, offload: bool, rules: LayoutRules | None
            ) -> list[MeshResult]:
    """The stage step solved on (d, m) under `rules` and each schedule in `variants`
    priced on its layouts (`_candidates`; none where no layout uses the model axis). The
    stage's layouts must leave room for the least the loop holds beside them; what the
    loop holds depends on those layouts (the weights a loop step slices, the reordered
    copy of an uneven or circular stack), so where none of the schedules fits, the stage
    is solved again with `over` less room than its layouts needed (`RESOLVES` times at
    most). Less room than the stage step was given would change nothing where the step
    was well within it, its need small beside what the loop holds of its share: Llama 3
    405B on Meta's 16 stages x TP8 (126 layers, 8 a stage) needed 45.7 GB of 68.3 GB of
    room and the loop 28.2 GB more, 1.9 GB over 72 GB, and three solves within 68.3, 66.4
    and 64.5 GB returned the same layouts; asked for 43.8 GB, the step shards more (its
    embedding, first) and the pipeline fits."""
    split = carry_split(scan, m)
    row = scan.carry_row_bytes / split
    least = inputs_split(stack_live, scan, k, B / variants[0].stages, split)
    room = budget - min(loop_memory(least, row, B, d, v, scan.row_const_bytes)
                        for v in variants)
    out: list[MeshResult] = []
    for _ in range(RESOLVES + 1):
        stage = solve_mesh(graph, cluster, d, m, max(room, 0.0), offload, rules)
        if not uses_model_axis(stage):
            break
        cands = _candidates(graph, twice, cluster, stage, d, m, stacked, scan, variants, k,
                            B, stack_live, budget)
        out += cands
        if not cands:             # no layout of the stage step stores the stack uneven
            break
        over = min(c.predicted.peak_memory_bytes for c in cands) - budget
        if any(c.fits for c in cands) or over <= 0 or not stage.fits:
            break
        room = min(room, stage.predicted.peak_memory_bytes) - over
    return out


def _candidates(graph: Graph, twice: Graph, cluster: Cluster, stage: MeshResult, d: int,
                m: int, stacked: set[int], scan: LayerScan, variants: Sequence[StepVariant],
                k: int, B: int, stack_live: float, budget: float) -> list[MeshResult]:
    """Each schedule in `variants` priced on the stage's solution `stage` on (d, m)."""
    p = variants[0].stages
    strategies = staged_layouts(stage.strategies, stacked, graph, p, d, m, k * p != scan.length)
    if strategies is None:
        return []
    specs = stage_specs(stage.strategies, scan.stacked)
    # what the tensor-parallel layers keep is split over the model axis too, and so are
    # the layers' inputs, kept split between them
    kept = stack_live if m == 1 else inputs_split(
        stack_kept(graph, twice, stage.strategies, m), scan, k, B / p, carry_split(scan, m))
    out = []
    for variant in variants:
        variant = dataclasses.replace(variant, stage_specs=specs)
        pred = pipeline_prediction(graph, cluster, stage.predicted, d, m, stage.strategies,
                                   sorted(stacked), variant, k, scan.carry_row_bytes, B, kept,
                                   scan.length, carry_split(scan, m), scan.row_const_bytes)
        out.append(MeshResult(d, m, strategies, pred, stage.fits and
                              pred.peak_memory_bytes <= budget, step=variant))
    return out


def _better(a: MeshResult, b: MeshResult, objective: Objective, cluster: Cluster) -> bool:
    """Whether a beats b: fitting first, then the objective's score."""
    if a.fits != b.fits:
        return a.fits
    if not a.fits:
        return a.predicted.peak_memory_bytes < b.predicted.peak_memory_bytes
    return _ranks_above(a, b, objective, cluster)


def _ranks_above(a: MeshResult, b: MeshResult, objective: Objective, cluster: Cluster
                 ) -> bool:
    """Whether the objective's score puts a above b, memory aside."""
    return cluster.ranker(objective)([a.predicted, b.predicted]).best == 0


__all__ = ["Pipelines", "plan_pipelines", "with_pipelines"]
