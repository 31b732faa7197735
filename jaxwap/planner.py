"""Planning: abstract arguments in, `Plan` out. No real arrays, no device work.

trace (jaxpr of the step from abstract leaves) -> graph (costs and dataflow) ->
search (meshes x per-parameter strategies under the memory budget) -> Plan.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from . import __version__
from .cache import PlanCache, jaxpr_fingerprint, plan_key
from .cost import DATA, MODEL
from .graph import Graph, analyze
from .hardware import Cluster, DeviceSpec, detect_cluster, device_memory_limit
from .objective import Objective
from .plan import Candidate, ParamPlacement, Plan, _si
from .solve import SearchResult, search, uses_model_axis
from .state import (
    BATCH,
    PARAM,
    LeafTable,
    ParamInfo,
    check_params_found,
    classify_leaves,
    param_infos,
    path_tokens,
)
from .train_step import StepVariant, TrainStep, ladder
from .verify import Verification, run_verification

# Share of device memory kept free for XLA's workspace, fragmentation and the runtime.
MEMORY_HEADROOM = 0.10


@dataclass(frozen=True)
class ArgLayout:
    """The step's arguments flattened: per-leaf paths, avals and roles, and how to rebuild."""

    args_treedef: Any
    kw_names: tuple[str, ...]
    inputs: LeafTable
    outputs: LeafTable
    out_treedef: Any
    params: tuple[ParamInfo, ...]
    params_treedef: Any


@dataclass(frozen=True)
class Planned:
    """A plan with what it takes to compile it (and, when verified, its compiled step)."""

    plan: Plan
    layout: ArgLayout
    graph: Graph | None            # None for a plan read back from the cache
    devices: tuple[Any, ...]
    search: SearchResult | None    # None for a plan read back from the cache
    compiled: Any = None
    all_devices: tuple[Any, ...] = ()   # every device the planning could use
    fn: Callable | None = None          # the step to compile, when not the user's own


def resolve_cluster(hardware: Any, devices: Sequence[Any]) -> tuple[Cluster, str | None]:
    if hardware is None:
        return detect_cluster(devices)
    if isinstance(hardware, Cluster):
        return hardware, None
    if isinstance(hardware, (str, DeviceSpec)):
        return Cluster(hardware, len(devices)), None
    raise TypeError(f"hardware must be None, a jaxwap.Cluster, a DeviceSpec or a profile "
                    f"name, got {type(hardware).__name__}")


def find_params(args: Sequence[Any], params: Any) -> Any:
    """The params tree: given, or the first argument (its `.params` for a TrainState)."""
    if params is not None:
        return params
    if not args:
        raise ValueError("the step was called with no positional arguments, so there is no "
                         "first argument to take as the parameters: pass params=")
    first = args[0]
    inner = getattr(first, "params", None)
    if inner is not None and not isinstance(first, dict) and jax.tree_util.tree_leaves(inner):
        return inner
    return first


def flat_leaves(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list, Any, tuple[str, ...]]:
    """(path, leaf) pairs of (args, kwargs) with readable roots, and how to rebuild them."""
    names = tuple(sorted(kwargs))
    tree = (tuple(args), tuple(kwargs[k] for k in names))
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return flat, treedef, names


def _root_path(path: Sequence[Any], names: tuple[str, ...]) -> tuple[str, Sequence[Any]]:
    which, idx = path[0].idx, path[1].idx
    root = f"args[{idx}]" if which == 0 else f"kwargs[{names[idx]!r}]"
    return root, path[2:]


def leaf_entries(args: Sequence[Any], kwargs: dict[str, Any]
                 ) -> tuple[list[tuple[str, Sequence[Any], Any]], Any, tuple[str, ...]]:
    """(root, key path, leaf) for every leaf of (args, kwargs), roots like `args[2]`."""
    flat, treedef, names = flat_leaves(args, kwargs)
    return [(*_root_path(path, names), leaf) for path, leaf in flat], treedef, names


def layout_of(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any],
              params: Any, batch_size: int | None = None) -> tuple[ArgLayout, Any]:
    """Classify every argument leaf, trace the step, classify every output leaf.

    The step is traced before the inputs are settled: a leaf it hands back at the same
    path and shape (batch-norm statistics, a step counter) is carried state, not data,
    whatever its leading dimension. Outputs take the role of the input they mirror, so
    state comes back on the sharding it went in with.
    """
    ptree = find_params(args, params)
    infos, ptreedef = param_infos(ptree)
    identity = {id(leaf): j for j, leaf in enumerate(jax.tree_util.tree_leaves(ptree))
                if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))}
    entries, treedef, names = leaf_entries(args, kwargs)
    leaves = [leaf for _, _, leaf in entries]
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
            batch_size, (int, np.integer)) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    infer = batch_size is None
    first = classify_leaves(entries, infos, identity=identity, batch_size=batch_size,
                            infer_batch=infer)

    def trace(avals: Sequence[Any]) -> tuple[Any, Any]:
        # Trace the user's function itself (not a wrapper made here), so jax's own tracing
        # cache, keyed on the function, makes a second planning of the same step cheap.
        a, k = jax.tree_util.tree_unflatten(treedef, avals)
        return jax.make_jaxpr(fn, return_shape=True)(*a, **dict(zip(names, k, strict=True)))

    closed, out_shape = trace(first.avals)
    out_flat, out_treedef = jax.tree_util.tree_flatten_with_path(out_shape)
    returned = [(path_tokens(p), tuple(int(d) for d in x.shape)) for p, x in out_flat]

    def carried(tokens: tuple[str, ...], shape: tuple[int, ...]) -> bool:
        n = len(tokens)
        return n > 0 and any(len(t) >= n and t[len(t) - n:] == tokens and s == shape
                             for t, s in returned)

    inputs = globalize(classify_leaves(entries, infos, identity=identity,
                                       batch_size=batch_size, infer_batch=infer,
                                       carried=carried), leaves)
    check_params_found(inputs, infos)
    if batch_size is not None and not any(r.kind == BATCH for r in inputs.roles):
        raise ValueError(f"batch_size={batch_size}: no argument leaf has it as its leading "
                         f"dimension")
    if inputs.avals != first.avals:  # several processes: trace the global shapes
        closed, out_shape = trace(inputs.avals)
    if len(closed.jaxpr.invars) != len(inputs.avals):  # pragma: no cover - jax invariant
        raise RuntimeError("jaxpr inputs do not match the flattened arguments")
    outputs = classify_leaves([("out", path, leaf) for path, leaf in out_flat], infos,
                              batch_size=inputs.batch_size, infer_batch=False)
    outputs = _mirror_inputs(outputs, returned, entries, inputs)
    return ArgLayout(treedef, names, inputs, outputs, out_treedef, infos, ptreedef), closed


def _mirror_inputs(outputs: LeafTable, returned: Sequence[tuple[tuple[str, ...], Any]],
                   entries: Sequence[tuple[str, Sequence[Any], Any]],
                   inputs: LeafTable) -> LeafTable:
    """An output at the path and shape of an input takes that input's role: state comes
    back as it went in, and a parameter's output is the parameter or one of its mirrors
    as the input at the longest matching path was (whatever order the step returns them)."""
    keyed = [(path_tokens(p), tuple(int(d) for d in a.shape), r)
             for (_, p, _), a, r in zip(entries, inputs.avals, inputs.roles, strict=True)
             if len(p) > 0]
    roles = list(outputs.roles)
    for i, (tokens, shape) in enumerate(returned):
        is_param = roles[i].kind == PARAM
        best = max(((len(t), r) for t, s, r in keyed
                    if s == shape and (r.kind == PARAM) == is_param
                    and (not is_param or r.param == roles[i].param)
                    and len(t) <= len(tokens) and tokens[len(tokens) - len(t):] == t),
                   default=None, key=lambda x: x[0])
        if best is not None:
            roles[i] = best[1]
    return LeafTable(outputs.paths, outputs.avals, tuple(roles), outputs.batch_size)


def is_process_local(leaf: Any) -> bool:
    """Host data (numpy, Python scalars, arrays on this process's devices only), as opposed
    to a global jax.Array or an abstract ShapeDtypeStruct, which already say global shapes."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return False
    if isinstance(leaf, jax.Array):
        return leaf.is_fully_addressable
    return True


def globalize(table: LeafTable, leaves: Sequence[Any]) -> LeafTable:
    """With several processes, each passes its own slice of the batch: a process-local
    batch leaf stands for `process_count` times its rows. Everything else (params, state)
    is the same on every process. A no-op with one process."""
    nproc = jax.process_count()
    if nproc == 1 or table.batch_size is None:
        return table
    avals = list(table.avals)
    for i, (role, leaf) in enumerate(zip(table.roles, leaves, strict=True)):
        if role.kind == BATCH and is_process_local(leaf):
            a = avals[i]
            avals[i] = jax.ShapeDtypeStruct((a.shape[0] * nproc, *a.shape[1:]), a.dtype)
    batch = table.batch_size * nproc if any(
        r.kind == BATCH and is_process_local(x) for r, x in zip(table.roles, leaves,
                                                                 strict=True)) else table.batch_size
    return LeafTable(table.paths, tuple(avals), table.roles, batch)


def make_plan(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any], *, params: Any,
              objective: str | Objective, hardware: Any, devices: Sequence[Any] | None,
              memory_budget: float | None, num_devices: int | None = None,
              verify: int = 3, donate: bool = True,
              compiler_options: dict[str, Any] | None = None,
              cache: bool | PlanCache = True, batch_size: int | None = None,
              offload: bool = True) -> Planned:
    """Plan `fn` for these (abstract or concrete) arguments.

    `verify=k` compiles the analytic search's best candidates until k fit by XLA's own
    memory analysis and chooses among them on XLA's figures; `verify=0` trusts the model.
    `cache` (True: the default directory, or a `PlanCache`) reads back a plan made before
    for the same step, arguments, devices, hardware and settings instead of searching;
    a hit has no search record or compiled executable (`Planned.search is None`).
    """
    obj = Objective.parse(objective)
    devs = tuple(devices) if devices is not None else tuple(jax.devices())
    if not devs:
        raise ValueError("devices= is empty: jaxwap needs at least one device to plan for")
    cluster, note = resolve_cluster(hardware, devs)
    notes = [note] if note else []
    usable = min(cluster.num_devices, len(devs))
    if cluster.num_devices > len(devs):
        notes.append(f"the hardware profile has {cluster.num_devices} devices but only "
                     f"{len(devs)} are present; candidates use at most {len(devs)}")
    if num_devices is not None and (isinstance(num_devices, bool)
                                    or not isinstance(num_devices, (int, np.integer))):
        raise TypeError(f"num_devices must be an int or None, got {num_devices!r}")
    if num_devices is not None and not 1 <= num_devices <= usable:
        raise ValueError(f"num_devices={num_devices} is outside 1..{usable} (devices usable)")
    if memory_budget is not None:
        budget = float(memory_budget)
    else:
        # the profile's memory, or the present devices' own limit where JAX exposes it
        # (memory_stats()["bytes_limit"]) and it is smaller, less the headroom
        limit = device_memory_limit(devs[0])
        memory = cluster.device.memory_bytes if limit is None else \
            min(cluster.device.memory_bytes, float(limit))
        budget = memory * (1 - MEMORY_HEADROOM)
    if budget <= 0:
        raise ValueError(f"memory_budget must be > 0 bytes, got {memory_budget!r}")
    if isinstance(verify, bool) or not isinstance(verify, (int, np.integer)) or verify < 0:
        raise ValueError(f"verify must be an int >= 0 (how many candidates to compile), "
                         f"got {verify!r}")

    t0 = time.perf_counter()
    layout, closed = layout_of(fn, args, kwargs, params, batch_size)
    t1 = time.perf_counter()
    store = (cache if isinstance(cache, PlanCache) else PlanCache()) if cache else None
    key = None
    if store is not None:
        key = plan_key(
            jaxpr=jaxpr_fingerprint(closed),
            args=list(zip(layout.inputs.paths, layout.inputs.avals, layout.inputs.roles,
                          strict=True)),
            params=layout.params, devices=devs, hardware=cluster, objective=obj,
            memory_budget=budget, num_devices=num_devices, verify=int(verify),
            donate=bool(donate), compiler_options=compiler_options, offload=bool(offload),
            xla_flags=os.environ.get("XLA_FLAGS"))
        hit = store.get(key)
        if hit is not None:
            plan = dataclasses.replace(hit, _treedef=layout.params_treedef)
            return Planned(plan, layout, None, devs[: plan.num_devices], None, None, devs,
                           _variant_fn(fn, plan.step))
    B = layout.inputs.batch_size
    # The step as written first; a step built by make_train_step may then be restructured
    # (remat, micro-batches), in order of expected cost, until a plan fits.
    rungs: list[StepVariant] = [StepVariant()]
    if isinstance(fn, TrainStep) and fn.variant.is_plain:
        rungs += ladder(B, devs[0].platform)
    timing = {"trace": t1 - t0, "analyze": 0.0, "search": 0.0}
    tried: list[str] = []
    first_error: str | None = None
    for rung in rungs:
        fn_v = _variant_fn(fn, rung) or fn
        ta = time.perf_counter()
        closed_v = closed if rung.is_plain else trace_layout(fn_v, layout)
        graph = analyze(closed_v, layout.inputs.roles, layout.outputs.roles, layout.params, B)
        tb = time.perf_counter()
        try:
            result = search(graph, cluster, obj, usable, budget, num_devices,
                            micro_batches=rung.micro_batches, offload=offload)
        except ValueError as e:
            if rung.is_plain:
                raise
            tried.append(f"{rung.describe()}: {str(e).split('(')[0].strip()}")
            continue
        tc = time.perf_counter()
        timing["analyze"] += tb - ta
        timing["search"] += tc - tb
        best = result.results[result.best]
        ver = None
        if not best.fits:
            error = _nothing_fits(result, budget, B)
        else:
            error = None
            if verify:
                ver = run_verification(fn_v, layout, result, cluster, obj, budget, devs,
                                       int(verify), B or 1, donate=donate,
                                       compiler_options=compiler_options)
                timing["verify"] = timing.get("verify", 0.0) + ver.verify_time_s
                if ver.best < 0 and ver.figures:
                    result, ver = _tighten(result, ver, graph, cluster, obj, usable, budget,
                                           num_devices, rung, timing, notes, offload,
                                           lambda r, fn_v=fn_v: run_verification(
                                               fn_v, layout, r, cluster, obj, budget, devs,
                                               int(verify), B or 1, donate=donate,
                                               compiler_options=compiler_options))
                if ver.best < 0:
                    error = _nothing_fits_compiled(ver, result, budget, B)
        if error is None:
            break
        first_error = first_error or error
        tried.append(f"{rung.describe()}: " + (
            f"needs {_si(best.predicted.peak_memory_bytes, 'B')} per device (predicted)"
            if not best.fits else "no candidate fits by XLA's analysis"))
    else:
        more = (f" Also tried restructuring the step: {'; '.join(tried[1:])}."
                if len(tried) > 1 else "")
        raise MemoryError(f"{first_error}{more}")
    if graph.unmodeled:
        notes.append("ops priced by a generic rule (no roofline rule): "
                     + ", ".join(graph.unmodeled))
    if not rung.is_plain:
        notes.append(f"the step as written does not fit ({tried[0]}); restructured: "
                     f"{rung.describe()}")
    if isinstance(fn, TrainStep) and devs[0].platform == "cpu" and tried:
        notes.append("rematerialization not tried: XLA:CPU drops it (it neither recomputes "
                     "nor saves memory there)")
    if any(s.offload for s in result.results[ver.best if ver else result.best].strategies) \
            and devs[0].platform == "cpu":
        notes.append("optimizer state planned for host memory: XLA:CPU compiles memory kinds "
                     "to nothing, so the saving is modelled, not verified, on this backend")
    plan = _build_plan(result, ver, graph, layout, obj, cluster, devs, budget, timing, notes)
    plan = dataclasses.replace(plan, step=rung, _treedef=layout.params_treedef)
    if store is not None and key is not None:
        store.put(key, plan)
    return Planned(plan, layout, graph, devs[: plan.num_devices], result,
                   ver.compiled_best if ver else None, devs,
                   None if rung.is_plain else fn_v)


def _tighten(result: SearchResult, ver: Verification, graph: Graph, cluster: Cluster,
             obj: Objective, usable: int, budget: float, num_devices: int | None,
             rung: StepVariant, timing: dict[str, float], notes: list[str], offload: bool,
             verify_fn: Callable[[SearchResult], Verification], attempts: int = 3
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
        again = search(graph, cluster, obj, usable, modelled, num_devices,
                       micro_batches=rung.micro_batches, offload=offload)
        timing["search"] += time.perf_counter() - t_s
        if not again.results[again.best].fits:
            break
        ver2 = verify_fn(again)
        timing["verify"] = timing.get("verify", 0.0) + ver2.verify_time_s
        if not ver2.figures:
            break
        result, ver = again, ver2
        if ver.best >= 0:
            notes.append(f"the memory model under-counted XLA's figures: searched again for "
                         f"{_si(modelled, 'B')} of modelled memory to fit {_si(budget, 'B')}")
            break
    return result, ver


def _variant_fn(fn: Callable, variant: StepVariant) -> Callable | None:
    """The step restructured as `variant` says (None: the step as written)."""
    if variant.is_plain:
        return None
    if not isinstance(fn, TrainStep):
        raise ValueError(f"a plan restructures the step ({variant.describe()}), but the step "
                         f"is not one jaxwap.make_train_step built")
    return fn.with_variant(variant)


def trace_layout(fn: Callable, layout: ArgLayout) -> Any:
    """The jaxpr of `fn` at the layout's abstract arguments."""
    a, k = jax.tree_util.tree_unflatten(layout.args_treedef, layout.inputs.avals)
    return jax.make_jaxpr(fn)(*a, **dict(zip(layout.kw_names, k, strict=True)))


def _nothing_fits(result: SearchResult, budget: float, batch: int | None) -> str:
    best = result.results[result.best]
    from .plan import _si
    return (f"no candidate plan fits the memory budget of {_si(budget, 'B')} per device: the "
            f"smallest, mesh data={best.d} x model={best.m}, needs "
            f"{_si(best.predicted.peak_memory_bytes, 'B')} per device. Use more devices, a "
            f"smaller batch (now {batch}), a smaller model, or a larger memory_budget=.")


def _nothing_fits_compiled(ver: Verification, result: SearchResult, budget: float,
                           batch: int | None) -> str:
    from .plan import _si
    if not ver.figures:
        errors = "; ".join(f"{result.results[i].d}x{result.results[i].m}: {e}"
                           for i, e in list(ver.failed.items())[:3])
        return f"no candidate plan compiled: {errors}"
    i = min(ver.figures, key=lambda i: ver.figures[i].memory_bytes)
    r = result.results[i]
    return (f"no candidate plan fits the memory budget of {_si(budget, 'B')} per device by "
            f"XLA's own memory analysis: the smallest compiled, mesh data={r.d} x model={r.m}, "
            f"needs {_si(ver.figures[i].memory_bytes, 'B')} per device (the model predicted "
            f"{_si(r.predicted.peak_memory_bytes, 'B')}). Use more devices, a smaller batch "
            f"(now {batch}), a smaller model, or a larger memory_budget=.")


def _build_plan(result: SearchResult, ver: Verification | None, graph: Graph,
                layout: ArgLayout, obj: Objective, cluster: Cluster, devs: Sequence[Any],
                budget: float, timing: dict[str, float], notes: list[str]) -> Plan:
    chosen = ver.best if ver is not None else result.best
    scores = list(result.scores)
    if ver is not None:
        # verified candidates are ranked on XLA's figures; the rest keep analytic scores
        for i, s in enumerate(ver.scores):
            if i in ver.figures:
                scores[i] = s
    best = result.results[chosen]
    placements = tuple(
        ParamPlacement(p.path, p.keystr, p.shape, p.dtype, s.spec, s.name, s.state_spec,
                       s.offload)
        for p, s in zip(layout.params, best.strategies, strict=True))
    figs = ver.figures if ver is not None else {}
    vpreds = ver.predictions if ver is not None else {}
    failed = ver.failed if ver is not None else {}
    # the chosen candidate's figures, on the basis it was chosen on
    ref = vpreds.get(chosen, best.predicted)
    cands = []
    for i, r in enumerate(result.results):
        p = vpreds.get(i, r.predicted)
        basis = "compiled" if i in vpreds else "predicted"
        if i == chosen:
            reason = "chosen"
        elif i in failed:
            reason = f"did not compile: {failed[i]}"
        elif i in figs and figs[i].memory_bytes > budget:
            reason = (f"over memory budget by XLA's analysis "
                      f"({figs[i].memory_bytes / budget:.2f}x)")
        elif not r.fits:
            reason = f"over memory budget ({p.peak_memory_bytes / budget:.2f}x)"
        elif not uses_model_axis(r):
            reason = "no parameter gains from the model axis: it would only duplicate work"
        elif scores[i] == float("inf") and result.scores[i] == float("inf"):
            reason = "outside the allowed slowdown"
        elif ver is not None and i not in vpreds:
            ratio = result.scores[i] / result.scores[result.best]
            reason = f"not verified (analytic score {ratio:.2f}x the analytic best)"
        else:
            reason = (f"{basis} score {scores[i] / scores[chosen]:.2f}x: "
                      f"{p.step_time_s / ref.step_time_s:.2f}x time, "
                      f"{p.energy_per_step_j / ref.energy_per_step_j:.2f}x energy")
        counts = Counter(s.name for s in r.strategies)
        cands.append(Candidate(((DATA, r.d), (MODEL, r.m)), r.predicted, float(scores[i]),
                               r.fits and (i not in figs or figs[i].memory_bytes <= budget),
                               i == chosen, reason, tuple(sorted(counts.items())),
                               compiled=figs.get(i), verified=vpreds.get(i),
                               variant=r.variant))
    return Plan(
        mesh_shape={DATA: best.d, MODEL: best.m},
        device_ids=tuple(int(d.id) for d in devs[: best.d * best.m]),
        params=placements, objective=obj, predicted=best.predicted, candidates=tuple(cands),
        compiled=figs.get(chosen), verified=vpreds.get(chosen),
        hardware=cluster, batch_size=layout.inputs.batch_size, memory_budget_bytes=budget,
        planning_time_s=timing, notes=tuple(notes),
        version=__version__, _treedef=layout.params_treedef)


def rechoose(planned: Planned, measured: dict[int, Any]) -> Planned:
    """The plan chosen again by its objective on measured step time and energy (for the
    candidates in `measured`, keyed by candidate index); the rest are unchanged."""
    plan, result = planned.plan, planned.search
    assert result is not None
    B = plan.batch_size or 1
    preds = {}
    for i, m in measured.items():
        base = plan.candidates[i].verified or plan.candidates[i].predicted
        preds[i] = dataclasses.replace(
            base, step_time_s=m.step_time_s, samples_per_s=B / m.step_time_s,
            energy_per_step_j=m.energy_per_step_j, energy_per_sample_j=m.energy_per_step_j / B,
            avg_power_w=m.energy_per_step_j / m.step_time_s)
    idx = list(preds)
    scores = plan.objective.scores([preds[i] for i in idx],
                                   max_watts=plan.hardware.device.max_watts,
                                   num_devices_available=plan.hardware.num_devices)
    by = dict(zip(idx, scores, strict=True))
    best = min(idx, key=lambda i: (by[i], preds[i].step_time_s))
    cands = []
    for i, c in enumerate(plan.candidates):
        if i not in measured:
            cands.append(dataclasses.replace(c, chosen=False) if c.chosen else c)
            continue
        p, ref = preds[i], preds[best]
        reason = "chosen" if i == best else (
            f"measured score {by[i] / by[best]:.2f}x: {p.step_time_s / ref.step_time_s:.2f}x "
            f"time, {p.energy_per_step_j / ref.energy_per_step_j:.2f}x energy")
        cands.append(dataclasses.replace(c, chosen=i == best, score=float(by[i]),
                                         reason=reason, measured=measured[i]))
    r = result.results[best]
    chosen = plan.candidates[best]
    new = dataclasses.replace(
        plan, mesh_shape={DATA: r.d, MODEL: r.m},
        device_ids=tuple(int(d.id) for d in planned.all_devices[: r.d * r.m]),
        params=tuple(dataclasses.replace(p, spec=s.spec, strategy=s.name,
                                         state_spec=s.state_spec, offload=s.offload)
                     for p, s in zip(plan.params, r.strategies, strict=True)),
        predicted=r.predicted, compiled=chosen.compiled, verified=chosen.verified,
        candidates=tuple(cands), measured=measured[best])
    return Planned(new, planned.layout, planned.graph, planned.all_devices[: r.d * r.m],
                   result, None, planned.all_devices)


__all__ = ["Planned", "ArgLayout", "make_plan", "MEMORY_HEADROOM", "BATCH"]
