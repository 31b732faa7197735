"""The compile stage: a layout (mesh shape + one PartitionSpec per parameter) becomes a
compiled `jax.jit` step. Verification and the run use the very same function, so what
XLA reports for a verified candidate is what runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxwap.analysis.dataflow import looked_up, op_kinds
from jaxwap.analysis.flatten import flatten
from jaxwap.analysis.fsdp_gathers import fsdp_gathers
from jaxwap.analysis.fused_attention import require_compilable, target_checks
from jaxwap.analysis.grad_reductions import batch_split
from jaxwap.analysis.roles import BATCH, PARAM, LeafTable
from jaxwap.core.records import DATA, MODEL, REPLICA, STAGE
from jaxwap.runtime.grad_pins import gradient_pins, pinned

# Applied to GPU compiles only: overlap collectives with compute (XLA flag names checked
# on jax 0.10.2; their effect is measured on GPU, not assumed).
GPU_COMPILER_OPTIONS: dict[str, Any] = {"xla_gpu_enable_latency_hiding_scheduler": True}


def make_mesh(d: int, m: int, devices: Sequence[Any], r: int = 1, stages: int = 1) -> Mesh:
    """A (data, model) mesh over the first d*m devices, with Auto axes (XLA propagates);
    with r > 1 replicas, (replica, data, model) of sizes (r, d/r, m): the data axis split
    into its outer part (across nodes, devices being in node order) and its inner one. A
    pipeline's `stages` > 1 add the outermost axis, stage: p such meshes, one per stage."""
    if stages > 1:
        n = d * m
        if stages * n > len(devices):
            raise ValueError(f"a {stages}-stage pipeline of {d}x{m} meshes needs "
                             f"{stages * n} devices, only {len(devices)} given")
        inner = [make_mesh(d, m, devices[s * n:(s + 1) * n], r) for s in range(stages)]
        grid = np.stack([np.asarray(x.devices) for x in inner])
        names = (STAGE, *inner[0].axis_names)
        return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
    if d * m > len(devices):
        raise ValueError(f"a {d}x{m} mesh needs {d * m} devices, only {len(devices)} given")
    if r > 1:
        if d % r:
            raise ValueError(f"{r} replicas do not divide the data axis of {d}")
        grid = np.array(list(devices[: d * m]), dtype=object).reshape(r, d // r, m)
        return Mesh(grid, (REPLICA, DATA, MODEL), axis_types=(AxisType.Auto,) * 3)
    grid = np.array(list(devices[: d * m]), dtype=object).reshape(d, m)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def batch_spec(r: int = 1, stages: int = 1) -> P:
    """How batch leaves are split: over the data axis, and over the replicas and a
    pipeline's stages too (each process of a pipeline keeps its own slice of the batch;
    the layers outside the stack run split over every device, the stack's input is
    gathered over the stages where the pipeline starts)."""
    axes = ((STAGE,) if stages > 1 else ()) + ((REPLICA,) if r > 1 else ()) + (DATA,)
    return P(axes) if len(axes) > 1 else P(DATA)


HOST = "pinned_host"


@dataclass(frozen=True)
class LeafLayout:
    """Where one leaf lives: its PartitionSpec and memory kind (None: the default)."""

    spec: P
    memory_kind: str | None = None


def placement_of(p: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], bool]:
    """(weight spec, optimizer-state spec, state offloaded) of a `Strategy` or a plan's
    `ParamPlacement`. A bare spec would leave the optimizer state's layout to a guess (a
    benchmark once compiled every ZeRO-1 candidate as data parallelism that way), so it is
    refused."""
    if not all(hasattr(p, a) for a in ("spec", "layout_of_state", "offload")):
        raise TypeError(f"a parameter's placement must be a jaxwap Strategy or ParamPlacement "
                        f"(its weight spec, optimizer-state spec and memory kind), got "
                        f"{type(p).__name__} {p!r}")
    return tuple(p.spec), tuple(p.layout_of_state), bool(p.offload)


def leaf_specs(table: LeafTable, placements: Sequence[Any], d: int,
               r: int = 1, stages: int = 1) -> list[LeafLayout]:
    """The layout of every leaf: a param's spec for it, its optimizer-state spec (and
    memory kind) for its mirrors, the data axis (and the replicas) for batch leaves (when
    the mesh splits data), replicated otherwise."""
    placed = [placement_of(p) for p in placements]
    out = []
    for role in table.roles:
        if role.kind == PARAM:
            spec, state, offload = placed[role.param]
            if role.mirror:
                out.append(LeafLayout(P(*state), HOST if offload else None))
            else:
                out.append(LeafLayout(P(*spec)))
        elif role.kind == BATCH and d * stages > 1:
            out.append(LeafLayout(batch_spec(r, stages)))
        else:
            out.append(LeafLayout(P()))
    return out


def host_resident_bytes(layout: Any, placements: Sequence[Any], d: int, m: int,
                        donate: bool, r: int = 1, stages: int = 1) -> float:
    """Per-device bytes of the state a layout keeps in host memory, as a backend whose
    memory analysis ignores memory kinds (XLA:CPU) counts them: inputs plus outputs,
    less the inputs donated to (aliased with) those outputs."""
    sizes = {DATA: d // r, MODEL: m, REPLICA: r, STAGE: stages}

    def total(table: LeafTable) -> float:
        n = 0.0
        for lay, aval in zip(leaf_specs(table, placements, d, r, stages), table.avals,
                             strict=True):
            if lay.memory_kind == HOST:
                split = int(np.prod([sizes[a] for a in lay.spec if a is not None]))
                n += int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize \
                    / split
        return n

    ins = total(layout.inputs)
    return ins + total(layout.outputs) - (ins if donate else 0.0)


def shardings(mesh: Mesh, layouts: Sequence[LeafLayout]) -> tuple[NamedSharding, ...]:
    return tuple(NamedSharding(mesh, x.spec, memory_kind=x.memory_kind) for x in layouts)


def without_data(spec: P) -> P:
    """The spec with the data axis (and the replicas') taken out: the weight gathered over
    the devices that shard it, still split over the model axis."""
    def keep(entry: Any) -> Any:
        axes = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(a for a in axes if a is not None and a not in (DATA, REPLICA))
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*(keep(e) for e in spec))


def gathered_first(jaxpr: Any, layout: Any, in_lay: Sequence[LeafLayout], mesh: Mesh
                   ) -> tuple[dict[int, NamedSharding], dict[int, P]]:
    """{input leaf: its sharding without the data axis} for the parameters sharded over
    the data axis that the step gathers before it runs, as FSDP does any weight:

    - a table an embedding lookup reads (`dataflow.looked_up`). Left to itself, XLA's
      partitioner gives the lookup's result the table's sharding, and a table split on
      its feature dim then splits GPT-2's residual stream by feature over the whole
      batch: on 8 devices its 2-layer, full-width form compiled to 5.8 GB of collectives
      (whole-batch logits all-reduced) where the gathered table gives 0.57 GB and the
      model prices 0.65;
    - one no matmul reads that XLA would gather more than once (`fsdp_gathers.Gathers.first`:
      a norm's scale, whose split XLA carries into the batch statistics). Its gradient
      is kept whole where a reduction makes it too (`pins`), or XLA would split the
      family again from the gradient's side (the split moments): the second dict,
      {parameter: its spec without the data axis}, for `grad_pins.gradient_pins`."""
    sharded = {i: lay for i, (lay, role) in enumerate(zip(in_lay, layout.inputs.roles,
                                                           strict=True))
               if role.kind == PARAM and not role.mirror
               and without_data(lay.spec) != P(*lay.spec)}
    if not sharded:
        return {}, {}
    prog = flatten(jaxpr)
    tables = looked_up(prog, layout.inputs.roles, layout.outputs.roles,
                       layout.params, layout.inputs.batch_size)
    roles = layout.inputs.roles
    first = fsdp_gathers(prog, op_kinds(prog)[0], batch_split(prog, roles)[0], roles,
                         layout.outputs.roles, len(layout.params)).first
    param = {i: layout.inputs.roles[i].param for i in sharded}
    whole = {param[i]: without_data(lay.spec) for i, lay in sharded.items()
             if first[param[i]] and param[i] not in tables}
    return ({i: NamedSharding(mesh, without_data(lay.spec)) for i, lay in sharded.items()
             if param[i] in tables or param[i] in whole}, whole)


def zero1_weights(placements: Sequence[Any]) -> dict[int, P]:
    """{parameter: weight spec} of the parameters whose optimizer state splits over the
    data axis while the weight does not (ZeRO-1): the gradients `pins` keeps whole."""
    out = {}
    for j, p in enumerate(placements):
        spec, state, _ = placement_of(p)
        if without_data(P(*spec)) == P(*spec) and without_data(P(*state)) != P(*state):
            out[j] = P(*spec)
    return out


def donated_leaves(layout: Any) -> tuple[int, ...]:
    """The input leaves a step donates: its state, as `jax.jit(donate_argnums=)` of the
    state arguments donates it. The parameters and their mirrors (optimizer moments), and
    every other leaf the step hands back at the very path and aval it came in at, its
    position included (`out[1]['bn1']['mean']` for `args[1]['bn1']['mean']`: batch-norm
    statistics, an optimizer's step count): one left undonated is an output XLA cannot
    write in place, a new buffer every step, and `jax.jit` of the same step would not pay
    it. Batch leaves are never donated."""
    outs = {(p, a.shape, a.dtype) for p, a in zip(layout.outputs.paths, layout.outputs.avals,
                                                  strict=True)}
    return tuple(i for i, (p, a, r) in enumerate(zip(layout.inputs.paths, layout.inputs.avals,
                                                      layout.inputs.roles, strict=True))
                 if r.kind == PARAM or (r.kind != BATCH and p.startswith("args[")
                                        and ("out" + p[4:], a.shape, a.dtype) in outs))


def returned_untouched(jaxpr: Any, donated: Sequence[int], layout: Any) -> set[int]:
    """The donated leaves other than parameters that the step hands back as they came in
    (a mask returned beside the metrics): a constant the user passes again, not state,
    so not donated (`trace.passed_through` reads the same of the outputs)."""
    ins = {id(v): i for i, v in enumerate(jaxpr.jaxpr.invars)}
    back = {ins[id(v)] for v in jaxpr.jaxpr.outvars if id(v) in ins}
    return {i for i in donated if i in back and layout.inputs.roles[i].kind != PARAM}


@dataclass(frozen=True)
class CompiledStep:
    """A compiled step and what it takes to call it."""

    mesh: Mesh
    in_shardings: tuple[NamedSharding, ...]
    compiled: Any
    compile_time_s: float
    donated: tuple[int, ...] = ()   # the input leaves the step donates


def compile_layout(fn: Callable, layout: Any, d: int, m: int,
                   placements: Sequence[Any], devices: Sequence[Any], *,
                   donate: bool = True,
                   compiler_options: dict[str, Any] | None = None,
                   r: int = 1, stages: int = 1) -> CompiledStep:
    """Lower and compile `fn` (flattened per `layout`) for this mesh and parameter layout,
    from abstract arguments only: nothing is allocated and no user array is touched.

    `placements` holds one entry per parameter: a `Strategy` or a `ParamPlacement`.
    Optimizer state kept in host memory enters and leaves the step there; the step moves
    it to device memory where the user's code reads it and back where it returns it, so
    XLA schedules (and on GPU overlaps) the transfers. A pipelined step (`stages` > 1) is
    traced inside its mesh (`jax.set_mesh`): its pipeline loop runs over the mesh's stage
    axis.
    """
    mesh = make_mesh(d, m, devices, r, stages)
    in_lay = leaf_specs(layout.inputs, placements, d, r, stages)
    out_lay = leaf_specs(layout.outputs, placements, d, r, stages)
    in_sh, out_sh = shardings(mesh, in_lay), shardings(mesh, out_lay)
    donated = donated_leaves(layout) if donate else ()
    treedef, names = layout.args_treedef, layout.kw_names
    to_device = {i: NamedSharding(mesh, x.spec, memory_kind="device")
                 for i, x in enumerate(in_lay) if x.memory_kind == HOST}
    to_host = {i: NamedSharding(mesh, x.spec, memory_kind=HOST)
               for i, x in enumerate(out_lay) if x.memory_kind == HOST}

    def step(first: dict[int, NamedSharding]) -> Callable[..., tuple[Any, ...]]:
        def flat_step(*leaves: Any) -> tuple[Any, ...]:
            leaves = tuple(jax.device_put(x, to_device[i]) if i in to_device else x
                           for i, x in enumerate(leaves))
            leaves = tuple(jax.lax.with_sharding_constraint(x, first[i]) if i in first else x
                           for i, x in enumerate(leaves))
            a, k = jax.tree_util.tree_unflatten(treedef, leaves)
            out = jax.tree_util.tree_leaves(fn(*a, **dict(zip(names, k, strict=True))))
            return tuple(jax.device_put(x, to_host[i]) if i in to_host else x
                         for i, x in enumerate(out))
        return flat_step

    opts = compiler_options
    if opts is None:
        opts = GPU_COMPILER_OPTIONS if devices[0].platform == "gpu" else {}
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s,
                                     weak_type=getattr(a, "weak_type", False))
                for a, s in zip(layout.inputs.avals, in_sh, strict=True)]

    def traced(flat: Callable[..., tuple[Any, ...]]) -> Any:
        jitted = jax.jit(flat, in_shardings=in_sh, out_shardings=out_sh,
                         donate_argnums=donated)
        return jitted.trace(*abstract)

    t0 = time.perf_counter()
    # a step calling cuDNN's fused attention traces here as it did when it was planned,
    # and one compiled for devices that cannot run the kernel says so (not XLA's error)
    with jax.set_mesh(mesh) if stages > 1 else contextlib.nullcontext(), \
            target_checks(None):
        program = traced(step({}))
        require_compilable(program.jaxpr, devices)
        untouched = returned_untouched(program.jaxpr, donated, layout)
        if untouched:
            donated = tuple(i for i in donated if i not in untouched)
            program = traced(step({}))
        first, whole = gathered_first(program.jaxpr, layout, in_lay, mesh)
        if first:
            program = traced(step(first))
        pins = gradient_pins(program.jaxpr, layout, {**zero1_weights(placements), **whole}) \
            if stages == 1 else {}
        if pins:
            program = traced(pinned(program.jaxpr, pins, mesh))
        lowered = program.lower()
    compiled = lowered.compile(compiler_options=opts or None)
    return CompiledStep(mesh, in_sh, compiled, time.perf_counter() - t0, donated)
