"""`auto_shard`: wrap a training step once, run it sharded with no other change.

The wrapped step plans on its first call (from the arguments' shapes only), compiles
with `jax.jit` in/out shardings, places the arguments on the plan's shardings and runs.
Outputs that are state (params, optimizer state) come back on the same shardings they
went in with, so the training loop feeds them back without any resharding; later calls
with the same shapes reuse the compiled step, new shapes plan again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from .compile import CompiledStep, compile_layout, leaf_specs, make_mesh, shardings
from .cost import DATA, MODEL
from .measure import measured_choice
from .objective import Objective
from .plan import Plan
from .planner import (
    Planned,
    flat_leaves,
    globalize,
    is_process_local,
    leaf_entries,
    make_plan,
)
from .state import abstract_leaf, classify_leaves


def place(leaf: Any, sharding: NamedSharding, aval: jax.ShapeDtypeStruct) -> Any:
    """Put one argument leaf on its sharding. With several processes, host data cannot be
    `device_put` onto devices of other processes: a process-local batch slice becomes its
    rows of the global array, and state (the same on every process) is sliced per device."""
    if jax.process_count() == 1 or not is_process_local(leaf):
        return jax.device_put(leaf, sharding)
    local = np.asarray(leaf)
    if local.shape != tuple(aval.shape):
        return jax.make_array_from_process_local_data(sharding, local, tuple(aval.shape))
    return jax.make_array_from_callback(local.shape, sharding, lambda index: local[index])


class AutoShardedStep:
    """A training step that plans, compiles and runs itself sharded. See `auto_shard`."""

    def __init__(self, train_step: Callable, params: Any = None, *,
                 objective: str | Objective = "balanced", hardware: Any = None,
                 devices: Sequence[Any] | None = None, memory_budget: float | None = None,
                 donate: bool = True, num_devices: int | None = None,
                 compiler_options: dict[str, Any] | None = None, verify: int = 3,
                 cache: Any = True, batch_size: int | None = None,
                 measure: bool | int = False, offload: bool = True) -> None:
        if not callable(train_step):
            raise TypeError(f"train_step must be callable, got {type(train_step).__name__}")
        self.offload = bool(offload)
        self.train_step = train_step
        self.params = params
        self.objective = Objective.parse(objective)
        self.hardware = hardware
        self.devices = tuple(devices) if devices is not None else None
        self.memory_budget = memory_budget
        self.donate = donate
        self.num_devices = num_devices
        self.compiler_options = compiler_options
        self.verify = verify
        self.cache = cache
        self.batch_size = batch_size
        if isinstance(measure, bool):
            self.measure_steps = 5 if measure else 0
        elif isinstance(measure, int) and measure >= 1:
            self.measure_steps = measure
        else:
            raise ValueError(f"measure must be a bool or a positive number of steps, "
                             f"got {measure!r}")
        self._measured: set[Any] = set()
        self._plans: dict[Any, Planned] = {}
        self._execs: dict[Any, CompiledStep] = {}
        self._current: Planned | None = None
        functools.update_wrapper(self, train_step)

    # ------------------------------------------------------------------ planning
    def _signature(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        entries, treedef, names = leaf_entries(args, kwargs)
        avals = []
        for root, path, leaf in entries:
            a = abstract_leaf(leaf, f"{root}{jax.tree_util.keystr(tuple(path))}")
            avals.append((tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False))))
        return treedef, names, tuple(avals)

    def _planned(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, Planned]:
        key = self._signature(args, kwargs)
        if key not in self._plans:
            self._plans[key] = make_plan(
                self.train_step, args, kwargs, params=self.params, objective=self.objective,
                hardware=self.hardware, devices=self.devices, memory_budget=self.memory_budget,
                num_devices=self.num_devices, verify=self.verify, donate=self.donate,
                compiler_options=self.compiler_options, cache=self.cache,
                batch_size=self.batch_size, offload=self.offload)
        self._current = self._plans[key]
        return key, self._plans[key]

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """Plan for these arguments (arrays or jax.ShapeDtypeStruct) without running."""
        return self._planned(args, kwargs)[1].plan

    @property
    def plan(self) -> Plan:
        """The plan of the most recent call (or plan_for)."""
        if self._current is None:
            raise RuntimeError("no plan yet: call the step, or step.plan_for(*args), first")
        return self._current.plan

    @property
    def mesh(self) -> Mesh:
        plan = self.plan
        return make_mesh(plan.mesh_shape[DATA], plan.mesh_shape[MODEL], self._require().devices)

    def _require(self) -> Planned:
        if self._current is None:
            raise RuntimeError("no plan yet: call the step, or step.plan_for(*args), first")
        return self._current

    # ------------------------------------------------------------------ compile
    def _compile(self, key: Any, planned: Planned) -> CompiledStep:
        if key not in self._execs:
            plan = planned.plan
            self._execs[key] = planned.compiled or compile_layout(
                planned.fn or self.train_step, planned.layout, plan.mesh_shape[DATA],
                plan.mesh_shape[MODEL], plan.params, planned.devices, donate=self.donate,
                compiler_options=self.compiler_options)
        return self._execs[key]

    def lower_and_compile(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled step for these arguments (abstract ones allowed); for inspection."""
        key, planned = self._planned(args, kwargs)
        return self._compile(key, planned).compiled

    # ------------------------------------------------------------------ run
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key, planned = self._planned(args, kwargs)
        flat, _, _ = flat_leaves(args, kwargs)
        if self.measure_steps and key not in self._measured:
            planned = measured_choice(self.train_step, planned, [leaf for _, leaf in flat],
                                      self.measure_steps, place,
                                      compiler_options=self.compiler_options)
            self._plans[key] = self._current = planned
            self._measured.add(key)
        ex = self._compile(key, planned)
        placed = [place(leaf, sh, aval) for (_, leaf), sh, aval in
                  zip(flat, ex.in_shardings, planned.layout.inputs.avals, strict=True)]
        out = ex.compiled(*placed)
        return jax.tree_util.tree_unflatten(planned.layout.out_treedef, out)

    def shard(self, tree: Any) -> Any:
        """Place a pytree the way the current plan wants (params and their mirrors on the
        params' shardings, batch-leading leaves over the data axis, the rest replicated)."""
        planned = self._require()
        mesh = self.mesh
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = [leaf for _, leaf in flat]
        # with several processes the tree holds this process's slice of the batch
        batch = planned.layout.inputs.batch_size
        local_batch = batch // jax.process_count() if batch else None
        table = globalize(
            classify_leaves([("tree", p, leaf) for p, leaf in flat], planned.layout.params,
                            batch_size=local_batch, infer_batch=False, by_path=True), leaves)
        layouts = leaf_specs(table, planned.plan.params, planned.plan.mesh_shape[DATA])
        placed = [place(leaf, sh, aval) for leaf, sh, aval
                  in zip(leaves, shardings(mesh, layouts), table.avals, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, placed)

    def __repr__(self) -> str:
        name = getattr(self.train_step, "__name__", repr(self.train_step))
        return f"AutoShardedStep({name}, objective={self.objective.describe()!r})"


def auto_shard(train_step: Callable | None = None, params: Any = None, *,
               objective: str | Objective = "balanced", hardware: Any = None,
               devices: Sequence[Any] | None = None, memory_budget: float | None = None,
               donate: bool = True, num_devices: int | None = None,
               compiler_options: dict[str, Any] | None = None, verify: int = 3,
               cache: Any = True, batch_size: int | None = None,
               measure: bool | int = False, offload: bool = True) -> Any:
    """Wrap a training step so it plans, compiles and runs itself sharded.

    Args:
      train_step: the user's step, e.g. `(params, opt_state, batch) -> (params, opt_state,
        metrics)`. Written for one device; it runs unchanged.
      params: the parameter pytree (arrays or jax.ShapeDtypeStruct); default: the step's
        first argument (its `.params` if it is a TrainState).
      objective: "throughput", "energy", "balanced" or `jaxwap.Objective(max_slowdown=x)`.
      hardware: a `jaxwap.Cluster` (or profile name) to plan for; default: the devices found.
      devices: the devices the job may use (default `jax.devices()`); plans may use fewer.
      memory_budget: bytes per device; default the device memory less 10% headroom.
      donate: donate the state arguments (params and their mirrors) to the step, as
        `jax.jit(donate_argnums=...)` would: the state passed in is consumed; use the
        returned state.
      num_devices: use exactly this many devices instead of choosing.
      compiler_options: XLA options for the compile (default: latency hiding on GPU).
      verify: compile the analytic search's best candidates until this many fit by XLA's
        own memory analysis, and choose among them on XLA's figures (0: trust the model).
      cache: read back a plan made before for the same step and settings (True: the
        directory in $JAXWAP_CACHE_DIR or ~/.cache/jaxwap; a `jaxwap.PlanCache`; False).
      batch_size: the global batch size, when the most common leading dimension of the
        arguments that are not state is not it.
      measure: on the first call, run the verified finalists on the devices (True: 5
        steps each after a warm-up, or this many) and choose on measured time and energy
        (NVML energy where available, modeled and labelled so otherwise).
      offload: allow plans that keep optimizer state in pinned host memory when nothing
        else fits (on a backend that ignores memory kinds, such as XLA:CPU, the saving is
        modelled, not verified, and the plan's notes say so).

    Usable as `auto_shard(step, params)`, `@auto_shard` or `@auto_shard(params=...)`.
    """
    kw = dict(objective=objective, hardware=hardware, devices=devices,
              memory_budget=memory_budget, donate=donate, num_devices=num_devices,
              compiler_options=compiler_options, verify=verify, cache=cache,
              batch_size=batch_size, measure=measure, offload=offload)
    if train_step is None:
        return lambda fn: AutoShardedStep(fn, params, **kw)
    return AutoShardedStep(train_step, params, **kw)


def plan(train_step: Callable, *args: Any, params: Any = None,
         objective: str | Objective = "balanced", hardware: Any = None,
         devices: Sequence[Any] | None = None, memory_budget: float | None = None,
         num_devices: int | None = None, verify: int = 3, cache: Any = True,
         batch_size: int | None = None, offload: bool = True, **kwargs: Any) -> Plan:
    """Plan `train_step` for these arguments (arrays or jax.ShapeDtypeStruct) without
    running anything: only the verified finalists are compiled (`verify=0`: nothing is)."""
    return make_plan(train_step, args, kwargs, params=params, objective=objective,
                     hardware=hardware, devices=devices, memory_budget=memory_budget,
                     num_devices=num_devices, verify=verify, cache=cache,
                     batch_size=batch_size, offload=offload).plan
