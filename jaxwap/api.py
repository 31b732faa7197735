"""`auto_shard`: wrap a training step once, run it sharded with no other change.

The wrapped step plans on its first call (from the arguments' shapes only), compiles
with `jax.jit` in/out shardings, places the arguments on the plan's shardings and runs.
Outputs that are state (params, optimizer state) come back on the same shardings they
went in with, so the training loop feeds them back without any resharding; later calls
with the same shapes reuse the compiled step, new shapes plan again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from jaxwap.analysis import graph_cache
from jaxwap.analysis.roles import classify_leaves
from jaxwap.analysis.trace import flat_leaves, globalize, signature
from jaxwap.core.progress import from_interrupt, interrupted
from jaxwap.core.records import mesh_dims, mesh_stages
from jaxwap.decide.measure import measure_finalists
from jaxwap.energy.power_limit import PowerLimitGuard
from jaxwap.options import PlanOptions, split_options
from jaxwap.planner import Planned, make_plan, record_measurements
from jaxwap.plans.plan import Plan
from jaxwap.runtime.compile import CompiledStep, compile_layout, leaf_specs, make_mesh, shardings
from jaxwap.runtime.step_call import Arguments, OtherArguments, StepCall, place


class AutoShardedStep:
    """A training step that plans, compiles and runs itself sharded. See `auto_shard`.

    `options` (a `jaxwap.PlanOptions`) and/or its fields as keywords say how to plan."""

    def __init__(self, train_step: Callable, params: Any = None, *,
                 options: PlanOptions | None = None, **kwargs: Any) -> None:
        if not callable(train_step):
            raise TypeError(f"train_step must be callable, got {type(train_step).__name__}")
        self.train_step = train_step
        self.params = params
        self.options = PlanOptions.of(options, **kwargs)
        self._plans: dict[Any, Planned] = {}
        self._measured: set[Any] = set()
        self._execs: dict[Any, CompiledStep] = {}
        self._calls: dict[Any, StepCall] = {}
        self._last: StepCall | None = None     # the call that served the last step
        self._current: Planned | None = None
        # plan for the hardware described even where its devices are not present
        # (`jaxwap.plan`); a step that runs plans for the devices it runs on
        self._for_hardware = False
        # power_limit="apply": the limit set on this process's devices, and for what
        self._guard: PowerLimitGuard | None = None
        self._guarded: tuple[Any, ...] | None = None
        functools.update_wrapper(self, train_step)

    # ------------------------------------------------------------------ planning
    def _planned(self, args: Sequence[Any], kwargs: dict[str, Any],
                 measure: bool = True, key: Any = None) -> tuple[Any, Planned]:
        """The plan for these arguments: made on the first call with their shapes, and,
        with `options.measure`, decided again on the finalists' measurements as soon as
        the arguments are real arrays (a plan read from the cache was measured before).
        `key`: the arguments' `signature`, where the caller has it."""
        key = signature(args, kwargs)[0] if key is None else key
        if key not in self._plans:
            try:
                planned = make_plan(self.train_step, args, kwargs, params=self.params,
                                    options=self._options_to_plan(),
                                    for_hardware=self._for_hardware)
            except (KeyboardInterrupt, SystemError) as e:
                # one line for the person who pressed Ctrl-C; the program decides the rest
                # (a library does not exit its caller's process)
                if from_interrupt(e):
                    interrupted(f"jaxwap: planning "
                                f"{getattr(self.train_step, '__name__', 'the step')}",
                                "no plan was cached")
                raise
            self._check_every_process(planned)
            self._plans[key] = planned
        planned = self._plans[key]
        if measure and self.options.measure and key not in self._measured \
                and _concrete(args, kwargs):
            # a plan read back from the cache is the measured choice already
            self._measured.add(key)
            flat, _, _ = flat_leaves(args, kwargs)
            measured, seconds = measure_finalists(
                self.train_step, planned, [leaf for _, leaf in flat], self.options.measure,
                place, compiler_options=self.options.compiler_options)
            planned = record_measurements(planned, measured, seconds, self.options.store)
            self._plans[key] = planned
            # a program compiled before (lower_and_compile) may be another candidate's
            self._execs.pop(key, None)
            self._calls.pop(key, None)
        self._current = planned
        return key, planned

    def _options_to_plan(self) -> PlanOptions:
        """The options a step that runs plans with. With several processes each passes
        its own slice of the batch and runs the same program, so the mesh must hold
        devices of every process; a mesh takes the first devices, process by process, so
        only all of them do. Unless the device count is fixed otherwise (then
        `_check_every_process` says why it cannot run), the step plans for all of them.
        `jaxwap.plan`, which advises and does not run, may still weigh fewer."""
        o = self.options
        if self._for_hardware or jax.process_count() == 1 or o.plan is not None \
                or o.num_devices is not None or o.mesh is not None:
            return o
        return dataclasses.replace(o, num_devices=len(o.devices or jax.devices()))

    def _check_every_process(self, planned: Planned) -> None:
        """A plan that leaves a process out cannot run: that process's slice of the batch
        and its share of the program would have no devices. Say so, naming what fixed
        the device count, before anything is placed or compiled."""
        nproc = jax.process_count()
        if self._for_hardware or nproc == 1:
            return
        used = {d.process_index for d in planned.devices}
        if len(used) == nproc:
            return
        o = self.options
        given = ("plan=" if o.plan is not None else
                 f"num_devices={o.num_devices}" if o.num_devices is not None else
                 f"mesh_shape={dict(o.mesh_shape or {})}" if o.mesh is not None else
                 f"devices= ({len(o.devices or ())} devices)")
        raise ValueError(
            f"{given} gives a plan of {planned.plan.num_devices} devices, of processes "
            f"{sorted(used)} only: with {nproc} processes each passes its own slice of the "
            f"batch and runs the step, so the step needs devices of every process, and a "
            f"mesh takes the first devices process by process: use all "
            f"{len(jax.devices())} (leave num_devices and mesh_shape unset to have them)")

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """Plan for these arguments (arrays or jax.ShapeDtypeStruct) without running a
        training step (with `measure=`, real arrays run the finalists to choose)."""
        return self._planned(args, kwargs)[1].plan

    @property
    def plan(self) -> Plan:
        """The plan of the most recent call (or plan_for)."""
        return self._require("step.plan").plan

    @property
    def mesh(self) -> Mesh:
        planned = self._require("step.mesh")
        d, m, r = mesh_dims(planned.plan.mesh_shape)
        return make_mesh(d, m, planned.devices, r, mesh_stages(planned.plan.mesh_shape))

    def _require(self, what: str) -> Planned:
        """The current plan; `what` (the caller) is named in the error when there is none,
        since every layout this step gives out is the plan's."""
        if self._current is None:
            raise RuntimeError(f"{what} needs the step's plan, and there is no plan yet: "
                               f"call the step, or step.plan_for(params, opt_state, batch) "
                               f"(arrays or jax.ShapeDtypeStruct), first")
        return self._current

    # ------------------------------------------------------------------ compile
    def _compile(self, key: Any, planned: Planned) -> CompiledStep:
        if key not in self._execs:
            plan = planned.plan
            d, m, r = mesh_dims(plan.mesh_shape)
            self._execs[key] = planned.compiled or compile_layout(
                planned.fn or self.train_step, planned.layout, d, m, plan.params,
                planned.devices, donate=self.options.donate,
                compiler_options=self.options.compiler_options, r=r,
                stages=mesh_stages(plan.mesh_shape))
        return self._execs[key]

    def lower_and_compile(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled step for these arguments (abstract ones allowed); for inspection."""
        key, planned = self._planned(args, kwargs, measure=False)
        return self._compile(key, planned).compiled

    # ------------------------------------------------------------------ run
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # a step's arguments like the last step's go to the call that served it, which
        # hands back (OtherArguments, nothing run) those of another signature
        given = Arguments(args, kwargs)
        key = None
        if self._last is not None:
            try:
                return self._run(self._last, given)
            except OtherArguments as other:
                key = other.key
        key, planned = self._planned(args, kwargs, key=key)
        if key not in self._calls:
            self._calls[key] = StepCall(self._compile(key, planned), planned.layout, key,
                                        planned)
        return self._run(self._calls[key], given)

    def _run(self, call: StepCall, given: Arguments) -> Any:
        self._current = call.planned
        self._power_limit(call.planned)
        try:
            out = call(given)
        except OtherArguments:
            raise
        except BaseException:
            self.close()   # never leave a GPU capped behind a failed step
            raise
        self._last = call
        return out

    # ------------------------------------------------------------------ power limit
    def _power_limit(self, planned: Planned) -> None:
        """With `power_limit="apply"`, hold the plan's power limit on this process's
        devices of the plan (set once, kept while the plan runs, restored when the plan
        changes to another limit); otherwise change nothing."""
        watts = planned.plan.power_limit_w
        if self.options.power_limit != "apply" or watts is None:
            self.close()
            return
        mine = tuple(d for d in planned.devices if d.process_index == jax.process_index())
        want = (watts, *mine)
        if self._guarded == want:
            return
        self.close()
        guard = PowerLimitGuard(mine, watts)
        guard.apply()   # refused: it warns once and the step runs uncapped
        self._guard, self._guarded = guard, want

    def close(self) -> None:
        """Put back the power limits `power_limit="apply"` set (also done when the step
        is garbage collected, at interpreter exit and after a step raises); the step
        sets them again on its next call."""
        guard, self._guard, self._guarded = self._guard, None, None
        if guard is not None:
            guard.restore()

    def __enter__(self) -> AutoShardedStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _leaf_shardings(self, trees: Sequence[Any], what: str
                        ) -> tuple[list[Any], list[Any], list[jax.ShapeDtypeStruct],
                                   tuple[NamedSharding, ...]]:
        """The one rule for where a pytree's leaves go under the current plan, shared by
        `shard` and `abstract_state` so placing data and restoring it cannot disagree:
        params and their mirrors on the params' (and optimizer state's) shardings,
        batch-leading leaves over the data axis, the rest replicated. Each tree is its own
        root, so `(params, opt_state)` given as two trees tells the parameters from their
        moments by path. Returns (treedefs, leaves, global avals, shardings), the last
        three flat over all trees."""
        planned = self._require(what)
        if not trees:
            raise TypeError(f"{what} takes one or more pytrees, got none")
        entries, treedefs, leaves = [], [], []
        for i, tree in enumerate(trees):
            flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
            treedefs.append(treedef)
            entries += [(f"trees[{i}]", path, leaf) for path, leaf in flat]
            leaves += [leaf for _, leaf in flat]
        # with several processes the trees hold this process's slice of the batch
        batch = planned.layout.inputs.batch_size
        local_batch = batch // jax.process_count() if batch else None
        table = globalize(classify_leaves(entries, planned.layout.params,
                                          batch_size=local_batch, infer_batch=False,
                                          by_path=True), leaves)
        d, _, r = mesh_dims(planned.plan.mesh_shape)
        layouts = leaf_specs(table, planned.plan.params, d, r,
                             mesh_stages(planned.plan.mesh_shape))
        return treedefs, leaves, list(table.avals), shardings(self.mesh, layouts)

    @staticmethod
    def _unflatten(treedefs: Sequence[Any], flat: Sequence[Any]) -> Any:
        """The trees back from their leaves in order: one tree for one, else a tuple."""
        out, at = [], 0
        for treedef in treedefs:
            out.append(jax.tree_util.tree_unflatten(treedef, flat[at:at + treedef.num_leaves]))
            at += treedef.num_leaves
        return out[0] if len(out) == 1 else tuple(out)

    def shard(self, *trees: Any) -> Any:
        """Place pytrees the way the current plan wants (params and their mirrors on the
        params' shardings, batch-leading leaves over the data axis, the rest replicated).
        One tree gives one tree back, several a tuple: pass params and optimizer state as
        separate trees (`shard(params, opt_state)`), not as one tuple, whose first element
        would not be recognised as the parameters by its path."""
        treedefs, leaves, avals, shs = self._leaf_shardings(trees, "step.shard")
        return self._unflatten(treedefs, [place(leaf, sh, aval) for leaf, sh, aval
                                          in zip(leaves, shs, avals, strict=True)])

    def abstract_state(self, *trees: Any) -> Any:
        """The trees (arrays or jax.ShapeDtypeStruct) as jax.ShapeDtypeStructs carrying the
        current plan's shardings, the ones `shard` would give; no data is read or allocated.

        Made as a checkpoint's restore target: orbax reads each device's shard straight
        onto the plan's layout (`ocp.StandardCheckpointer().restore(path, target)`), so a
        checkpoint saved under one plan resumes under another (another mesh, fewer devices)
        with no full copy of the state on any one device, and the step runs on it without
        resharding. One tree gives one tree back, several a tuple; pass params and
        optimizer state as separate trees: `abstract_state(params, opt_state)`."""
        treedefs, _, avals, shs = self._leaf_shardings(trees, "step.abstract_state")
        return self._unflatten(treedefs, [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh,
                                 weak_type=getattr(a, "weak_type", False))
            for a, sh in zip(avals, shs, strict=True)])

    def __repr__(self) -> str:
        name = getattr(self.train_step, "__name__", repr(self.train_step))
        return f"AutoShardedStep({name}, objective={self.options.objective.describe()!r})"


def _concrete(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether every argument leaf is data (measurement runs the step on them)."""
    return not any(isinstance(leaf, jax.ShapeDtypeStruct)
                   for _, leaf in flat_leaves(args, kwargs)[0])


def auto_shard(train_step: Callable | None = None, params: Any = None, *,
               options: PlanOptions | None = None, **kwargs: Any) -> Any:
    """Wrap a training step so it plans, compiles and runs itself sharded.

    Args:
      train_step: the user's step, e.g. `(params, opt_state, batch) -> (params, opt_state,
        metrics)`. Written for one device; it runs unchanged.
      params: the parameter pytree (arrays or jax.ShapeDtypeStruct); default: the step's
        first argument (its `.params` if it is a TrainState).
      options: a `jaxwap.PlanOptions`; its fields may also be given as keywords
        (`objective=`, `hardware=`, `devices=`, `memory_budget=`, `num_devices=`,
        `verify=`, `donate=`, `compiler_options=`, `cache=`, `batch_size=`, `measure=`,
        `offload=`, `power_limit=`, ...), which replace the record's. `PlanOptions`
        documents each one. `power_limit="apply"` sets the plan's chosen GPU power limit
        while the step lives (`AutoShardedStep.close()` or `with` puts it back).

    Donation (`donate=True`, the default): the step donates the state it is given (the
    parameters, their optimizer state and whatever else it hands back at the same path:
    batch statistics, a step count), so pass it the state the last call returned.
    The first call consumes the initial state alike on every plan: each jax array of it is
    either donated in place (already on the plan's sharding) or copied onto the mesh and
    then deleted, so a large model's initial copy never stays in memory beside the
    plan's; numpy (host) state is never touched. Passing a deleted or donated array (the
    state from before the last step, say) raises a ValueError naming its path before
    anything runs. With `donate=False` nothing given is deleted.

    Usable as `auto_shard(step, params)`, `@auto_shard` or `@auto_shard(params=...)`.
    """
    opts = PlanOptions.of(options, **kwargs)
    if train_step is None:
        return lambda fn: AutoShardedStep(fn, params, options=opts)
    return AutoShardedStep(train_step, params, options=opts)


def plan(train_step: Callable, *args: Any, params: Any = None,
         options: PlanOptions | None = None, **kwargs: Any) -> Plan:
    """Plan `train_step` for these arguments (arrays or jax.ShapeDtypeStruct) without
    running it: only the verified finalists are compiled (`verify=0`: nothing is).

    Takes every option `auto_shard` takes (a `PlanOptions` and/or its fields as keywords);
    any other keyword is the step's own. `hardware=Cluster(...)` with more devices than
    are present plans for that cluster (analytically: verification needs the devices);
    save the plan with `to_json()` and run it there with `auto_shard(..., plan=path)`.
    `measure=` runs the finalists, so it needs real arrays."""
    option_kw, step_kwargs = split_options(kwargs, train_step)
    opts = PlanOptions.of(options, **option_kw)
    if opts.measure and not _concrete(args, step_kwargs):
        raise ValueError("jaxwap.plan(measure=...) runs the finalists on the devices, so it "
                         "needs arrays, not jax.ShapeDtypeStruct: pass real arguments or "
                         "leave measure= out")
    step = AutoShardedStep(train_step, params, options=opts)
    step._for_hardware = True
    return step.plan_for(*args, **step_kwargs)


def clear_caches() -> None:
    """Forget the traces and analyses jaxwap keeps in memory (`analysis.graph_cache`).

    For the last few steps planned it keeps their analyses (the step as written by the
    trace jax hands back; the variants a `make_train_step` step is restructured into,
    and the loss traces they start from, by loss function and shapes), so planning a
    step again under another budget or objective costs its search alone. As with
    `jax.jit`'s own cache, a loss whose Python reads state that has changed since (a
    global, a config object) is not seen to change: call this, as you would
    `jax.clear_caches()`. The plan cache on disk is another matter (`cache=`)."""
    graph_cache.clear()
