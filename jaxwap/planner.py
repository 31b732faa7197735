"""Planning: abstract arguments in, `Plan` out. No real arrays, no device work.

The hardware and the devices usable (`planning.devices`) -> trace (`trace.layout_of`) -> plan
cache lookup -> for each step variant, in order of cost (the step as written, then
micro-batches, for a `make_train_step` step; `step_variants`): graph (`graph.analyze`) ->
search (`across_meshes.search`) -> verification (`verified_search`, XLA compiles of the
finalists) -> the decision and the Plan (`choose.build_plan`). Measured choice (`measure`)
runs later, on real arrays, and comes back through `record_measurements`, which builds
the plan again with its measurements.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from jaxwap.analysis.fused_attention import planned_device, require_target, target_checks
from jaxwap.analysis.graph import Graph
from jaxwap.analysis.trace import ArgLayout, layout_of
from jaxwap.calibration.host_calls import tree_calls
from jaxwap.core.collector import collector_paused
from jaxwap.core.records import Measurement
from jaxwap.decide.attention_advice import planned_score_sites
from jaxwap.decide.choose import PlanContext, build_plan, chosen_result
from jaxwap.decide.verify import Verification, unverifiable
from jaxwap.options import PlanOptions
from jaxwap.planning.devices import memory_budget, node_major, resolve_cluster, usable_devices
from jaxwap.planning.plan_check import plan_mismatch
from jaxwap.planning.step_variants import optional_pipelines, search_variants, variant_fn
from jaxwap.planning.verified_search import step_searcher
from jaxwap.plans.cache import PlanCache, plan_key
from jaxwap.plans.fingerprint import jaxpr_fingerprint
from jaxwap.plans.plan import Plan
from jaxwap.runtime.compile import CompiledStep
from jaxwap.runtime.train_step import planned_trace
from jaxwap.search.constraints import path_string
from jaxwap.search.solve import SearchResult


@dataclass(frozen=True)
class Planned:
    """A plan with what it takes to compile it, re-decide it, and keep it.

    `graph`, `search` and `verification` are None for a plan read back from the cache;
    `compiled` is the chosen candidate's compiled step when verification compiled it;
    `fn` is the step to compile when the plan restructured it (micro-batches, remat);
    `cache_key` is where the plan lives in the plan cache (None: no cache)."""

    plan: Plan
    layout: ArgLayout
    context: PlanContext
    graph: Graph | None = None
    search: SearchResult | None = None
    verification: Verification | None = None
    compiled: CompiledStep | None = None
    fn: Callable | None = None
    cache_key: str | None = None

    @property
    def devices(self) -> tuple[Any, ...]:
        """The devices the plan runs on."""
        return self.context.devices[: self.plan.num_devices]

    @property
    def all_devices(self) -> tuple[Any, ...]:
        """Every device the planning could use (finalists may use more than the choice)."""
        return self.context.devices


def make_plan(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any], *, params: Any,
              options: PlanOptions, for_hardware: bool = False) -> Planned:
    """`_make_plan`, its traces made for the hardware planned for: jax's trace-time checks
    of cuDNN's fused attention answer for that target where this host cannot
    (`fused_attention.target_checks`), with Python's cyclic collector paused
    (`collector.collector_paused`: a deep model's traces make its full collections most
    of what they walk)."""
    target = planned_device(options.plan.hardware if options.plan is not None
                            else options.hardware)
    with target_checks(target), collector_paused():
        return _make_plan(fn, args, kwargs, params=params, options=options,
                          for_hardware=for_hardware)


def _make_plan(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any], *, params: Any,
               options: PlanOptions, for_hardware: bool = False) -> Planned:
    """Plan `fn` for these (abstract or concrete) arguments under `options`.

    The devices planned for are those present, unless `for_hardware` and the hardware
    describes more (`jaxwap.plan(..., hardware=Cluster("h100-sxm", 4096, ...))`): then
    the plan is for the described cluster, analytic, since verification compiles on the
    devices themselves. The step variants are those of the hardware's compiler where
    the plan is for it: for the described cluster, or, with `for_hardware`, hardware
    given and nothing verified, for that hardware whatever devices are present (`jaxwap.plan(...,
    hardware=Cluster("a100-sxm-80gb", 8), verify=0)` on 8 CPU devices plans for A100s,
    not XLA:CPU). `options.plan` skips planning: the given plan is checked against
    the devices and step present and used as it is.

    A plan made before for the same step, arguments, devices, hardware and options is
    read back from the plan cache instead of searched for (`Planned.search is None`).
    With `options.measure` the plan is cached only once `record_measurements` has the
    measured choice, so a cache hit is always the plan that should run.
    """
    devs = node_major(options.devices or tuple(jax.devices()))
    if options.plan is not None:
        return _given_plan(fn, args, kwargs, params, options, devs)
    cluster, note = resolve_cluster(options.hardware, devs)
    notes = [note] if note else []
    usable, described, options = usable_devices(cluster, len(devs), for_hardware, options,
                                                notes)
    budget = memory_budget(options, cluster, None if described else devs[0])
    t0 = time.perf_counter()
    # the step as the planner traces it (`TrainStep.planned_as`): the same program
    layout, closed = planned_trace(
        lambda f: layout_of(f, args, kwargs, params, options.batch_size), fn)
    timing = {"trace": time.perf_counter() - t0}
    require_target(closed, cluster.device, devs)
    if options.verify and (why := unverifiable(closed, devs)) is not None:
        notes.append(why)
        options = dataclasses.replace(options, verify=0)
    ctx = PlanContext(layout.params, layout.params_treedef, options.objective, cluster, devs,
                      budget, layout.inputs.batch_size)
    key, hit = _cache_lookup(closed, layout, options, ctx, usable, described)
    if hit is not None:
        plan = dataclasses.replace(hit, _treedef=layout.params_treedef)
        return Planned(plan, layout, dataclasses.replace(ctx, step=plan.step), fn=variant_fn(
            fn, plan.step), cache_key=key)
    if cluster.device.python_call_s:   # counted for a plan to be made, not one read back
        ctx = dataclasses.replace(ctx, tree_calls=tree_calls(layout))
    return _searched_plan(fn, layout, closed, ctx, options, usable,
                          described or (for_hardware and options.hardware is not None
                                        and not options.verify), timing, notes, key)


def _cache_lookup(closed: Any, layout: ArgLayout, options: PlanOptions, ctx: PlanContext,
                  usable: int, described: bool) -> tuple[str | None, Plan | None]:
    """(the step's key in the plan cache, the plan kept there that can run here): (None,
    None) without a cache; a kept plan that cannot run here (`plan_check.plan_mismatch`)
    is dropped, with the reason, and planned again."""
    store = options.store
    if store is None:
        return None, None
    key = plan_key(
        jaxpr=jaxpr_fingerprint(closed), args=_arg_key(layout),
        params=[(p.path, p.shape, p.dtype) for p in layout.params], options=options,
        devices=ctx.devices, hardware=ctx.cluster, memory_budget=ctx.budget,
        xla_flags=os.environ.get("XLA_FLAGS"),
        # a plan for the devices a Cluster describes is not one for those present
        usable=usable, described=described)
    hit = store.get(key)
    why = None if hit is None else plan_mismatch(hit, layout, ctx.devices, usable, options,
                                                 same_devices=not described)
    if why is not None:
        store.drop(key, f"its plan cannot run here: {why}")
        return key, None
    return key, hit


def _searched_plan(fn: Callable, layout: ArgLayout, closed: Any, ctx: PlanContext,
                   options: PlanOptions, usable: int, for_hardware: bool,
                   timing: dict[str, float], notes: list[str], key: str | None) -> Planned:
    """The plan searched for: the constraints' pins said, the pipelined candidates, the
    step variants until one fits, the attention advice's scores, the decision; kept in
    the plan cache under `key` unless measurements are still to come. `for_hardware`:
    the step is planned for the hardware's compiler, not the present devices'."""
    cluster, devs = ctx.cluster, ctx.devices
    # a profile's name says its platform ("cpu", "calibrated cpu", "h100-sxm", ...)
    on_cpu = "cpu" in cluster.device.name.lower() if for_hardware else devs[0].platform == "cpu"
    rules = options.rules(layout.params)
    if rules is not None and rules.pins:
        notes.append("constraints pin " + "; ".join(
            f"{path_string(layout.params[j].path)} to {c.describe()}" for j, c in rules.pins))
    pipes = optional_pipelines(fn, layout, cluster, options, usable, ctx.budget, rules,
                               ctx.tree_calls, notes, traced=closed)
    timing["pipeline"] = pipes.seconds
    found = search_variants(fn, layout, closed, ctx, options, usable, timing, notes,
                            "cpu" if on_cpu else "accelerator", pipes, rules)
    scores = planned_score_sites(
        notes, found.graph, lambda: found.closed, layout.inputs.roles, layout.outputs.roles,
        layout.params, cluster.device,
        step_searcher(ctx, options, usable, rules, found.rung.micro_batches))
    ctx = dataclasses.replace(ctx, step=found.rung, timing=timing, notes=tuple(notes),
                              attention=scores)
    plan = build_plan(ctx, found.search, found.verification)
    if options.store is not None and key is not None and not options.measure:
        options.store.put(key, plan)
    ver = found.verification
    # the step the plan chose: a pipeline is weighed beside the step as written, so the
    # chosen step can be a pipeline where the variant searched was the step as written
    return Planned(plan, layout, ctx, found.graph, found.search, ver,
                   ver.compiled_best if ver is not None and chosen_result(plan) == ver.best
                   else None, variant_fn(fn, plan.step), key)


def _given_plan(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any], params: Any,
                options: PlanOptions, devs: tuple[Any, ...]) -> Planned:
    """`options.plan`, made elsewhere (ahead of time, for this cluster), checked against
    the devices present and the step's parameters, ready to compile: no search."""
    plan = options.plan
    assert plan is not None
    if plan.hardware.num_devices != len(devs):
        raise ValueError(
            f"plan= was made for a cluster of {plan.hardware.num_devices} devices "
            f"({plan.hardware.describe_links()}), but {len(devs)} devices are present: run "
            f"it on the cluster it was made for, or plan again for these devices")
    layout, _ = layout_of(fn, args, kwargs, params, options.batch_size)
    why = plan_mismatch(plan, layout, devs, len(devs), options, same_devices=False)
    if why is not None:
        raise ValueError(f"plan= cannot run this step here: {why}")
    ctx = PlanContext(layout.params, layout.params_treedef, plan.objective, plan.hardware,
                      devs, plan.memory_budget_bytes, layout.inputs.batch_size, step=plan.step)
    return Planned(dataclasses.replace(plan, _treedef=layout.params_treedef), layout, ctx,
                   fn=variant_fn(fn, plan.step))


def _arg_key(layout: ArgLayout) -> list[tuple[Any, ...]]:
    """Every argument leaf as the cache key needs it, in plain values (cheap to encode:
    a GPT-2 step has 450 leaves): path, shape, dtype, weak type, sharding, role."""
    return [(path, tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)),
             a.sharding, r.kind, r.param, r.mirror)
            for path, a, r in zip(layout.inputs.paths, layout.inputs.avals,
                                  layout.inputs.roles, strict=True)]


def record_measurements(planned: Planned, measured: Mapping[int, Measurement],
                        seconds: float, store: PlanCache | None) -> Planned:
    """The plan decided again with the finalists' measurements beside their predicted and
    compiled figures (the same builder, one more tier), and kept in the plan cache. No
    measurements (nothing to choose between): the plan as it is, kept."""
    if measured:
        assert planned.search is not None, "measured candidates come from a search"
        ctx = dataclasses.replace(planned.context,
                                  timing={**planned.context.timing, "measure": seconds})
        plan = build_plan(ctx, planned.search, planned.verification, measured)
        chosen = chosen_result(plan)
        ver = planned.verification
        planned = dataclasses.replace(
            planned, plan=plan, context=ctx,
            compiled=planned.compiled if ver is not None and chosen == ver.best else None)
    if store is not None and planned.cache_key is not None:
        store.put(planned.cache_key, planned.plan)
    return planned


__all__ = ["Planned", "make_plan", "record_measurements"]
