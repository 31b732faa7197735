"""Planning: abstract arguments in, `Plan` out. No real arrays, no device work.

trace (`trace.layout_of`) -> plan cache lookup -> for each step variant, in order of cost
(the step as written, then remat, then micro-batches, for a `make_train_step` step):
graph (`graph.analyze`) -> search (`solve.search`) -> verification (`verify`, XLA
compiles of the finalists) -> the decision and the Plan (`choose.build_plan`). Measured
choice (`measure`) runs later, on real arrays, and comes back through
`record_measurements`, which builds the plan again with its measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from jaxwap.analysis.fused_attention import planned_device, require_target, target_checks
from jaxwap.analysis.graph import Graph, analyze
from jaxwap.analysis.trace import ArgLayout, layout_of, trace_layout
from jaxwap.calibration.calibrate import load_calibration
from jaxwap.calibration.host_calls import tree_calls
from jaxwap.core.records import Measurement, StepVariant
from jaxwap.core.units import si
from jaxwap.decide.attention_advice import fused_alternative, planned_score_sites
from jaxwap.decide.choose import PlanContext, build_plan, chosen_result
from jaxwap.decide.no_fit import nothing_fits, nothing_fits_compiled
from jaxwap.decide.verify import Verification, compile_candidate, run_verification, unverifiable
from jaxwap.hardware.cluster import Cluster, DeviceSpec, detect_cluster, device_memory_limit
from jaxwap.options import PlanOptions
from jaxwap.plan_check import plan_mismatch
from jaxwap.plans.cache import PlanCache, jaxpr_fingerprint, plan_key
from jaxwap.plans.plan import Plan
from jaxwap.runtime.compile import CompiledStep
from jaxwap.runtime.train_step import TrainStep, ladder, restructured
from jaxwap.search.constraints import LayoutRules, path_string
from jaxwap.search.memory_repair import micro_batch_floor
from jaxwap.search.pipeline_search import Pipelines, plan_pipelines, with_pipelines
from jaxwap.search.solve import SearchResult, search

# Share of device memory kept free for XLA's workspace, fragmentation and the runtime.
MEMORY_HEADROOM = 0.10


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


def resolve_cluster(hardware: Cluster | DeviceSpec | str | None,
                    devices: Sequence[Any]) -> tuple[Cluster, str | None]:
    """The hardware to plan for: as given (a Cluster, or a DeviceSpec or profile name for
    one of each device; `PlanOptions` has checked the type), or the devices found (with
    their calibration, when `jaxwap calibrate` cached one for them)."""
    if hardware is None:
        return detect_cluster(devices, load_calibration(devices[0]))
    if isinstance(hardware, Cluster):
        return hardware, None
    return Cluster(hardware, len(devices)), None


def memory_budget(options: PlanOptions, cluster: Cluster, device: Any | None) -> float:
    """Bytes per device a plan may use: as given, else the profile's memory or the present
    devices' own limit where JAX exposes it (`memory_stats()["bytes_limit"]`) and it is
    smaller (`device` None: planning for devices not present, the profile alone), less the
    headroom."""
    if options.memory_budget is not None:
        return options.memory_budget
    limit = None if device is None else device_memory_limit(device)
    memory = cluster.device.memory_bytes if limit is None else \
        min(cluster.device.memory_bytes, float(limit))
    return memory * (1 - MEMORY_HEADROOM)


def node_major(devices: Sequence[Any]) -> tuple[Any, ...]:
    """Devices numbered node by node (a process's devices are a node), as `Cluster` and
    `compile.make_mesh` lay meshes out: a mesh's innermost (model) axis then takes
    devices of one node, the data axis spans the nodes."""
    return tuple(sorted(devices, key=lambda d: (d.process_index, d.id)))


def make_plan(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any], *, params: Any,
              options: PlanOptions, for_hardware: bool = False) -> Planned:
    """`_make_plan`, its traces made for the hardware planned for: jax's trace-time checks
    of cuDNN's fused attention answer for that target where this host cannot
    (`fused_attention.target_checks`)."""
    target = planned_device(options.plan.hardware if options.plan is not None
                            else options.hardware)
    with target_checks(target):
        return _make_plan(fn, args, kwargs, params=params, options=options,
                          for_hardware=for_hardware)


def _make_plan(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any], *, params: Any,
               options: PlanOptions, for_hardware: bool = False) -> Planned:
    """Plan `fn` for these (abstract or concrete) arguments under `options`.

    The devices planned for are those present, unless `for_hardware` and the hardware
    describes more (`jaxwap.plan(..., hardware=Cluster("h100-sxm", 4096, ...))`): then
    the plan is for the described cluster, analytic, since verification compiles on the
    devices themselves. `options.plan` skips planning: the given plan is checked against
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
    described = for_hardware and cluster.num_devices > len(devs)
    usable = cluster.num_devices if described else min(cluster.num_devices, len(devs))
    if described:
        notes.append(f"planned for the {cluster.num_devices} devices the hardware describes, "
                     f"of which {len(devs)} are present: the plan is analytic (predicted), "
                     f"since verification compiles on the devices themselves")
        if options.verify:
            options = dataclasses.replace(options, verify=0)
    elif cluster.num_devices > len(devs):
        notes.append(f"the hardware profile has {cluster.num_devices} devices but only "
                     f"{len(devs)} are present; planned for the {len(devs)} present")
    if options.num_devices is not None and not 1 <= options.num_devices <= usable:
        raise ValueError(f"num_devices={options.num_devices} is outside 1..{usable} "
                         f"(devices usable)")
    if options.mesh is not None and options.mesh[0] * options.mesh[1] > usable:
        raise ValueError(f"mesh_shape={dict(options.mesh_shape)} needs "
                         f"{options.mesh[0] * options.mesh[1]} devices; {usable} are usable")
    budget = memory_budget(options, cluster, None if described else devs[0])
    t0 = time.perf_counter()
    layout, closed = layout_of(fn, args, kwargs, params, options.batch_size)
    timing = {"trace": time.perf_counter() - t0}
    require_target(closed, cluster.device, devs)
    if options.verify and (why := unverifiable(closed, devs)) is not None:
        notes.append(why)
        options = dataclasses.replace(options, verify=0)
    ctx = PlanContext(layout.params, layout.params_treedef, options.objective, cluster, devs,
                      budget, layout.inputs.batch_size)
    store = options.store
    key = None
    if store is not None:
        key = plan_key(
            jaxpr=jaxpr_fingerprint(closed), args=_arg_key(layout),
            params=[(p.path, p.shape, p.dtype) for p in layout.params], options=options,
            devices=devs, hardware=cluster, memory_budget=budget,
            xla_flags=os.environ.get("XLA_FLAGS"),
            # a plan for the devices a Cluster describes is not one for those present
            usable=usable, described=described)
        hit = store.get(key)
        why = None if hit is None else plan_mismatch(hit, layout, devs, usable, options,
                                                     same_devices=not described)
        if why is not None:
            store.drop(key, f"its plan cannot run here: {why}")
        elif hit is not None:
            plan = dataclasses.replace(hit, _treedef=layout.params_treedef)
            return Planned(plan, layout, dataclasses.replace(ctx, step=plan.step), fn=_variant_fn(
                fn, plan.step), cache_key=key)
    if cluster.device.python_call_s:   # counted for a plan to be made, not one read back
        ctx = dataclasses.replace(ctx, tree_calls=tree_calls(layout))
    platform = cluster.device.name.split()[0] if described else devs[0].platform
    rules = options.rules(layout.params)
    if rules is not None and rules.pins:
        notes.append("constraints pin " + "; ".join(
            f"{path_string(layout.params[j].path)} to {c.describe()}" for j, c in rules.pins))
    pipes = _optional_pipelines(fn, layout, cluster, options, usable, budget, rules,
                                ctx.tree_calls)
    timing["pipeline"] = pipes.seconds
    if pipes.reason is not None:
        if options.forced_pipeline is not None:
            raise ValueError(f"pipeline={options.forced_pipeline} cannot be used: "
                             f"{pipes.reason}")
        notes.append(f"pipelining not considered: {pipes.reason}")
    found = _search_variants(fn, layout, closed, ctx, options, usable, timing, notes,
                             "cpu" if platform == "cpu" else "accelerator", pipes, rules)
    scores = planned_score_sites(
        notes, found.graph, lambda: closed if found.rung.is_plain else trace_layout(
            found.fn, layout), layout.inputs.roles, layout.outputs.roles, layout.params,
        cluster.device, _searcher(ctx, options, usable, rules, found.rung.micro_batches))
    ctx = dataclasses.replace(ctx, step=found.rung, timing=timing, notes=tuple(notes),
                              attention=scores)
    plan = build_plan(ctx, found.search, found.verification)
    if store is not None and key is not None and not options.measure:
        store.put(key, plan)
    ver = found.verification
    return Planned(plan, layout, ctx, found.graph, found.search, ver,
                   ver.compiled_best if ver is not None and chosen_result(plan) == ver.best
                   else None, None if found.rung.is_plain else found.fn, key)


def _failed(e: BaseException) -> str:
    """An optional branch's failure, as a plan note says it: the exception and its first
    line (the branch is skipped; the plan goes on without it)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _optional_pipelines(fn: Callable, layout: ArgLayout, cluster: Cluster,
                        options: PlanOptions, usable: int, budget: float,
                        rules: LayoutRules | None, calls: int) -> Pipelines:
    """The pipelined candidates, an optional branch: a step that jaxwap cannot build into
    stages (a failure anywhere in tracing, cutting or solving its stages) is planned
    without them, the reason in the plan's notes. Only a pipeline the user forced makes
    the failure the plan's."""
    t0 = time.perf_counter()
    try:
        return plan_pipelines(fn, layout, cluster, options.objective, options, usable,
                              budget, rules, tree_calls=calls)
    except Exception as e:  # noqa: BLE001 - the plan goes on without pipelines, saying why
        if options.forced_pipeline is not None:
            raise
        return Pipelines((), f"building the stages failed ({_failed(e)})",
                         time.perf_counter() - t0)


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
                   fn=_variant_fn(fn, plan.step))


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


# --------------------------------------------------------------------------- step variants
@dataclass(frozen=True)
class _Found:
    """The step variant that fits, and what its planning found."""

    rung: StepVariant
    fn: Callable
    graph: Graph
    search: SearchResult
    verification: Verification | None


def _search_variants(fn: Callable, layout: ArgLayout, closed: Any, ctx: PlanContext,
                     options: PlanOptions, usable: int, timing: dict[str, float],
                     notes: list[str], platform: str, pipes: Pipelines,
                     rules: LayoutRules | None = None) -> _Found:
    """The step as written first; a step built by make_train_step may then be
    restructured (remat, micro-batches), in order of expected cost, until a plan fits.
    `platform` is the planned-for devices' ("cpu": XLA:CPU drops remat). The pipelined
    candidates `pipes` are weighed beside the step as written (alone when forced)."""
    B = layout.inputs.batch_size
    rungs = [StepVariant()]
    # a forced pipeline is its own restructuring: no other rung may stand in for it
    if isinstance(fn, TrainStep) and fn.variant.is_plain and options.forced_pipeline is None:
        rungs += ladder(B, platform)
    timing.update(analyze=0.0, search=0.0)
    tried: list[str] = []
    first_error: str | None = None
    plain_graph: list[Graph] = []

    def attempt(rung: StepVariant) -> _Found | None:
        """Plan one variant; None (and what was tried, and why not) when nothing fits."""
        nonlocal first_error
        fn_v = _variant_fn(fn, rung) or fn
        ta = time.perf_counter()
        try:
            graph = dataclasses.replace(
                analyze(closed if rung.is_plain else trace_layout(fn_v, layout),
                        layout.inputs.roles, layout.outputs.roles, layout.params, B),
                tree_calls=ctx.tree_calls)
        except Exception as e:  # noqa: BLE001 - a restructuring is optional: skip it, say why
            if rung.is_plain:
                raise
            tried.append(f"{rung.describe()}: could not be built ({_failed(e)})")
            notes.append(f"step variant skipped: {tried[-1]}")
            return None
        if rung.is_plain:
            plain_graph.append(graph)
        tb = time.perf_counter()
        base = _searcher(ctx, options, usable, rules, rung.micro_batches)

        def searcher(budget: float) -> SearchResult:   # _tighten searches smaller budgets
            return base(graph, budget=budget)
        try:
            result = searcher(ctx.budget)
        except ValueError as e:
            if rung.is_plain:
                raise
            tried.append(f"{rung.describe()}: {str(e).split('(')[0].strip()}")
            return None
        if rung.is_plain:
            result = with_pipelines(result, pipes, ctx.objective, ctx.cluster,
                                    only=options.forced_pipeline is not None)
        timing["analyze"] += tb - ta
        timing["search"] += time.perf_counter() - tb
        best = result.results[result.best]
        ver = None
        if not best.fits:
            error = nothing_fits(result, ctx.budget, B, rules, ctx.params)
        else:
            error = None
            if options.verify:
                verifier = functools.partial(_verify, fn_v, layout, ctx, options)
                ver = verifier(result)
                timing["verify"] = timing.get("verify", 0.0) + ver.verify_time_s
                if ver.best < 0 and ver.figures:
                    result, ver = _tighten(result, ver, searcher, verifier, ctx.budget,
                                           timing, notes)
                if ver.best < 0:
                    error = nothing_fits_compiled(ver, result, ctx.budget, B)
        if error is None:
            return _Found(rung, fn_v, graph, result, ver)
        first_error = first_error or error
        tried.append(f"{rung.describe()}: " + (
            f"needs {si(best.predicted.peak_memory_bytes, 'B')} per device (predicted)"
            if not best.fits else "no candidate fits by XLA's analysis"))
        return None

    # the step as written, then remat policies, in order; then the fewest micro-batches
    # that fit, found by bisection (more micro-batches hold fewer activations at once, so
    # whether k fits is monotone in k): a few traces instead of one per count
    fixed = [r for r in rungs if r.micro_batches == 1]
    micro = [r for r in rungs if r.micro_batches > 1]
    found = next((f for f in map(attempt, fixed) if f is not None), None)
    lo, hi = 0, len(micro) - 1
    if found is None and micro and plain_graph:
        # counts whose activations alone, estimated from the step as written, leave no
        # layout within the budget are not traced (5% margin for the estimate)
        floor = functools.partial(micro_batch_floor, plain_graph[0], ctx.cluster, usable,
                                  offload=options.offload, allowed=rules,
                                  num_devices_exact=options.num_devices, mesh=options.mesh)
        while lo < hi and (need := floor(micro[lo].micro_batches)) > 1.05 * ctx.budget:
            tried.append(f"{micro[lo].describe()}: needs at least {si(need, 'B')} per "
                         f"device (estimated)")
            lo += 1
    mid = lo
    while found is None and lo <= hi:
        got = attempt(micro[mid])
        if got is None:
            lo = mid + 1
        else:
            found, hi = got, mid - 1
            while lo <= hi:   # a smaller count may fit too
                mid = (lo + hi) // 2
                smaller = attempt(micro[mid])
                if smaller is None:
                    lo = mid + 1
                else:
                    found, hi = smaller, mid - 1
        mid = (lo + hi) // 2
    if found is None:
        more = (f" Also tried restructuring the step: {'; '.join(tried[1:])}."
                if len(tried) > 1 else "")
        more += fused_alternative(
            plain_graph[0] if plain_graph else None, closed, layout.inputs.roles,
            layout.outputs.roles, layout.params, ctx.cluster.device,
            _searcher(ctx, options, usable, rules))
        raise MemoryError(f"{first_error}{more}")
    rung, fn_v, graph, result, ver = (found.rung, found.fn, found.graph, found.search,
                                      found.verification)
    if graph.unmodeled:
        notes.append("ops priced by a generic rule (no roofline rule): "
                     + ", ".join(graph.unmodeled))
    if not rung.is_plain:
        notes.append(f"the step as written does not fit ({tried[0]}); restructured: "
                     f"{rung.describe()}")
    if isinstance(fn, TrainStep) and tried:
        notes.append("rematerialization not tried: the memory model credits no saving to "
                     "a whole-step checkpoint (its recomputation replays the forward pass at "
                     "once); micro-batches were")
    return _Found(rung, fn_v, graph, result, ver)


def _searcher(ctx: PlanContext, options: PlanOptions, usable: int,
              rules: LayoutRules | None, micro_batches: int = 1
              ) -> Callable[[Graph], SearchResult]:
    """The search a graph of the step gets under these options, the budget bound (a
    caller may pass another `budget=`): the step's variants, and the fused counterfactual
    of its attention (`attention_scores`)."""
    return functools.partial(search, cluster=ctx.cluster, objective=ctx.objective,
                             num_devices=usable, budget=ctx.budget,
                             num_devices_exact=options.num_devices,
                             micro_batches=micro_batches, offload=options.offload,
                             mesh=options.mesh, allowed=rules, replicas=options.replicas)


def _verify(fn: Callable, layout: ArgLayout, ctx: PlanContext, options: PlanOptions,
            result: SearchResult) -> Verification:
    """Compile the search's finalists exactly as they would run, and rank them on XLA's
    figures."""
    compile_fn = functools.partial(compile_candidate, fn, layout, devices=ctx.devices,
                                   cluster=ctx.cluster, donate=options.donate,
                                   compiler_options=options.compiler_options)
    return run_verification(result, options.verify, compile_fn, cluster=ctx.cluster,
                            objective=ctx.objective, budget=ctx.budget,
                            batch_size=ctx.batch_size or 1)


def _tighten(result: SearchResult, ver: Verification,
             searcher: Callable[[float], SearchResult],
             verifier: Callable[[SearchResult], Verification], budget: float,
             timing: dict[str, float], notes: list[str], attempts: int = 3
             ) -> tuple[SearchResult, Verification]:
    """When XLA needs more than the model predicted for every compiled candidate, search
    again for a modelled budget shrunk by how far the closest one missed, so the repairs
    (optimizer state sharded or kept in host memory) get their chance before the step is
    restructured. A few rounds: each compile tells how much more to free."""
    modelled = budget
    for _ in range(attempts):
        i = min(ver.figures, key=lambda i: ver.figures[i].memory_bytes)
        need = ver.figures[i].memory_bytes
        if need <= budget:
            break
        modelled = min(modelled, result.results[i].predicted.peak_memory_bytes) \
            * budget / need * 0.98
        t_s = time.perf_counter()
        again = searcher(modelled)
        timing["search"] += time.perf_counter() - t_s
        if not again.results[again.best].fits:
            break
        ver2 = verifier(again)
        timing["verify"] = timing.get("verify", 0.0) + ver2.verify_time_s
        if not ver2.figures:
            break
        result, ver = again, ver2
        if ver.best >= 0:
            notes.append(f"the memory model under-counted XLA's figures: searched again for "
                         f"{si(modelled, 'B')} of modelled memory to fit {si(budget, 'B')}")
            break
    return result, ver


def _variant_fn(fn: Callable, variant: StepVariant) -> Callable | None:
    """The step restructured as `variant` says (None: the step as written)."""
    return None if variant.is_plain else restructured(fn, variant)


__all__ = ["MEMORY_HEADROOM", "Planned", "make_plan", "memory_budget", "node_major",
           "record_measurements", "resolve_cluster"]
