"""The step variants a plan weighs, cheapest first, until one fits: the step as written
(with its pipelined candidates beside it), then, for a step built by `make_train_step`,
the ladder of restructurings (`train_step.ladder`: per-layer remat policies where the loss
has layers, a layer scan or an unrolled model's repeated blocks, then micro-batches, the
fewest found by bisection). Where only pipelined candidates fit the step as written, the
ladder is climbed too and the objective takes the better of the two.

Each variant is traced and analysed, searched (`verified_search.step_searcher`) and, with
`verify=`, checked by XLA (`verified_search.verify_finalists`, `verified_search.tighten`):
`variant_trials.Trials`; the micro-batch counts are `micro_batch_search`'s.
Pipelines and restructurings are optional branches: one that cannot be built is skipped
with a note, and only the step as written must succeed. When nothing fits, the error says
what was tried and what cuDNN's fused attention would give (`attention_advice`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxwap.analysis.trace import ArgLayout
from jaxwap.core.records import StepVariant
from jaxwap.decide.choose import PlanContext
from jaxwap.hardware.cluster import Cluster
from jaxwap.options import PlanOptions
from jaxwap.planning.micro_batch_search import fewest_micro_batches
from jaxwap.planning.variant_trials import FoundVariant, Trials, failed_note, variant_fn
from jaxwap.runtime.layer_blocks import (
    RepeatedBlocks,
    find_layers,
    saved_dot_bytes,
    saved_input_bytes,
)
from jaxwap.runtime.layer_scan import NoLayerScan, batch_size_of, trace_loss
from jaxwap.runtime.train_step import TrainStep, ladder
from jaxwap.search.constraints import LayoutRules
from jaxwap.search.pipeline_search import Pipelines, plan_pipelines


def optional_pipelines(fn: Callable, layout: ArgLayout, cluster: Cluster,
                       options: PlanOptions, usable: int, budget: float,
                       rules: LayoutRules | None, calls: int, notes: list[str],
                       traced: Any = None) -> Pipelines:
    """The pipelined candidates, an optional branch: a step that jaxwap cannot build into
    stages (a failure anywhere in tracing, cutting or solving its stages) is planned
    without them, the reason in `notes`. Only a pipeline the user forced makes the
    failure the plan's. `traced`: the step's trace (`plan_pipelines`)."""
    t0 = time.perf_counter()
    try:
        pipes = plan_pipelines(fn, layout, cluster, options.objective, options, usable,
                               budget, rules, tree_calls=calls, traced=traced)
    except Exception as e:  # noqa: BLE001 - the plan goes on without pipelines, saying why
        if options.forced_pipeline is not None:
            raise
        pipes = Pipelines((), f"building the stages failed ({failed_note(e)})",
                          time.perf_counter() - t0)
    if pipes.reason is not None:
        if options.forced_pipeline is not None:
            raise ValueError(f"pipeline={options.forced_pipeline} cannot be used: "
                             f"{pipes.reason}")
        notes.append(f"pipelining not considered: {pipes.reason}")
    return pipes


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
    trials = Trials(fn, layout, closed, ctx, options, usable, timing, notes, pipes, rules)
    # the step as written; then per-layer remat policies, in order; then the fewest
    # micro-batches that fit
    # not searched where no layout can fit it and restructurings follow (the pipelined
    # candidates, weighed beside it, need its search)
    found = trials.attempt(StepVariant(), bounded=restructurable and not pipes.results)
    no_layers = None
    # where only a pipeline fits, the ladder's rungs are weighed against it: a pipeline
    # that fits by checkpointing its stages and many micro-batches can be slower than the
    # step with its layers checkpointed over the same devices without stages
    staged_only = found is not None and not any(
        r.fits and r.stages == 1 for r in found.search.results)
    if (found is None or staged_only) and restructurable:
        pipelined, found = found, None
        if staged_only:
            trials.tried.insert(0, "as written: it fits only pipelined")
        # the pipelined search found the layer scan when it considered pipelines at all
        layers, no_layers = ("scan", None) if pipes.reason is None else _layers(fn, layout)
        rungs = ladder(layout.inputs.batch_size, platform, layers=layers,
                       rows=_shard_rows(trials))
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
            found = fewest_micro_batches(trials, micro)
        if found is None or (layered and found.rung.micro_batches > 1):
            # full per-layer remat holds less per micro-batch: fewer of them may fit, and
            # the objective weighs the recomputation against the micro-batches saved; the
            # counts worth tracing bounded from the full-remat step, where it was traced
            remat = [dataclasses.replace(r, remat="layer_full") for r in micro]
            full = trials.graphs.get(StepVariant(remat="layer_full"))
            found = _preferred(ctx, found, fewest_micro_batches(
                trials, remat, base=full, floor=full is not None) if layered else None)
        if pipelined is not None and found is not None:
            won = _preferred(ctx, pipelined, found)
            notes.append(_weighed(pipelined, found, won is found))
            found = won
        found = found or pipelined
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
    """A lower bound on what selective per-layer remat (`layer_dots`) holds per device
    when its forward pass ends: the weight matmuls' outputs it keeps and each layer's
    input, every layer's (`layer_blocks.saved_dot_bytes`, `saved_input_bytes`), and the
    parameters, all split over all `usable` devices (no layout splits them further): a
    Llama-3-70B written as a loop keeps 28 TB of matmul outputs at 256 x 8192 tokens,
    220 GB on each of 128 GPUs, where tracing the variant costs seconds and could only
    confirm the miss. None where the loss has no layers to say it of."""
    got = _loss_layers(fn, layout)
    if isinstance(got, str):
        return None
    jaxpr, layers = got[0].jaxpr, got[1]
    kept = saved_dot_bytes(jaxpr, layers) + saved_input_bytes(jaxpr, layers)
    return (kept + sum(p.nbytes for p in layout.params)) / usable


def _shard_rows(trials: Trials) -> int | None:
    """A data shard's rows on the widest data axis the batch allows (`Trials.meshes` of
    the step as written), for the ladder's micro-batch counts; None where the step has
    no batch or no mesh."""
    graph = trials.plain_graph
    if graph is None or not graph.batch_size:
        return None
    shapes = trials.meshes(graph)
    return graph.batch_size // max(d for d, _ in shapes) if shapes else None


def _weighed(pipelined: FoundVariant, rung: FoundVariant, won: bool) -> str:
    """The note where only pipelines fit the step as written and a restructuring was
    weighed against them: each one's best, predicted, and whether the restructuring
    `won` (the objective's choice)."""
    def best(f: FoundVariant) -> str:
        r = f.search.results[f.search.best]
        return (f"{' x '.join(f'{a}={n}' for a, n in r.mesh)} "
                f"{(r.step or f.rung).describe()} at "
                f"{r.predicted.step_time_s * 1e3:.1f} ms (predicted)")
    return (f"as written, only pipelined candidates fit; the best, {best(pipelined)}, "
            f"{'lost to' if won else 'beat'} {best(rung)}")


def _preferred(ctx: PlanContext, *found: FoundVariant | None) -> FoundVariant | None:
    """The variant whose best candidate the objective ranks first (None: none found)."""
    got = [f for f in found if f is not None]
    if len(got) < 2:
        return got[0] if got else None
    best = [f.search.results[f.search.best].predicted for f in got]
    return got[ctx.cluster.ranker(ctx.objective)(best).best]


__all__ = ["FoundVariant", "optional_pipelines", "search_variants", "variant_fn"]
